"""The run: every configuration of every model, warmed up, then measured interleaved."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

from guardtrain.bench.anchor import ANCHOR, AotRunner
from guardtrain.bench.models import (
    CONFIGS,
    ENGINE_CONFIGS,
    MODELS,
    BenchModel,
    build_model,
    parse_configs,
)
from guardtrain.bench.runner import EngineRunner, Runner
from guardtrain.bench.timing import clock_of, threads
from guardtrain.compile import resolve_targets
from guardtrain.engine.process import stance_is_unsafe
from guardtrain.errors import GuardTrainValueError
from guardtrain.profiling import LookupWindow

__all__ = [
    "CALL_CHUNK",
    "METRICS",
    "STEP_CHUNK",
    "BenchOptions",
    "Progress",
    "frames_per_call",
    "make_runner",
    "run_bench",
]

METRICS = ("guard_us", "pregraph_us", "call_us", "step_us")
CALL_CHUNK = 5
"""no_grad calls per configuration before the next one takes its turn."""
STEP_CHUNK = 2

Sample = dict[str, Any]
"""One repeat of one configuration: ``guard_us``, ``pregraph_us``, ``call_us``, ... (None:
not measured)."""


@dataclasses.dataclass
class BenchOptions:
    models: list[str] = dataclasses.field(default_factory=lambda: list(MODELS))
    configs: list[str] = dataclasses.field(default_factory=lambda: list(CONFIGS))
    repeats: int = 5
    backend: str = "inductor"
    calls: int | None = None
    """no_grad calls per timing window (None: calibrated to ``window_s``)."""
    steps: int | None = None
    """Training steps per timing window (None: calibrated)."""
    window_s: float = 0.15
    threads: int | None = 1
    train_step: bool = True
    """Measure the training step (``--quick`` leaves it out: no backward compiles)."""
    tiny: bool = False
    quick: bool = False
    progress: bool = True


class Progress:
    """tqdm when it is installed, else a plain line on stderr every few seconds."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar: Any = None
        self._last, self._t0 = 0.0, time.perf_counter()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit="task", file=sys.stderr, dynamic_ncols=True)

    def update(self, desc: str, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(desc, refresh=False)
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last >= 2.0 or self.done == self.total:
            self._last = now
            print(
                f"[{self.done}/{self.total}] {now - self._t0:5.0f}s  {desc}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def make_runner(model: BenchModel, config: str, backend: str, train_step: bool = True) -> Runner:
    """The runner of ``config``: an :class:`~guardtrain.bench.runner.EngineRunner` for
    :data:`~guardtrain.bench.models.ENGINE_CONFIGS`, an
    :class:`~guardtrain.bench.anchor.AotRunner` for the anchor ``aot``."""
    cls = AotRunner if config == ANCHOR else EngineRunner if config in ENGINE_CONFIGS else Runner
    return cls(model, config, backend, train_step)


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    _load(info, "loadavg_start")
    return info


def _load(info: dict[str, Any], key: str) -> None:
    if hasattr(os, "getloadavg"):
        info[key] = [round(x, 2) for x in os.getloadavg()]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _paired(a: list[float | None], b: list[float | None]) -> list[float]:
    return [x / y for x, y in zip(a, b) if x is not None and y]


def frames_per_call(model: BenchModel) -> int:
    """Compiled frames per model call: the targets the presets compile (12 blocks for
    ``regional``, 1 for a whole model), graph breaks not counted."""
    return max(1, len(resolve_targets(model.module, model.targets)))


def _per_frame(
    rows: list[Sample], floor: list[Sample] | None, frames: int
) -> dict[str, float] | None:
    """Per repeat, ``(call - floor's call) / frames`` (paired); median, min and max, in µs."""
    if floor is None:
        return None
    diffs = [
        (s["call_us"] - f["call_us"]) / frames
        for s, f in zip(rows, floor)
        if s.get("call_us") is not None and f.get("call_us") is not None
    ]
    return _summary(diffs) if diffs else None


def _lookup(sample: Sample) -> float | None:
    g, p = sample.get("guard_us"), sample.get("pregraph_us")
    if g is None or p is None:
        return None
    return float(g + p)


@dataclasses.dataclass
class _Shared:
    """What every model of a run shares: options, the profiler window, progress."""

    options: BenchOptions
    configs: list[str]
    progress: Progress
    clock: str = "wall"
    """The clock whose times decide (:func:`~guardtrain.bench.timing.clock_of`)."""
    window: LookupWindow = dataclasses.field(default_factory=LookupWindow)
    window_costs: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Windows:
    """Calls and steps per timing window, calibrated on one configuration."""

    calls: int
    steps: int
    lookup_calls: int


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (see :mod:`guardtrain.bench`)."""
    if options.repeats < 1:
        raise GuardTrainValueError(f"--repeats must be >= 1, got {options.repeats}.")
    configs = parse_configs(options.configs)
    models = [build_model(m, tiny=options.tiny) for m in options.models]
    if stance_is_unsafe():
        raise GuardTrainValueError("the unsafe stance is set already; the bench needs full guards")
    per_model = len(configs) * (2 + options.repeats)
    shared = _Shared(options, configs, Progress(per_model * len(models), options.progress))
    shared.clock = clock_of(options.threads)
    results: list[dict[str, Any]] = []
    with threads(options.threads):
        machine = _machine()
        try:
            for model in models:
                results.extend(_run_model(model, shared))
        finally:
            shared.progress.close()
    _load(machine, "loadavg_end")
    keys = ("models", "configs", "repeats", "backend", "threads", "quick", "train_step", "tiny")
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "clock": shared.clock,
        "machine": machine,
        "options": {k: configs if k == "configs" else getattr(options, k) for k in keys},
        "results": results,
    }
    if shared.window_costs:
        out["lookup_window_cost_us"] = _summary(shared.window_costs)
    return out


def _run_model(model: BenchModel, shared: _Shared) -> list[dict[str, Any]]:
    """Warm up every configuration of ``model``, measure them interleaved, check ``eval()``."""
    runners: dict[str, Runner] = {}
    warmup_s: dict[str, float] = {}
    try:
        for config in shared.configs:
            t0 = time.perf_counter()
            torch.manual_seed(0)
            runners[config] = make_runner(
                model, config, shared.options.backend, shared.options.train_step
            )
            runners[config].warm_up()
            warmup_s[config] = time.perf_counter() - t0
            shared.progress.update(f"{model.name}: warm up {config}")
        windows = _calibrate(_calibrating(runners), shared.options)
        samples: dict[str, list[Sample]] = {c: [] for c in shared.configs}
        for r in range(shared.options.repeats):
            row = _repeat(runners, r, windows, shared)
            shared.progress.update(
                f"{model.name}: repeat {r + 1}/{shared.options.repeats}", len(shared.configs)
            )
            for config in shared.configs:
                samples[config].append(row[config])
        results = []
        frames = frames_per_call(model)
        for config in shared.configs:
            results.append(
                _result(model, runners[config], samples, windows, warmup_s[config], frames)
            )
            shared.progress.update(f"{model.name}: eval check {config}")
        return results
    finally:
        for runner in runners.values():
            runner.close()


def _calibrating(runners: dict[str, Runner]) -> Runner | None:
    """The runner the windows are calibrated on: ``compile``, else the last configuration
    that serves both the call and the step (None: none serves the call)."""
    order = [runners[c] for c in ("compile", *reversed(list(runners))) if c in runners]
    serving = [r for r in order if r.unavailable is None]
    full = [r for r in serving if r.step_unavailable is None]
    found = full or serving
    return found[0] if found else None


def _calibrate(first: Runner | None, options: BenchOptions) -> _Windows:
    """Calls and steps per window: as given, else enough for ``options.window_s``."""

    def fit(work: str, n: int, low: int, high: int) -> int:
        times = first.timed(getattr(first, work), n)[1] if first is not None else []
        took = statistics.median(times) / 1e6 if times else options.window_s
        return max(low, min(high, round(options.window_s / max(took, 1e-6))))

    calls = options.calls if options.calls is not None else fit("forward_no_grad", 5, 20, 400)
    steps = 0
    if options.train_step:
        steps = options.steps if options.steps is not None else fit("train_step", 3, 6, 200)
    return _Windows(calls, steps, max(3, min(calls, 50)))


def _repeat(
    runners: dict[str, Runner], r: int, windows: _Windows, shared: _Shared
) -> dict[str, Sample]:
    """One repeat: a profiled window per configuration, then timed calls and steps in turns.

    The order of the configurations rotates by one from repeat to repeat.
    """
    configs = shared.configs
    order = configs[r % len(configs) :] + configs[: r % len(configs)]
    row: dict[str, Sample] = {c: {"guard_us": None, "pregraph_us": None} for c in configs}
    for config in order:
        stats = runners[config].lookup(windows.lookup_calls, shared.window)
        if stats is not None:
            row[config]["guard_us"] = stats.guard_us_per_call
            row[config]["pregraph_us"] = stats.pregraph_us_per_call
            row[config]["lookups_per_call"] = stats.lookups / windows.lookup_calls
            shared.window_costs.append(stats.cost_us)
    for metric, n, chunk, work in (
        ("call", windows.calls, CALL_CHUNK, "forward_no_grad"),
        ("step", windows.steps, STEP_CHUNK, "train_step"),
    ):
        times = _timed_in_turns(runners, order, n, chunk, work)
        for config in configs:
            by = times[config]
            t = by[shared.clock]
            row[config][f"{metric}_us"] = statistics.median(t) if t else None
            row[config][f"{metric}_mean_us"] = sum(t) / len(t) if t else None
            for clock in ("cpu", "wall"):
                t = by[clock]
                row[config][f"{metric}_{clock}_us"] = statistics.median(t) if t else None
    return row


def _timed_in_turns(
    runners: dict[str, Runner], order: list[str], n: int, chunk: int, work: str
) -> dict[str, dict[str, list[float]]]:
    """``n`` timed calls of ``work`` per configuration, round-robin in chunks of ``chunk``
    (every configuration sees the same load), by each clock."""
    times: dict[str, dict[str, list[float]]] = {c: {"cpu": [], "wall": []} for c in order}
    for _ in range(-(-n // chunk) if n > 0 else 0):  # rounds of a chunk each
        for config in order:
            runner = runners[config]
            cpu, wall = runner.timed(getattr(runner, work), chunk)
            times[config]["cpu"] += cpu
            times[config]["wall"] += wall
    return times


def _medians(rows: list[Sample]) -> tuple[dict[str, float | None], dict[str, Any]]:
    """Per metric: the median over repeats, and median/min/max (the spread)."""
    measured = {m: [s[m] for s in rows if s[m] is not None] for m in METRICS}
    spread: dict[str, Any] = {m: _summary(v) for m, v in measured.items() if v}
    return {m: spread[m]["median"] if m in spread else None for m in METRICS}, spread


def _ratios(
    rows: list[Sample],
    base: list[Sample] | None,
    floor: list[Sample] | None,
    anchor: list[Sample] | None = None,
) -> tuple[dict[str, float | None], dict[str, dict[str, float]]]:
    """Paired per-repeat ratios against ``compile``, ``floor`` and the anchor ``aot`` (where
    they ran; none where the anchor could not serve): their medians, and their median, min
    and max (the spread)."""
    paired: dict[str, list[float]] = {}
    if base is not None:
        paired["lookup_vs_compile"] = _paired(
            [_lookup(s) for s in rows], [_lookup(s) for s in base]
        )
    for name, other in (("compile", base), ("floor", floor), (ANCHOR, anchor)):
        if other is None:
            continue
        for metric in ("call", "step"):
            paired[f"{metric}_vs_{name}"] = _paired(
                [s[f"{metric}_us"] for s in rows], [s[f"{metric}_us"] for s in other]
            )
    ratios = {k: (statistics.median(v) if v else None) for k, v in paired.items()}
    return ratios, {k: _summary(v) for k, v in paired.items() if v}


def _result(
    model: BenchModel,
    runner: Runner,
    samples: dict[str, list[Sample]],
    windows: _Windows,
    warmup_s: float,
    frames: int = 1,
) -> dict[str, Any]:
    """One row of the results: the eval check, medians, spread, ratios, counters."""
    matches, diff = (None, None) if runner.unavailable else runner.eval_check()
    rows = samples[runner.config]
    medians, spread = _medians(rows)
    result: dict[str, Any] = {"model": model.name, "config": runner.config, **medians}
    result.update(
        compiles=runner.compiles,
        matches_eager=matches,
        max_abs_diff=diff,
        repeats=rows,
        spread=spread,
        steady_compiles=runner.steady_compiles,
        eval_check_compiles=runner.check_compiles,
        stance=runner.steady,
    )
    if runner.blocked:
        result["stance_blocked"] = runner.blocked
    if runner.switched_off:
        result["switched_off"] = runner.switched_off
    floor = samples.get("floor")
    ratios, ratio_spread = _ratios(rows, samples.get("compile"), floor, samples.get(ANCHOR))
    per_frame = _per_frame(rows, floor, frames)
    result.update(
        misses=runner.misses[:5],
        eval_check_misses=runner.check_misses[:1],
        calls_per_window=windows.calls,
        steps_per_window=windows.steps,
        lookup_calls_per_window=windows.lookup_calls,
        warmup_s=round(warmup_s, 2),
        ratios=ratios,
        ratio_spread=ratio_spread,
        frames_per_call=frames,
        per_frame_us=None if per_frame is None else per_frame["median"],
        per_frame_spread=per_frame,
        **runner.extra(),
    )
    return result
