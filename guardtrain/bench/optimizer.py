"""``guardtrain bench --optimizer-step``: the optimizer step side by side (H49).

Adam on the bench's transformer (12 blocks, 146 parameters; ``tiny``: 2 blocks), four
configurations interleaved in one process, the order rotating every round, each with its
own model and optimizer from the same seed:

* ``eager foreach``: ``Adam(foreach=True)``, uncompiled (its fastest form on the CPU);
* ``plain compile``: ``torch.compile`` of a function that calls ``opt.step()``
  (PyTorch's recipe: three frames a step);
* ``guardtrain``: ``compile_optimizer=True`` (one frame, run directly while nothing
  changed; ``GuardTuner`` with the ``off`` preset, so only the step differs);
* ``guardtrain, full guards``: the same compiled step with every step through Dynamo's
  guards: what the direct path saves.

Each step: fresh gradients from one forward and backward (not timed), then the timed
``opt.step()``, ``zero_grad`` and, with ``schedule``, a ``LambdaLR`` step that moves the
float lr every step. Reported: the median µs per step with quartiles, the ratio of each
median to plain compile's, and the compiled steps' ``summary()["optimizers"]``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from guardtrain.bench.models import Transformer
from guardtrain.compile.optimizer import installed

__all__ = ["CONFIGS", "format_optimizer_step", "optimizer_step"]

CONFIGS = ("eager foreach", "plain compile", "guardtrain", "guardtrain, full guards")


def _make(name: str, compile_kwargs: dict[str, Any], depth: int, schedule: bool) -> dict[str, Any]:
    from guardtrain import GuardTuner

    torch.manual_seed(0)
    model = Transformer(depth=depth)
    # foreach for eager; the compiled ones trace the default update (a foreach update
    # pins a float lr: it would recompile at each new value).
    opt = torch.optim.Adam(
        model.parameters(), lr=1e-3, foreach=True if name == CONFIGS[0] else None
    )
    sched = (
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s)) if schedule else None
    )
    step: Callable[[], Any] = opt.step
    tuner = None
    if name == "plain compile":

        def plain(opt: torch.optim.Optimizer = opt) -> None:
            opt.step()

        step = torch.compile(plain, **compile_kwargs)
    elif name.startswith("guardtrain"):
        tuner = GuardTuner(
            model, "off", compile_kwargs=compile_kwargs, compile_optimizer=True, optimizers=[opt]
        )
        tuner.__enter__()
        step = opt.step
        compiled = installed(opt)
        assert compiled is not None, "compile_optimizer=True installed no compiled step"
        if name.endswith("full guards"):
            compiled.direct_allowed = False
    return {"model": model, "opt": opt, "sched": sched, "step": step, "tuner": tuner}


def _timed(run: dict[str, Any], x: torch.Tensor) -> float:
    run["model"](x).square().mean().backward()
    started = time.perf_counter_ns()
    run["step"]()
    took = (time.perf_counter_ns() - started) / 1e3
    run["opt"].zero_grad(set_to_none=True)
    if run["sched"] is not None:
        run["sched"].step()
    return took


def optimizer_step(
    backend: str = "inductor",
    steps: int = 200,
    warmup: int = 6,
    schedule: bool = True,
    tiny: bool = False,
) -> dict[str, Any]:
    """Measure the four configurations; the results as a plain dict."""
    kwargs = {"backend": backend}
    x = torch.randn(4, 8, 16)
    runs = {name: _make(name, kwargs, 2 if tiny else 12, schedule) for name in CONFIGS}
    try:
        for run in runs.values():
            for _ in range(warmup):
                _timed(run, x)
        times: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for r in range(steps):
            for k in range(len(CONFIGS)):
                name = CONFIGS[(r + k) % len(CONFIGS)]
                times[name].append(_timed(runs[name], x))
    finally:
        summaries = {}
        for name, run in runs.items():
            if run["tuner"] is not None:
                summaries[name] = run["tuner"].summary()["optimizers"]
                run["tuner"].__exit__(None, None, None)
    plain = statistics.median(times["plain compile"])
    rows = {}
    for name in CONFIGS:
        ts = sorted(times[name])
        q = len(ts) // 4
        med = statistics.median(ts)
        rows[name] = {"median_us": med, "q1_us": ts[q], "q3_us": ts[3 * q], "ratio": med / plain}
    return {
        "torch": torch.__version__,
        "backend": backend,
        "parameters": sum(1 for _ in runs[CONFIGS[0]]["model"].parameters()),
        "schedule": "LambdaLR on a float lr" if schedule else "constant lr",
        "steps": steps,
        "rows": rows,
        "optimizers": summaries,
    }


def format_optimizer_step(data: dict[str, Any]) -> str:
    """The results as a Markdown table, with the compiled steps' summaries under it."""
    lines = [
        f"torch {data['torch']}, {data['backend']}, Adam on {data['parameters']} parameters, "
        f"{data['schedule']}, {data['steps']} steps each, µs per step",
        "",
        "| step | median | quartiles | / plain compile |",
        "|---|---:|---|---:|",
    ]
    for name, row in data["rows"].items():
        lines.append(
            f"| {name} | {row['median_us']:.0f} | {row['q1_us']:.0f}-{row['q3_us']:.0f} "
            f"| {row['ratio']:.2f} |"
        )
    for name, summary in data["optimizers"].items():
        for o in summary:
            lines.append(
                f"{name}: {o['direct_steps']} steps direct, {o['full_guard_steps']} with "
                f"full guards, {o['compiles']} compiles"
            )
    return "\n".join(lines)
