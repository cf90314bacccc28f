"""One configuration of one model: its own copy of the model, compiled its own way.

Every preset is run by a :class:`~guardtrain.engine.engine.GuardEngine`, as in training
(:class:`EngineRunner`). Only the references are the bench's own (:class:`Runner`):
``eager`` (no compile), ``compile`` (``torch.compile``'s defaults) and the unsound
``floor``; the unsound anchor ``aot`` is :class:`~guardtrain.bench.anchor.AotRunner`, and
:func:`~guardtrain.bench.measure.make_runner` picks each configuration's runner.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from guardtrain import filters as _filters
from guardtrain.bench.models import BenchModel
from guardtrain.compile import CompiledTarget, Miss, check_compile_kwargs, resolve_targets
from guardtrain.engine.config import make_config
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import Loop
from guardtrain.errors import GuardTrainValueError
from guardtrain.profiling import LookupStats, LookupWindow

__all__ = ["EngineRunner", "Runner", "first_tensor"]

OWNER = "guardtrain bench"


def _floor_filter() -> _filters.GuardFilter:
    """Every guard skipped but Dynamo's global-state guard (grad mode, autocast)."""
    skip_all = _filters.resolve("skip_all")
    if skip_all is None:  # pragma: no cover - torch < 2.10
        raise GuardTrainValueError(
            f"config 'floor' needs torch>=2.10 (skip_all_guards_unsafe); installed {torch.__version__}"
        )

    def keep_global_state(entries: Sequence[Any]) -> list[bool]:
        return [e.guard_type == "GLOBAL_STATE" for e in entries]

    return _filters.any_of(skip_all, keep_global_state)


def _frames() -> int:
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def first_tensor(out: Any) -> torch.Tensor:
    """The first tensor of a model's output (a tensor, or nested tuples, lists, dicts)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, (torch.Tensor, tuple, list, dict)):
                return first_tensor(item)
    raise GuardTrainValueError(f"the model's output has no tensor: {type(out).__name__}")


REFERENCES = ("eager", "compile", "floor")
"""The configurations a :class:`Runner` serves itself: no preset among them."""


class Runner:
    """A reference configuration of one model: ``eager``, ``compile`` or ``floor``."""

    unavailable: str | None = None
    """Why this configuration cannot serve the model (nothing measured), or None."""
    step_unavailable: str | None = None
    """Why it cannot serve a training step (no ``step_us``), or None."""

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
        self.switched_off: list[dict[str, str]] = []
        self.steady = False
        self.blocked: str | None = None
        self.misses: list[str] = []
        self.compiles = self.steady_compiles = self.check_compiles = 0
        self.check_misses: list[str] = []
        self.measuring = False
        self._compile(config, backend, check_compile_kwargs({"backend": backend}))

    def _compile(self, config: str, backend: str, kwargs: dict[str, Any]) -> None:
        """``compile``: the whole model, or each target's own ``compile()``; ``floor``: one
        :class:`CompiledTarget` per target, with ``install_free_tensors`` and no stance."""
        if config not in REFERENCES:
            raise GuardTrainValueError(
                f"Runner serves the references {list(REFERENCES)}, got {config!r}: a preset "
                "runs in an EngineRunner (guardtrain.bench.measure.make_runner picks it)."
            )
        if config == "compile" and self.model.targets == [""]:
            self.call = torch.compile(self.module, backend=backend)
            return
        if config == "eager":
            return
        floor = _floor_filter() if config == "floor" else None
        for name, m in resolve_targets(self.module, self.model.targets):
            if floor is None:
                m.compile(backend=backend)
                continue
            self.targets.append(
                CompiledTarget(name, m, kwargs, floor, True, lambda t, r: None, self._on_miss)
            )

    def _on_miss(self, target: CompiledTarget, miss: Miss) -> bool:
        self.misses.append(f"{target.name or '<root>'}: {miss.text}")
        return not target.graph_breaks

    @contextmanager
    def active(self) -> Iterator[None]:
        """One turn of this configuration; its compiles counted."""
        before = _frames()
        try:
            yield
        finally:
            self._count(_frames() - before)

    def _count(self, compiled: int) -> None:
        self.compiles += compiled
        if self.measuring:
            self.steady_compiles += compiled

    # -- work ----------------------------------------------------------------------------------

    def forward_no_grad(self) -> Any:
        with torch.no_grad():
            return self.call(*self.args)

    def train_step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        out = first_tensor(self.call(*self.args))
        out.float().square().mean().backward()
        self.opt.step()

    def _round(self) -> None:
        """One turn of warm-up: two training steps (unless left out), two ``no_grad`` calls."""
        with self.active():
            for _ in range(2 if self.with_step and not self.step_unavailable else 0):
                self.train_step()
            for _ in range(2):
                self.forward_no_grad()

    def warm_up(self, max_rounds: int = 6) -> None:
        """Warm-up rounds until one compiles nothing."""
        for i in range(0 if self.unavailable else max_rounds):
            before = self.compiles
            self._round()
            if i >= 1 and self.compiles == before:
                break
        self.measuring = True

    def timed(self, fn: Callable[[], Any], n: int) -> tuple[list[float], list[float]]:
        """µs of each of ``n`` calls of ``fn``, each timed on its own (gc off): by the
        calling thread's CPU time, and by the wall clock (:mod:`~guardtrain.bench.timing`);
        nothing where this configuration cannot serve ``fn``."""
        if self.unavailable or (fn == self.train_step and self.step_unavailable):
            return [], []
        cpu, wall = [0.0] * n, [0.0] * n
        thread, perf = time.thread_time_ns, time.perf_counter_ns
        with self.active():
            gc.disable()
            try:
                for i in range(n):
                    c0, w0 = thread(), perf()
                    fn()
                    w1, c1 = perf(), thread()
                    cpu[i], wall[i] = (c1 - c0) / 1e3, (w1 - w0) / 1e3
            finally:
                gc.enable()
        return cpu, wall

    def lookup(self, n: int, window: LookupWindow) -> LookupStats | None:
        """A profiled window of ``n`` no_grad calls (None for eager, where this configuration
        cannot serve, or if a profiler runs)."""
        if self.config == "eager" or self.unavailable:
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
            out = first_tensor(self.forward_no_grad()).detach()
        self.check_compiles = self.compiles - before
        self.compiles = before
        self.check_misses = self.misses[misses:]
        del self.misses[misses:]
        reference = copy.deepcopy(self.model.module)
        reference.load_state_dict(self.module.state_dict())
        reference.eval()
        with torch.no_grad():
            ref = first_tensor(reference(*self.args))
        same_shape = out.shape == ref.shape
        diff = float((out.float() - ref.float()).abs().max()) if same_shape else math.inf
        ok = same_shape and bool(torch.allclose(out, ref, rtol=1e-3, atol=1e-4))
        return ok, diff

    def extra(self) -> dict[str, Any]:
        """What this configuration adds to its row of the results (nothing here)."""
        return {}

    def close(self) -> None:
        """Put the model's ``forward`` back."""
        for target in self.targets:
            target.uninstall()
        self.targets = []


_TRAIN = Loop.TRAIN.value


class EngineRunner(Runner):
    """A preset run by a :class:`~guardtrain.engine.engine.GuardEngine` with its phases, as in
    training: what the engine does on entering the steady state (the stance, direct
    dispatch for ``turbo``) is what is measured.

    Each turn of this configuration (:meth:`active`) is one training batch of the engine
    with the model's input as the batch; the engine compiles the named targets in place
    (repeated blocks share code as in a run, H24) and decides warm-up, entry and re-arms
    (``warmup_steps=2``, ``stable_steps=1``). Audits are off: an audit batch runs with full
    guards, which a window of steady calls must not mix in. The engine's Dynamo config is
    set only during its turns (``pause``/``resume``), the stance only inside its targets'
    steady calls (H41), so the other configurations run with torch's config and full guards.
    """

    WARMUP_STEPS = 2
    STABLE_STEPS = 1

    def _compile(self, config: str, backend: str, kwargs: dict[str, Any]) -> None:
        made = make_config(
            config,
            targets=list(self.model.targets),
            compile_kwargs=kwargs,
            log_metrics=False,
            warmup_steps=self.WARMUP_STEPS,
            stable_steps=self.STABLE_STEPS,
            audit_every=None,
            measure_lookup=False,
        )
        # The bench measures the preset even where GUARDTRAIN_DISABLE turns the adapters off.
        made = dataclasses.replace(made, disabled=False)
        self.warnings: list[str] = []
        host = Host(info=lambda _: None, warn=self.warnings.append, owner=OWNER)
        self.engine = GuardEngine(made, host)
        self.engine.setup()
        self._rearms_seen = 0
        self.warmup_rearms: list[str] = []
        self.warmup_batches = 0
        self.measured_phase: str | None = None
        self.engine.activate(self.module, host, root_by_default=True)
        self.engine.pause()  # its Dynamo config is set only while this configuration runs
        self.switched_off = list(self.engine.summary()["switched_off"])

    @contextmanager
    def active(self) -> Iterator[None]:
        """One training batch of the engine, with its Dynamo config."""
        engine = self.engine
        before = _frames()
        engine.resume()
        engine.batch_start(_TRAIN, self.args, self.module.training)
        try:
            yield
        finally:
            engine.batch_end(_TRAIN)
            engine.pause()
            self._count(_frames() - before)
            rearms = engine.rearms
            self.misses.extend(str(r["reason"]) for r in rearms[self._rearms_seen :])
            self._rearms_seen = len(rearms)

    def warm_up(self, max_rounds: int = 12) -> None:
        """Batches of training steps and ``no_grad`` calls until a preset with the stance
        entered the steady state and one batch ran in it without a re-arm (one without:
        until a batch compiled nothing), or the engine blocked the stance."""
        engine = self.engine
        for i in range(max_rounds):
            was_steady, rearms, compiles = engine.phase == "steady", len(self.misses), self.compiles
            self._round()
            if engine.levers.use_stance:
                settled = was_steady and engine.phase == "steady" and len(self.misses) == rearms
            else:
                settled = i >= 1 and self.compiles == compiles
            if settled or engine.stance_blocked is not None:
                break
        self.blocked = engine.stance_blocked
        self.steady = engine.phase == "steady"
        self.warmup_rearms = list(self.misses)
        self.warmup_batches = engine.summary()["warmup_steps_taken"]
        self.misses.clear()
        self.measuring = True

    def eval_check(self) -> tuple[bool, float]:
        self.measured_phase = self.engine.phase  # before eval() re-arms the loop
        return super().eval_check()

    def extra(self) -> dict[str, Any]:
        summary = self.engine.summary()
        seen: dict[str, Any] = {
            "phase_while_measuring": self.measured_phase,
            "phase_after_eval_check": summary["phase"],
            "warmup_batches": self.warmup_batches,
            "steady_steps": summary["steady_steps"],
            "shared_code": summary["shared_code"],
            "warmup_rearms": self.warmup_rearms[:5],
        }
        # direct dispatch's own report, where the engine has one
        seen.update((k, v) for k, v in summary.items() if "dispatch" in k or "turbo" in k)
        if self.warnings:
            seen["warnings"] = self.warnings[:5]
        return {"driver": "engine", "engine": seen}

    def close(self) -> None:
        """End the engine's run: everything it changed is put back."""
        self.engine.finish()
