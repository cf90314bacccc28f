"""Launch-bound training step: plain ``torch.compile`` against ``aggressive`` and ``turbo``.

A model of many tiny layers (``--layers`` blocks of ``Linear(width, width)``,
``LayerNorm`` and ``ReLU``) at a small batch: each training step launches
hundreds of small kernels, so the host (Dynamo's entry path, guards,
guardtrain's wrapper and per-step hooks) bounds the step, not the GPU. This is
where the stance and direct dispatch are meant to pay off.

Configurations, each on its own copy of the model (same initial weights),
one after the other (a ``GuardTuner`` holds the process-wide stance, H11):

* ``eager``: no compile (reference);
* ``compile``: ``torch.compile(model, backend=...)`` with its defaults;
* ``aggressive``, ``turbo``: ``GuardTuner(model, preset, compile_kwargs=...)``;
  each step runs inside ``with tuner.step(batch):`` (its per-step cost counts).

Each configuration warms up (``--warmup`` steps at least; the presets until
``tuner.phase == "steady"``), then runs ``--repeats`` windows of ``--steps``
training steps (forward, MSE loss, backward, ``SGD.step``), with
``torch.cuda.synchronize()`` before and after each window on CUDA. Reported:
the median µs per step over the windows with its range, the ratio to
``compile``'s median, the preset's phase, compiles and re-arms, and whether the
model matches an uncompiled copy with the same weights after ``eval()``.

CUDA is the point (``--device cuda``, the default). Without CUDA the script
prints a line and exits 0, or 1 with ``--require-gpu`` (or ``GUARDTRAIN_GPU=1``).
``--device cpu`` runs the same on the CPU (for a smoke test: ``--tiny``).

    python scripts/launch_bound_check.py --out launch_bound.json
    python scripts/launch_bound_check.py --device cpu --backend eager --tiny
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

CONFIGS = ("eager", "compile", "aggressive", "turbo")


class ManyTiny(nn.Module):
    """``layers`` blocks of Linear -> LayerNorm -> ReLU on a narrow width, a linear head."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _matches_eager(
    call: Any, model: nn.Module, pristine: nn.Module, x: torch.Tensor
) -> tuple[bool, float]:
    """After ``eval()``: the output of ``call`` (the model, compiled) against an
    uncompiled copy with ``model``'s weights."""
    reference = copy.deepcopy(pristine).to(x.device)
    reference.load_state_dict(model.state_dict())
    reference.eval()
    model.eval()
    try:
        with torch.no_grad():
            out = call(x)
            ref = reference(x)
    finally:
        model.train()
    diff = float((out.float() - ref.float()).abs().max())
    return bool(torch.allclose(out, ref, rtol=1e-3, atol=1e-4)), diff


def run_config(
    config: str, pristine: nn.Module, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    from guardtrain import GuardTuner

    torch.manual_seed(0)
    model = copy.deepcopy(pristine).to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randn(args.batch, 1, generator=g).to(device)
    batch = (x, y)
    call: Any = model
    if config == "compile":
        call = torch.compile(model, backend=args.backend)

    def step() -> None:
        loss = nn.functional.mse_loss(call(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    windows: list[float] = []
    out: dict[str, Any] = {"config": config}
    t0 = time.perf_counter()
    if config in ("aggressive", "turbo"):
        with GuardTuner(
            model,
            config,  # type: ignore[arg-type]
            compile_kwargs={"backend": args.backend},
            warmup_steps=args.warmup_steps,
            stable_steps=args.stable_steps,
            measure_lookup=False,
            log_metrics=False,
        ) as tuner:
            tuner_step = tuner.step

            def tuned() -> None:
                with tuner_step(batch):
                    step()

            for i in range(args.warmup + args.max_extra_warmup):
                tuned()
                if i + 1 >= args.warmup and tuner.phase == "steady":
                    break
            out["warmup_s"] = time.perf_counter() - t0
            out["steady_before"] = tuner.phase
            for _ in range(args.repeats):
                windows.append(_window(tuned, args.steps, device))
            out["steady_after"] = tuner.phase
            out["matches_eager"], out["max_abs_diff"] = _matches_eager(model, model, pristine, x)
            summary = tuner.summary()
        out["compiles"] = summary["compiles"]
        out["rearms"] = [r["reason"] for r in summary["rearms"]][:5]
        out["steady_steps"] = summary["steady_steps"]
        for key, value in summary.items():  # direct dispatch's report, where the engine has one
            if "dispatch" in key or "turbo" in key:
                out[key] = value
    else:
        for _ in range(args.warmup):
            step()
        out["warmup_s"] = time.perf_counter() - t0
        for _ in range(args.repeats):
            windows.append(_window(step, args.steps, device))
        if config == "compile":
            out["matches_eager"], out["max_abs_diff"] = _matches_eager(call, model, pristine, x)
    out["step_us"] = _summary(windows)
    return out


def _window(fn: Any, steps: int, device: torch.device) -> float:
    """µs per step of ``steps`` calls of ``fn``, synchronised at both ends."""
    _sync(device)
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter_ns() - t0) / 1e3 / steps


def format_table(results: list[dict[str, Any]]) -> str:
    base = next((r["step_us"]["median"] for r in results if r["config"] == "compile"), None)
    lines = [
        "| config | step µs (median) | range | / compile | phase | compiles | eval ok |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for r in results:
        s = r["step_us"]
        ratio = f"{s['median'] / base:.3f}" if base else "-"
        phase = r.get("steady_after", "-")
        matches = r.get("matches_eager")
        ok = "-" if matches is None else ("yes" if matches else "NO")
        lines.append(
            f"| {r['config']} | {s['median']:.1f} | {s['min']:.1f}-{s['max']:.1f} | {ratio} "
            f"| {phase} | {r.get('compiles', '-')} | {ok} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"from {', '.join(CONFIGS)}")
    p.add_argument("--layers", type=int, default=32, help="Linear+LayerNorm+ReLU blocks")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=50, help="training steps per timed window")
    p.add_argument("--repeats", type=int, default=7, help="timed windows per configuration")
    p.add_argument("--warmup", type=int, default=20, help="steps before timing, at least")
    p.add_argument("--max-extra-warmup", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=8, help="GuardTuner warmup_steps")
    p.add_argument("--stable-steps", type=int, default=4, help="GuardTuner stable_steps")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: 1 on the CPU)"
    )
    p.add_argument("--tiny", action="store_true", help="a smoke test: 4 layers, short windows")
    p.add_argument("--require-gpu", action="store_true", help="exit 1 without CUDA")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.steps, args.repeats, args.warmup = 4, 5, 3, 6
        args.warmup_steps, args.stable_steps = 3, 2
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        p.error(f"--configs: unknown {unknown}; allowed: {', '.join(CONFIGS)}")
    args.configs = configs
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require = args.require_gpu or os.environ.get("GUARDTRAIN_GPU") == "1"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"launch-bound check: no CUDA device (torch {torch.__version__}); skipped")
        return 1 if require else 0
    device = torch.device(args.device)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)  # OpenMP threads spin against other processes
    torch.manual_seed(0)
    pristine = ManyTiny(args.layers, args.width)
    results = []
    for config in args.configs:
        print(f"launch-bound check: {config} ...", file=sys.stderr, flush=True)
        results.append(run_config(config, pristine, args, device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"launch-bound training step: {args.layers} x (Linear({args.width}) + LayerNorm + ReLU), "
        f"batch {args.batch}, backend {args.backend}, {name}, torch {torch.__version__}; "
        f"{args.repeats} windows of {args.steps} steps"
    )
    print(format_table(results))
    failed = [
        r["config"]
        for r in results
        if r.get("matches_eager") is False
        or (r["config"] in ("aggressive", "turbo") and r.get("steady_after") != "steady")
    ]
    if args.out:
        data = {"torch": torch.__version__, "device": name, "args": vars(args), "results": results}
        with open(args.out, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
    if failed:
        print(f"launch-bound check: not steady or not eager-equal: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
