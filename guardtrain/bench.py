"""``guardtrain bench``: guard overhead of each preset, side by side, in one process.

Run ``python -m guardtrain.bench --help`` (or the ``guardtrain bench`` console
script). Every configuration of every model is built once, warmed up, and then
measured in *interleaved* rounds: in each repeat, each metric is measured for
every configuration in turn (the order rotates from repeat to repeat), so slow
drifts of a shared machine hit all configurations alike. The table reports the
median over repeats and the spread (``±``: half the range, as a % of the
median); ratios are medians of the per-repeat ratios (paired samples).

Configurations:

* ``eager``: no compile.
* ``compile``: ``torch.compile`` with its defaults (``torch.compile(model)``;
  for ``regional``, ``block.compile()`` on every block: the blocks share one
  code object and one cache).
* ``off``, ``safe``, ``balanced``, ``aggressive``: the presets, applied as
  :class:`~guardtrain.GuardTuneCallback` applies them: one
  :class:`~guardtrain.compile.CompiledTarget` per target with the preset's
  filter (:func:`~guardtrain.filters.resolve` + :func:`~guardtrain.filters.with_floor`)
  and ``install_free_tensors``, ``use_recursive_dict_tags_for_guards`` as the
  preset has it while the configuration runs (every preset: torch's default, the
  config left alone), and (``use_stance``) ``set_stance(skip_guard_eval_unsafe=True)``
  after warm-up, with the targets' per-call ``training`` check and miss handler on.
* ``floor``: ``torch.compiler.skip_all_guards_unsafe`` + ``install_free_tensors``:
  the unsound lower limit, for reference. It keeps Dynamo's one global-state
  guard (grad mode, autocast), so that the training step and the ``no_grad``
  call get graphs of their own: without it the first graph compiled serves
  both (the ``no_grad`` calls would run the training graph).

Metrics per configuration: ``guard_us`` and ``pregraph_us`` (profiler events
``TorchDynamo Cache Lookup`` and ``Pregraph bytecode`` in a short profiled
window of ``no_grad`` calls in training mode; per model call, i.e. summed over
its compiled frames, 12 for ``regional``; each frame's median over the window,
see :mod:`guardtrain.overhead`), ``call_us`` (a whole ``no_grad`` call, without
the profiler), ``step_us`` (forward, backward, ``SGD.step``), ``compiles``
(Dynamo frame compiles during warm-up and measurement) and ``matches_eager``:
after the measurements (training mode), the model is switched to ``eval()``
and called under ``no_grad``; the output must equal the uncompiled model's
with the same weights. ``floor`` fails this on models with dropout: it reuses
the training-mode graph.

``call_us`` and ``step_us`` time every call on its own and take the median of
the window; within a repeat the configurations take turns every
:data:`CALL_CHUNK` calls (:data:`STEP_CHUNK` steps), so each sees the same load.

The models run with one intra-op thread by default (``--threads``): on a
machine with 2 shared cores, two OpenMP threads spin against other processes
(a 32x64 @ 64x64 matmul took 22 ms with 2 threads, 34 µs with 1).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from guardtrain import filters as _filters
from guardtrain.compile import CompiledTarget, check_compile_kwargs, resolve_targets
from guardtrain.errors import GuardTrainValueError
from guardtrain.overhead import LookupStats, LookupWindow
from guardtrain.presets import PRESETS, PresetName

__all__ = [
    "CONFIGS",
    "MODELS",
    "BenchModel",
    "BenchOptions",
    "build_model",
    "callback_cost",
    "check_targets",
    "cli",
    "format_table",
    "main",
    "parse_configs",
    "run_bench",
]

CONFIGS = ("eager", "compile", "off", "safe", "balanced", "aggressive", "floor")
"""Every configuration, in table order."""
MODELS = ("mlp", "transformer", "regional")
"""Built-in models; ``package.module:factory`` names a user model."""
QUICK_MODELS = ("transformer",)
METRICS = ("guard_us", "pregraph_us", "call_us", "step_us")
CALL_CHUNK = 5
"""no_grad calls per configuration before the next one takes its turn."""
STEP_CHUNK = 2


# -- models -------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Deep and narrow: ``depth`` modules (Linear(16, 16), ReLU alternating), then dropout.

    Host-bound: each Linear is a tiny kernel, so guards and Python dominate.
    """

    def __init__(self, depth: int = 96, width: int = 16, p: float = 0.1) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for i in range(depth):
            mods.append(nn.Linear(width, width) if i % 2 == 0 else nn.ReLU())
        self.layers = nn.Sequential(*mods)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.layers(x))


class Block(nn.Module):
    """A pre-norm transformer block with dropout."""

    def __init__(self, d: int = 64, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.drop(self.attn(y, y, y, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer(nn.Module):
    """An input projection (16 -> d) and ``depth`` pre-norm blocks."""

    def __init__(self, depth: int = 12, d: int = 64, heads: int = 4, d_in: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


@dataclasses.dataclass
class BenchModel:
    """A model to measure: the pristine module (copied per configuration) and its input."""

    name: str
    module: nn.Module
    args: tuple[Any, ...]
    targets: list[str] = dataclasses.field(default_factory=lambda: [""])
    """What the presets compile: ``[""]`` the whole model, ``["blocks.*"]`` each block."""


def _builtin(name: str, tiny: bool) -> BenchModel:
    if name == "mlp":
        return BenchModel(name, MLP(depth=8 if tiny else 96), (torch.randn(8, 16),))
    depth = 2 if tiny else 12
    targets = ["blocks.*"] if name == "regional" else [""]
    return BenchModel(name, Transformer(depth=depth), (torch.randn(4, 8, 16),), targets)


def _model_error(spec: str, why: str) -> GuardTrainValueError:
    return GuardTrainValueError(
        f"--model {spec!r}: {why}; allowed: {', '.join(MODELS)}, or package.module:factory "
        "(a function returning a module and an example input)."
    )


def build_model(spec: str, tiny: bool = False) -> BenchModel:
    """Build a built-in model by name, or call a user factory ``package.module:factory``.

    The factory takes no argument and returns ``(module, example_input)``; the
    input is a tensor or a tuple of positional arguments.

    Raises:
        GuardTrainValueError: an unknown name, or a factory that cannot be imported
            or returns something else; the message names the value and the allowed ones.
    """
    if not isinstance(spec, str) or not spec:
        raise _model_error(str(spec), "not a model name")
    if ":" not in spec:
        if spec not in MODELS:
            raise _model_error(spec, "unknown model")
        torch.manual_seed(0)
        return _builtin(spec, tiny)
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise _model_error(spec, "expected package.module:factory")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise _model_error(spec, f"cannot import {mod_name!r} ({err})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _model_error(spec, f"{mod_name!r} has no callable {attr!r}")
    torch.manual_seed(0)
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise _model_error(
            spec, f"the factory returned {type(made).__name__}, not (module, example_input)"
        )
    net, example = made
    args = example if isinstance(example, tuple) else (example,)
    return BenchModel(spec, net, args)


def parse_configs(values: Sequence[str] | None) -> list[str]:
    """Configuration names from ``--configs`` values (comma-separated or repeated), in table order."""
    if not values:
        return list(CONFIGS)
    names: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if not name:
                continue
            if name not in CONFIGS:
                raise GuardTrainValueError(
                    f"--configs: unknown configuration {name!r}; allowed: {', '.join(CONFIGS)}."
                )
            if name not in names:
                names.append(name)
    if not names:
        raise GuardTrainValueError(f"--configs is empty; allowed: {', '.join(CONFIGS)}.")
    return [c for c in CONFIGS if c in names]


# -- one configuration ---------------------------------------------------------------------------


def _frames() -> int:
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, (torch.Tensor, tuple, list, dict)):
                return _first_tensor(item)
    raise GuardTrainValueError(f"the model's output has no tensor: {type(out).__name__}")


def _floor_filter() -> _filters.GuardFilter:
    skip_all = _filters.resolve("skip_all")
    if skip_all is None:  # pragma: no cover - torch < 2.10
        raise GuardTrainValueError(
            f"config 'floor' needs torch>=2.10 (skip_all_guards_unsafe); installed {torch.__version__}"
        )

    def keep_global_state(entries: Sequence[Any]) -> list[bool]:
        return [e.guard_type == "GLOBAL_STATE" for e in entries]

    return _filters.any_of(skip_all, keep_global_state)


class Runner:
    """One configuration of one model: its own copy of the model, compiled its own way."""

    def __init__(
        self, model: BenchModel, config: str, backend: str, train_step: bool = True
    ) -> None:
        self.model = model
        self.with_step = train_step
        self.config = config
        self.module = copy.deepcopy(model.module)
        self.module.train()
        self.args = model.args
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4)
        self.call: Callable[..., Any] = self.module
        self.targets: list[CompiledTarget] = []
        self.dict_tags: bool | None = None  # None: torch's default, config left alone
        self.use_stance = False
        self.steady = False
        self.blocked: str | None = None
        self.misses: list[str] = []
        self.compiles = 0
        self.steady_compiles = 0
        self.check_compiles = 0
        self.check_misses: list[str] = []
        self.measuring = False
        self._stance_on = False
        kwargs = check_compile_kwargs({"backend": backend})
        if config == "eager":
            return
        if config == "compile":
            if model.targets == [""]:
                self.call = torch.compile(self.module, backend=backend)
            else:
                for _, m in resolve_targets(self.module, model.targets):
                    m.compile(backend=backend)
            return
        if config == "floor":
            guard_filter: _filters.GuardFilter | None = _floor_filter()
            ift = True
        else:
            preset = PRESETS[config]
            resolved = _filters.resolve(preset.guard_filter)
            guard_filter = _filters.with_floor(resolved) if resolved is not None else None
            ift = preset.install_free_tensors
            self.dict_tags = preset.recursive_dict_tags
            self.use_stance = preset.use_stance
        with self.active():
            for name, m in resolve_targets(self.module, model.targets):
                self.targets.append(
                    CompiledTarget(
                        name,
                        m,
                        kwargs,
                        guard_filter,
                        ift,
                        on_compile=lambda t, r: None,
                        on_miss=self._on_miss,
                    )
                )

    # -- the callback's levers, switched on only while this configuration runs ----------------

    def _on_miss(self, target: CompiledTarget, reason: str) -> bool:
        self.misses.append(f"{target.name or '<root>'}: {reason}")
        self._set_stance(False)
        return not target.graph_breaks

    def _set_stance(self, on: bool) -> None:
        if on == self._stance_on:
            return
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=on)
        for target in self.targets:
            target.fast = on
        self._stance_on = on

    @contextmanager
    def active(self) -> Iterator[None]:
        """Dynamo config and stance of this configuration; compiles counted."""
        cfg = torch._dynamo.config
        saved = cfg.use_recursive_dict_tags_for_guards
        if self.dict_tags is not None:
            cfg.use_recursive_dict_tags_for_guards = self.dict_tags
        before = _frames()
        try:
            if self.steady:
                self._set_stance(True)
            yield
        finally:
            self._set_stance(False)
            cfg.use_recursive_dict_tags_for_guards = saved
            done = _frames() - before
            self.compiles += done
            if self.measuring:
                self.steady_compiles += done

    def blocker(self) -> str | None:
        """Why the stance must stay off (as the callback's ``_blocker``), or None."""
        limit = getattr(torch._dynamo.config, "recompile_limit", 8)
        for t in self.targets:
            if t.graph_breaks:
                return f"target {t.name or '<root>'!r} has graph breaks"
            if t.cache_entries() >= limit:
                return f"target {t.name or '<root>'!r} reached recompile_limit"
        return None

    # -- work ----------------------------------------------------------------------------------

    def forward_no_grad(self) -> Any:
        with torch.no_grad():
            return self.call(*self.args)

    def train_step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        out = _first_tensor(self.call(*self.args))
        out.float().square().mean().backward()
        self.opt.step()

    def warm_up(self, max_rounds: int = 6) -> None:
        """Training steps and ``no_grad`` calls until a round compiles nothing; then the stance."""
        for i in range(max_rounds):
            before = self.compiles
            with self.active():
                for _ in range(2 if self.with_step else 0):
                    self.train_step()
                for _ in range(2):
                    self.forward_no_grad()
            if i >= 1 and self.compiles == before:
                break
        if self.use_stance:
            self.blocked = self.blocker()
            self.steady = self.blocked is None
            if self.steady:
                with self.active():
                    if self.with_step:
                        self.train_step()
                    self.forward_no_grad()
                if self.misses:
                    self.steady = False
        self.measuring = True

    def timed(self, fn: Callable[[], Any], n: int) -> list[float]:
        """µs of each of ``n`` calls of ``fn``, each timed on its own (gc off)."""
        times = [0.0] * n
        clock = time.perf_counter_ns
        with self.active():
            gc.disable()
            try:
                for i in range(n):
                    t0 = clock()
                    fn()
                    times[i] = (clock() - t0) / 1e3
            finally:
                gc.enable()
        return times

    def lookup(self, n: int, window: LookupWindow) -> LookupStats | None:
        """A profiled window of ``n`` no_grad calls (None for eager, or if a profiler runs)."""
        if self.config == "eager":
            return None
        with self.active():
            if not window.start():
                return None
            try:
                for _ in range(n):
                    self.forward_no_grad()
            finally:
                stats = window.stop(calls=n)
        return stats

    def eval_check(self) -> tuple[bool, float]:
        """``eval()`` after training-mode warm-up: does the output equal the uncompiled model's?"""
        self.measuring = False
        before = self.compiles
        misses = len(self.misses)
        with self.active():
            self.module.eval()
            out = _first_tensor(self.forward_no_grad()).detach()
        self.check_compiles = self.compiles - before
        self.compiles = before
        self.check_misses = self.misses[misses:]
        del self.misses[misses:]
        reference = copy.deepcopy(self.model.module)
        reference.load_state_dict(self.module.state_dict())
        reference.eval()
        with torch.no_grad():
            ref = _first_tensor(reference(*self.args))
        diff = (
            float((out.float() - ref.float()).abs().max()) if out.shape == ref.shape else math.inf
        )
        ok = out.shape == ref.shape and bool(torch.allclose(out, ref, rtol=1e-3, atol=1e-4))
        return ok, diff

    def close(self) -> None:
        self._set_stance(False)
        for target in self.targets:
            target.uninstall()
        self.targets = []


# -- the run --------------------------------------------------------------------------------------


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
        self.total = total
        self.done = 0
        self.enabled = enabled
        self._bar: Any = None
        self._last = 0.0
        self._t0 = time.perf_counter()
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


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def _paired_ratio(a: list[float | None], b: list[float | None]) -> float | None:
    ratios = [x / y for x, y in zip(a, b) if x is not None and y]
    return statistics.median(ratios) if ratios else None


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (see the module docstring)."""
    if options.repeats < 1:
        raise GuardTrainValueError(f"--repeats must be >= 1, got {options.repeats}.")
    configs = parse_configs(options.configs)
    models = [build_model(m, tiny=options.tiny) for m in options.models]
    threads = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    machine = _machine()
    results: list[dict[str, Any]] = []
    window = LookupWindow()
    window_costs: list[float] = []
    per_model = len(configs) * (2 + options.repeats)
    progress = Progress(per_model * len(models), options.progress)
    saved_stance = torch._dynamo.eval_frame._stance
    if saved_stance.skip_guard_eval_unsafe:
        raise GuardTrainValueError("the unsafe stance is set already; the bench needs full guards")
    try:
        for model in models:
            results.extend(_run_model(model, configs, options, window, window_costs, progress))
    finally:
        progress.close()
        torch.compiler.set_stance("default")
        torch.set_num_threads(threads)
    if hasattr(os, "getloadavg"):
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "machine": machine,
        "options": {
            "models": options.models,
            "configs": configs,
            "repeats": options.repeats,
            "backend": options.backend,
            "threads": options.threads,
            "quick": options.quick,
            "train_step": options.train_step,
            "tiny": options.tiny,
        },
        "results": results,
    }
    if window_costs:
        out["lookup_window_cost_us"] = _summary(window_costs)
    out["targets"] = check_targets(results)
    return out


def _run_model(
    model: BenchModel,
    configs: list[str],
    options: BenchOptions,
    window: LookupWindow,
    window_costs: list[float],
    progress: Progress,
) -> list[dict[str, Any]]:
    runners: dict[str, Runner] = {}
    warmup_s: dict[str, float] = {}
    try:
        for config in configs:
            t0 = time.perf_counter()
            torch.manual_seed(0)
            runner = Runner(model, config, options.backend, options.train_step)
            runners[config] = runner
            runner.warm_up()
            warmup_s[config] = time.perf_counter() - t0
            progress.update(f"{model.name}: warm up {config}")

        first = runners["compile" if "compile" in runners else configs[-1]]
        calls, steps = options.calls, options.steps
        if calls is None:
            per_call = statistics.median(first.timed(first.forward_no_grad, 5)) / 1e6
            calls = max(20, min(400, round(options.window_s / max(per_call, 1e-6))))
        if steps is None and options.train_step:
            per_step = statistics.median(first.timed(first.train_step, 3)) / 1e6
            steps = max(6, min(200, round(options.window_s / max(per_step, 1e-6))))
        if not options.train_step or steps is None:
            steps = 0
        lookup_calls = max(3, min(calls, 50))

        samples: dict[str, list[dict[str, float | None]]] = {c: [] for c in configs}
        for r in range(options.repeats):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            row: dict[str, dict[str, float | None]] = {
                c: {"guard_us": None, "pregraph_us": None} for c in configs
            }
            for config in order:
                stats = runners[config].lookup(lookup_calls, window)
                if stats is not None:
                    row[config]["guard_us"] = stats.guard_us_per_call
                    row[config]["pregraph_us"] = stats.pregraph_us_per_call
                    row[config]["lookups_per_call"] = stats.lookups / lookup_calls
                    window_costs.append(stats.cost_us)
            for metric, n, chunk, work in (
                ("call", calls, CALL_CHUNK, "forward_no_grad"),
                ("step", steps, STEP_CHUNK, "train_step"),
            ):
                # Round-robin in small chunks: every configuration sees the same load.
                times: dict[str, list[float]] = {c: [] for c in configs}
                while n > 0 and len(times[order[0]]) < n:
                    for config in order:
                        runner = runners[config]
                        times[config] += runner.timed(getattr(runner, work), chunk)
                for config in configs:
                    t = times[config]
                    row[config][f"{metric}_us"] = statistics.median(t) if t else None
                    row[config][f"{metric}_mean_us"] = sum(t) / len(t) if t else None
            progress.update(f"{model.name}: repeat {r + 1}/{options.repeats}", len(configs))
            for config in configs:
                samples[config].append(row[config])

        results = []
        base = samples.get("compile")
        floor = samples.get("floor")
        for config in configs:
            runner = runners[config]
            matches, diff = runner.eval_check()
            progress.update(f"{model.name}: eval check {config}")
            rows = samples[config]
            result: dict[str, Any] = {"model": model.name, "config": config}
            spread: dict[str, Any] = {}
            for metric in METRICS:
                values = [v for v in (s[metric] for s in rows) if v is not None]
                if values:
                    summary = _summary(values)
                    result[metric] = summary["median"]
                    spread[metric] = summary
                else:
                    result[metric] = None
            result["compiles"] = runner.compiles
            result["matches_eager"] = matches
            result["max_abs_diff"] = diff
            result["repeats"] = rows
            result["spread"] = spread
            result["steady_compiles"] = runner.steady_compiles
            result["eval_check_compiles"] = runner.check_compiles
            result["stance"] = runner.steady
            if runner.blocked:
                result["stance_blocked"] = runner.blocked
            result["misses"] = runner.misses[:5]
            result["eval_check_misses"] = runner.check_misses[:1]
            result["calls_per_window"] = calls
            result["steps_per_window"] = steps
            result["lookup_calls_per_window"] = lookup_calls
            result["warmup_s"] = round(warmup_s[config], 2)
            ratios: dict[str, float | None] = {}
            lookup = [_lookup(s) for s in rows]
            if base is not None:
                ratios["lookup_vs_compile"] = _paired_ratio(lookup, [_lookup(s) for s in base])
                ratios["call_vs_compile"] = _paired_ratio(
                    [s["call_us"] for s in rows], [s["call_us"] for s in base]
                )
                ratios["step_vs_compile"] = _paired_ratio(
                    [s["step_us"] for s in rows], [s["step_us"] for s in base]
                )
            if floor is not None:
                ratios["call_vs_floor"] = _paired_ratio(
                    [s["call_us"] for s in rows], [s["call_us"] for s in floor]
                )
                ratios["step_vs_floor"] = _paired_ratio(
                    [s["step_us"] for s in rows], [s["step_us"] for s in floor]
                )
            result["ratios"] = ratios
            results.append(result)
        return results
    finally:
        for runner in runners.values():
            runner.close()


def _lookup(sample: dict[str, float | None]) -> float | None:
    g, p = sample.get("guard_us"), sample.get("pregraph_us")
    if g is None or p is None:
        return None
    return g + p


# -- targets and the table ------------------------------------------------------------------------

#: (config, what, bound): guard + pre-graph as a fraction of compile's; whole call vs floor.
TARGETS = (
    ("aggressive", "lookup_vs_compile", 0.05),
    ("balanced", "lookup_vs_compile", 0.25),
    ("safe", "lookup_vs_compile", 0.50),
    ("aggressive", "call_vs_floor", 1.03),
)


def check_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets per model (where both sides were measured)."""
    by_key = {(r["model"], r["config"]): r for r in results}
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        for config, what, bound in TARGETS:
            r = by_key.get((model, config))
            if r is None:
                continue
            value = r["ratios"].get(what)
            if value is None:
                continue
            out.append(
                {
                    "model": model,
                    "config": config,
                    "what": what,
                    "bound": bound,
                    "value": value,
                    "met": value <= bound,
                }
            )
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _spread(result: dict[str, Any], metric: str) -> str:
    s = result.get("spread", {}).get(metric)
    if not s or not s["median"]:
        return ""
    return f" ±{(s['max'] - s['min']) / 2 / s['median'] * 100:.0f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(data: dict[str, Any]) -> str:
    """The terminal table: medians, spread (± half range in % of the median), ratios."""
    header = [
        "model",
        "config",
        "guard µs",
        "pregraph µs",
        "g+p /compile",
        "call µs",
        "/compile",
        "/floor",
        "step µs",
        "/compile",
        "/floor",
        "compiles",
        "eval ok",
    ]
    rows = [header]
    for r in data["results"]:
        ratios = r.get("ratios", {})
        rows.append(
            [
                r["model"],
                r["config"],
                _fmt(r["guard_us"]) + _spread(r, "guard_us"),
                _fmt(r["pregraph_us"]) + _spread(r, "pregraph_us"),
                _ratio(ratios.get("lookup_vs_compile")),
                _fmt(r["call_us"]) + _spread(r, "call_us"),
                _ratio(ratios.get("call_vs_compile")),
                _ratio(ratios.get("call_vs_floor")),
                _fmt(r["step_us"]) + _spread(r, "step_us"),
                _ratio(ratios.get("step_vs_compile")),
                _ratio(ratios.get("step_vs_floor")),
                str(r["compiles"]),
                ("yes" if r["matches_eager"] else "NO")
                + ("" if r["config"] != "floor" else " (unsound)"),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("| " + " | ".join(cells) + " |")
        if n == 0:
            lines.append(
                "|"
                + "|".join(
                    "-" * (w + 1) + ":" if i >= 2 else "-" * (w + 2) for i, w in enumerate(widths)
                )
                + "|"
            )
    notes = []
    opts = data.get("options", {})
    notes.append(
        f"torch {data['torch']}, backend {opts.get('backend')}, {opts.get('repeats')} repeats, "
        f"{data['machine'].get('torch_threads')} thread(s), load "
        f"{data['machine'].get('loadavg_start')} -> {data['machine'].get('loadavg_end')}"
    )
    notes.append(
        "µs: median over repeats, ± half the range in % of the median; ratios: median of "
        "per-repeat ratios; guard/pregraph: per model call (all compiled frames); "
        "call/step: median call of each window."
    )
    for r in data["results"]:
        extra = []
        if r.get("steady_compiles"):
            extra.append(f"{r['steady_compiles']} compile(s) while measuring")
        if r.get("stance_blocked"):
            extra.append(f"stance blocked: {r['stance_blocked']}")
        if r.get("misses"):
            extra.append(f"stance misses: {r['misses'][0]}")
        if extra:
            notes.append(f"{r['model']}/{r['config']}: " + "; ".join(extra))
    for t in data.get("targets", []):
        notes.append(
            f"target {t['model']}/{t['config']} {t['what']} <= {t['bound']}: "
            f"{t['value']:.3f} {'met' if t['met'] else 'NOT met'}"
        )
    cost = data.get("lookup_window_cost_us")
    if cost:
        notes.append(
            f"LookupWindow own cost (start+stop+parse): median {cost['median']:.0f} µs "
            f"(min {cost['min']:.0f}, max {cost['max']:.0f})"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GuardTrainValueError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            '(or pip install "guardtrain[bench]").'
        ) from None


def plot(data: dict[str, Any], path: str) -> None:
    """A PNG bar chart: per model, guard + pre-graph µs, call µs and step µs per configuration."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in data["results"]))
    panels = (
        ("guard + pre-graph µs per call", None),
        ("call µs", "call_us"),
        ("step µs", "step_us"),
    )
    fig, axes = plt.subplots(
        len(models), 3, figsize=(15, 3.6 * len(models)), squeeze=False, constrained_layout=True
    )
    for i, model in enumerate(models):
        rows = [r for r in data["results"] if r["model"] == model]
        names = [r["config"] for r in rows]
        xs = list(range(len(rows)))
        for j, (title, metric) in enumerate(panels):
            ax = axes[i][j]
            if metric is None:
                guard = [r["guard_us"] or 0.0 for r in rows]
                pre = [r["pregraph_us"] or 0.0 for r in rows]
                ax.bar(xs, guard, label="guards", color="#c44e52")
                ax.bar(xs, pre, bottom=guard, label="pre-graph", color="#dd8452")
                ax.legend(fontsize=8)
            elif all(r[metric] is None for r in rows):
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            else:
                vals = [r[metric] or 0.0 for r in rows]
                err_lo, err_hi = [], []
                for r, v in zip(rows, vals):
                    s = r.get("spread", {}).get(metric)
                    err_lo.append(v - s["min"] if s else 0.0)
                    err_hi.append(s["max"] - v if s else 0.0)
                ax.bar(xs, vals, yerr=[err_lo, err_hi], capsize=3, color="#4c72b0")
            ax.set_xticks(xs)
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{model}: {title}", fontsize=10)
    fig.suptitle(
        f"guardtrain bench (torch {data['torch']}, {data['options']['backend']}, "
        f"median of {data['options']['repeats']})"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the callback's own cost ----------------------------------------------------------------------


def callback_cost(
    preset: PresetName = "aggressive",
    iterations: int = 20000,
    repeats: int = 7,
    profile: bool = True,
) -> dict[str, Any]:
    """µs per training step of the callback's hooks in the steady state, and what costs what.

    A tiny real ``Trainer.fit`` (eager backend, a CSV logger) runs until the
    callback is steady; then, inside a later ``on_train_batch_end``, the
    callback's ``on_train_batch_start`` + ``on_train_batch_end`` are called
    directly on that batch ``iterations`` times (Lightning's hook dispatch is
    not included), ``repeats`` times; medians are reported.
    """
    import tempfile
    import warnings

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from guardtrain.callback import GuardTuneCallback
    from guardtrain.monitor import batch_signature

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    guard = GuardTuneCallback(
        preset, warmup_steps=4, stable_steps=2, compile_kwargs={"backend": "eager"}
    )
    measured: dict[str, Any] = {}

    def per_step(fn: Callable[[], None], n: int) -> float:
        values = []
        for _ in range(repeats):
            gc.disable()
            try:
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    fn()
                t1 = time.perf_counter_ns()
            finally:
                gc.enable()
            values.append((t1 - t0) / 1e3 / n)
        return statistics.median(values)

    class Probe(L.Callback):
        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if measured or guard.phase != "steady" or batch_idx < 12:
                return
            start, end = guard.on_train_batch_start, guard.on_train_batch_end
            bs, be = guard._batch_start, guard._batch_end

            def hooks() -> None:
                start(trainer, pl_module, batch, batch_idx)
                end(trainer, pl_module, outputs, batch, batch_idx)

            def empty() -> None:
                pass

            pieces = {
                "hooks (on_train_batch_start + on_train_batch_end)": hooks,
                "_batch_start": lambda: bs("train", batch, pl_module),
                "_batch_end": lambda: be("train"),
                "batch_signature": lambda: batch_signature(batch),
                "machine.new_signature": lambda: guard._machine.new_signature(
                    "train", batch_signature(batch)
                ),
                "_log_changes": guard._log_changes,
                "phase (property)": lambda: guard.phase,
                "empty call (loop + lambda)": empty,
            }
            measured["steady_before"] = guard.phase
            us = {k: per_step(f, iterations) for k, f in pieces.items()}
            audit_every = getattr(guard, "audit_every", None)
            if audit_every is not None:
                guard.audit_every = None  # the same hooks without the periodic audit batch
                us["hooks, audit_every=None"] = per_step(hooks, iterations)
                guard.audit_every = audit_every
            measured["us"] = us
            measured["audit_every"] = audit_every
            measured["steady_after"] = guard.phase
            if profile:
                import cProfile
                import io
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(iterations):
                    hooks()
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
                measured["cprofile"] = buf.getvalue()
            trainer.should_stop = True

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 16, 8, generator=g)
    y = torch.randn(64 * 16, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=CSVLogger(tmp),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[guard, Probe()],
        )
        trainer.fit(Net(), loader)
    if not measured:
        raise RuntimeError(
            f"the callback never reached the steady state (phase {guard.phase!r}); "
            f"summary: {guard.summary()}"
        )
    return {
        "torch": torch.__version__,
        "preset": preset,
        "iterations": iterations,
        "repeats": repeats,
        "us_per_step": measured["us"],
        "steady": measured["steady_before"] == "steady" and measured["steady_after"] == "steady",
        "cprofile": measured.get("cprofile", ""),
        "audit_every": measured.get("audit_every"),
        "target_us": 2.0,
    }


def format_callback_cost(data: dict[str, Any]) -> str:
    lines = [
        f"callback cost, preset {data['preset']}, steady state, median of {data['repeats']} x "
        f"{data['iterations']} iterations (torch {data['torch']}); the hooks include the "
        f"callback's audit batch every {data.get('audit_every')} steps, amortised",
    ]
    width = max(len(k) for k in data["us_per_step"])
    for name, us in data["us_per_step"].items():
        lines.append(f"  {name.ljust(width)}  {us:7.2f} µs")
    total = next(iter(data["us_per_step"].values()))
    verdict = "met" if total <= data["target_us"] else "NOT met"
    lines.append(f"  target <= {data['target_us']} µs per step: {verdict}")
    if data.get("cprofile"):
        lines.append("")
        lines.append("cProfile of the hooks (tottime; cProfile inflates every call):")
        lines.append(data["cprofile"].strip())
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Measure guard, pre-graph, whole-call and training-step time of eager, "
            "torch.compile, the guardtrain presets and the unsound floor, interleaved "
            "in one process."
        ),
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help=f"{', '.join(MODELS)} or package.module:factory (repeatable; "
        "default: all built-in models; --quick: transformer)",
    )
    p.add_argument(
        "--configs",
        action="append",
        metavar="LIST",
        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)",
    )
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument(
        "--calls", type=int, default=None, help="no_grad calls per window (default: calibrated)"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per window (default: calibrated)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1; 0 keeps torch's)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="transformer only, no training step, shorter windows (see docs/bench.md)",
    )
    p.add_argument(
        "--no-step", action="store_true", help="leave out the training step (no backward compile)"
    )
    p.add_argument("--tiny", action="store_true", help="shrink the built-in models (smoke tests)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--callback-cost",
        action="store_true",
        help="measure the callback's per-step hook cost in the steady state instead",
    )
    p.add_argument("--preset", default="aggressive", help="preset for --callback-cost")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m guardtrain.bench") -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    try:
        if args.plot:
            _require_matplotlib()
        if args.callback_cost:
            if args.preset not in PRESETS:
                raise GuardTrainValueError(
                    f"--preset {args.preset!r}: unknown preset; allowed: {', '.join(PRESETS)}."
                )
            threads = torch.get_num_threads()
            if args.threads:
                torch.set_num_threads(args.threads)
            try:
                data = callback_cost(preset=args.preset)
            finally:
                torch.set_num_threads(threads)
            print(format_callback_cost(data))
            if args.json:
                _write_json(args.json, data)
            return 0
        configs = parse_configs(args.configs)
        models = args.model or list(QUICK_MODELS if args.quick else MODELS)
        models = [m.strip() for value in models for m in value.split(",") if m.strip()]
        for spec in models:  # fail on a bad name before anything is compiled
            if ":" not in spec and spec not in MODELS:
                raise _model_error(spec, "unknown model")
        options = BenchOptions(
            models=models,
            configs=configs,
            repeats=args.repeats if args.repeats is not None else 5,
            backend=args.backend,
            calls=args.calls,
            steps=args.steps,
            window_s=0.1 if args.quick else 0.2,
            train_step=not (args.quick or args.no_step),
            threads=args.threads or None,
            tiny=args.tiny,
            quick=args.quick,
            progress=not args.no_progress,
        )
        t0 = time.perf_counter()
        data = run_bench(options)
        data["wall_s"] = round(time.perf_counter() - t0, 1)
        data["command"] = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
    except GuardTrainValueError as err:
        parser.error(str(err))
    print(format_table(data))
    print(f"\nwall time {data['wall_s']} s")
    if args.json:
        _write_json(args.json, data)
    if args.plot:
        plot(data, args.plot)
    return 0


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


def cli(argv: Sequence[str] | None = None) -> int:
    """The ``guardtrain`` console script: ``guardtrain bench [options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: guardtrain bench [options]   (guardtrain bench --help for the options)")
        return 0 if argv else 2
    if argv[0] != "bench":
        print(f"guardtrain: unknown command {argv[0]!r}; allowed: bench", file=sys.stderr)
        return 2
    return main(argv[1:], prog="guardtrain bench")


if __name__ == "__main__":
    sys.exit(main())
