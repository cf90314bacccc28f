"""``guardtrain bench --optimizer-step``: the optimizer step side by side (H49).

Adam on the bench's transformer at two sizes, 12 blocks (146 parameters) and 84 blocks
(1,010 parameters; ``tiny``: 2 and 4 blocks). At each size four configurations run
interleaved in one process, the order rotating every round, each with its own model and
optimizer from the same seed:

* ``eager foreach``: ``Adam(foreach=True)``, uncompiled (its fastest form on the CPU);
* ``plain compile``: ``torch.compile`` of a function that calls ``opt.step()``
  (PyTorch's recipe: three frames a step);
* ``guardtrain``: ``compile_optimizer=True`` (one frame, run directly while nothing
  changed, with full guards on a step whose lr the schedule moved; ``GuardTuner`` with the
  ``off`` preset, so only the step differs);
* ``guardtrain, full guards``: the same compiled step with every step through Dynamo's
  guards: what the direct path saves.

Each step: fresh gradients from one forward and backward (not timed), then the timed
``opt.step()``, ``zero_grad`` and, with ``schedule``, a ``LambdaLR`` step that moves the
float lr every step, timed by the clock that decides (:mod:`~guardtrain.bench.timing`).
Reported per size: the median µs per step with quartiles and each ratio to plain compile;
the direct path's own check (:func:`_check_us`) against plain compile's cache lookup per
step (:func:`_lookup_us`), which ``--check`` holds to :data:`CHECK_SHARE`; and the compiled
steps' ``summary()["optimizers"]``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from guardtrain.bench.models import Transformer
from guardtrain.bench.timing import CLOCKS, clock_of, describe
from guardtrain.compile.optimizer import installed
from guardtrain.profiling import LookupWindow

__all__ = ["CHECK_SHARE", "CONFIGS", "DEPTHS", "format_optimizer_step", "optimizer_step"]

CONFIGS = ("eager foreach", "plain compile", "guardtrain", "guardtrain, full guards")
DEPTHS = (12, 84)
"""The transformer's blocks at the two sizes: 146 and 1,010 parameters."""
TINY_DEPTHS = (2, 4)
CHECK_SHARE = 0.10
"""``--check``: the direct path's check per step, as a share of plain compile's lookup."""


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


def _step(run: dict[str, Any], x: torch.Tensor, clock: Callable[[], int]) -> float:
    """One step: gradients (not timed), then the timed step; µs."""
    run["model"](x).square().mean().backward()
    started = clock()
    run["step"]()
    took = (clock() - started) / 1e3
    run["opt"].zero_grad(set_to_none=True)
    if run["sched"] is not None:
        run["sched"].step()
    return took


def _check_us(run: dict[str, Any], x: torch.Tensor, clock: Callable[[], int]) -> float | None:
    """The direct path's check on its own, in the steady state (gradients fresh, the
    entry harvested, nothing moved), as a step runs it (``StepCheck.change``, under
    ``no_grad``): median µs of 50; None where no entry is harvested (a schedule moves the
    lr every step: those steps run with full guards)."""
    compiled = installed(run["opt"])
    check = None if compiled is None else compiled.check
    run["model"](x).square().mean().backward()
    times: list[float] = []
    with torch.no_grad():
        while check is not None and len(times) < 50:
            started = clock()
            change = check.change(run["opt"])
            times.append((clock() - started) / 1e3)
            if change is not None:
                raise RuntimeError(f"the direct path's check found a change: {change}")
    run["opt"].zero_grad(set_to_none=True)
    return statistics.median(times) if times else None


def _lookup_us(run: dict[str, Any], x: torch.Tensor, steps: int = 5) -> float | None:
    """Plain compile's cache lookup per step: the profiled "TorchDynamo Cache Lookup"
    events of its frames (None when another profiler runs)."""
    window = LookupWindow()
    if not window.start():
        return None
    for _ in range(steps):
        _step(run, x, time.perf_counter_ns)
    stats = window.stop(calls=steps)
    return None if stats is None else stats.guard_us_per_call


def _size(
    depth: int, kwargs: dict[str, Any], steps: int, warmup: int, schedule: bool, clock: str
) -> dict[str, Any]:
    """The four configurations at one size, interleaved; then the check against the lookup."""
    x = torch.randn(4, 8, 16)
    runs = {name: _make(name, kwargs, depth, schedule) for name in CONFIGS}
    read = CLOCKS[clock]
    try:
        times = _interleaved(runs, x, read, steps, warmup)
        checks = [_check_us(runs["guardtrain"], x, read) for _ in range(5)]
        lookups = [_lookup_us(runs["plain compile"], x) for _ in range(3)]
    finally:
        summaries = _close(runs)
    found = [c for c in checks if c is not None]
    check = statistics.median(found) if found else None
    lookup = statistics.median([v for v in lookups if v is not None] or [float("nan")])
    share = check / lookup if check is not None and lookup == lookup and lookup else None
    return {
        "parameters": sum(1 for _ in runs[CONFIGS[0]]["model"].parameters()),
        "rows": _rows(times),
        "check_us": check,
        "plain_lookup_us": lookup,
        "check_share": share,
        "optimizers": summaries,
    }


def _interleaved(
    runs: dict[str, dict[str, Any]], x: torch.Tensor, read: Any, steps: int, warmup: int
) -> dict[str, list[float]]:
    """Each configuration's step times, the order rotating by one every round."""
    for run in runs.values():
        for _ in range(warmup):
            _step(run, x, read)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for r in range(steps):
        for k in range(len(CONFIGS)):
            name = CONFIGS[(r + k) % len(CONFIGS)]
            times[name].append(_step(runs[name], x, read))
    return times


def _close(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each tuner's optimizer summary, after which it is closed."""
    summaries = {}
    for name, run in runs.items():
        if run["tuner"] is not None:
            summaries[name] = run["tuner"].summary()["optimizers"]
            run["tuner"].__exit__(None, None, None)
    return summaries


def _rows(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each configuration's median and quartiles, and its ratio to plain compile's median."""
    plain = statistics.median(times["plain compile"])
    rows = {}
    for name in CONFIGS:
        ts = sorted(times[name])
        q = len(ts) // 4
        med = statistics.median(ts)
        rows[name] = {"median_us": med, "q1_us": ts[q], "q3_us": ts[3 * q], "ratio": med / plain}
    return rows


def optimizer_step(
    backend: str = "inductor",
    steps: int = 200,
    warmup: int = 6,
    schedule: bool = True,
    tiny: bool = False,
    threads: int | None = 1,
) -> dict[str, Any]:
    """Measure the four configurations at each size; the results as a plain dict."""
    clock = clock_of(threads)
    kwargs = {"backend": backend}
    sizes = [
        _size(depth, kwargs, steps, warmup, schedule, clock)
        for depth in (TINY_DEPTHS if tiny else DEPTHS)
    ]
    return {
        "torch": torch.__version__,
        "backend": backend,
        "clock": clock,
        "schedule": "LambdaLR on a float lr" if schedule else "constant lr",
        "steps": steps,
        "sizes": sizes,
    }


def format_optimizer_step(data: dict[str, Any]) -> str:
    """The results as a Markdown table per size, each with its check line and the compiled
    steps' summaries."""
    lines = [
        f"torch {data['torch']}, {data['backend']}, Adam, {data['schedule']}, "
        f"{data['steps']} steps each, µs per step by {describe(data['clock'])}",
    ]
    for size in data["sizes"]:
        lines += [
            "",
            f"{size['parameters']} parameters:",
            "",
            "| step | median | quartiles | / plain compile |",
            "|---|---:|---|---:|",
        ]
        for name, row in size["rows"].items():
            lines.append(
                f"| {name} | {row['median_us']:.0f} | {row['q1_us']:.0f}-{row['q3_us']:.0f} "
                f"| {row['ratio']:.2f} |"
            )
        share, check = size["check_share"], size["check_us"]
        lines.append(
            (
                "no direct step: the schedule moves the lr every step (full guards)"
                if check is None
                else f"direct path's check {check:.1f} µs a step"
            )
            + f"; plain compile's lookup {size['plain_lookup_us']:.0f} µs a step"
            + ("" if share is None else f"; share {share:.3f}")
        )
        for name, summary in size["optimizers"].items():
            for o in summary:
                lines.append(
                    f"{name}: {o['direct_steps']} steps direct, {o['full_guard_steps']} with "
                    f"full guards, {o['compiles']} compiles"
                )
    return "\n".join(lines)
