"""One configuration of one model: its own copy of the model, compiled its own way.

The presets get their levers from the engine (:func:`preset_levers`: a
:class:`~guardtrain.engine.engine.GuardEngine` set up for this torch, exactly as
the callback's run would be); Dynamo's config values go through a
:class:`~guardtrain.engine.process.DynamoSettings` (from :data:`~guardtrain.engine.process.PROCESS`), switched on only while the
configuration runs, and each steady call sets the stance around its own compiled
call (H41), as in a run; what blocks the stance is
:func:`guardtrain.engine.decisions.blocker`. Only the references are the
bench's own: ``eager`` (no compile), ``compile`` (``torch.compile``'s
defaults) and the unsound ``floor`` (the unsound anchor ``aot`` is
:class:`~guardtrain.bench.anchor.AotRunner`; :func:`~guardtrain.bench.measure.make_runner`
picks each configuration's runner).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from guardtrain import filters as _filters
from guardtrain.bench.models import BenchModel
from guardtrain.compile import CompiledTarget, Miss, check_compile_kwargs, resolve_targets
from guardtrain.engine import decisions
from guardtrain.engine import levers as _levers
from guardtrain.engine.config import make_config
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import Loop
from guardtrain.engine.process import PROCESS
from guardtrain.errors import GuardTrainValueError
from guardtrain.profiling import LookupStats, LookupWindow

__all__ = [
    "ConfigLevers",
    "EngineRunner",
    "Runner",
    "floor_levers",
    "preset_levers",
]

OWNER = "guardtrain bench"


@dataclass(slots=True)
class ConfigLevers:
    """The levers of one configuration, and the Dynamo config values it sets while it runs."""

    levers: _levers.Levers
    config_values: dict[str, Any] = field(default_factory=dict)
    switched_off: list[dict[str, str]] = field(default_factory=list)
    """Levers this torch does not have (the engine's ``summary()["switched_off"]``)."""


def preset_levers(preset: str, compile_kwargs: dict[str, Any]) -> ConfigLevers:
    """The levers a preset has on this torch, resolved as the engine does for a real run.

    The engine's messages (a lever switched off, dict tags at torch's default)
    are not printed; a switched-off lever is in ``switched_off``.
    """
    config = make_config(preset, compile_kwargs=compile_kwargs, log_metrics=False)
    # The bench measures the preset even where GUARDTRAIN_DISABLE turns the adapters off.
    config = dataclasses.replace(config, disabled=False)
    quiet = Host(info=lambda _: None, warn=lambda _: None, owner=OWNER)
    lv, notes = _levers.requested(config), _levers.DictTagsNotes()
    _levers.resolve(lv, config, quiet, notes)
    return ConfigLevers(lv, _levers.config_values(config, lv, notes), list(lv.switched_off))


def _floor_filter() -> _filters.GuardFilter:
    skip_all = _filters.resolve("skip_all")
    if skip_all is None:  # pragma: no cover - torch < 2.10
        raise GuardTrainValueError(
            f"config 'floor' needs torch>=2.10 (skip_all_guards_unsafe); installed {torch.__version__}"
        )

    def keep_global_state(entries: Sequence[Any]) -> list[bool]:
        return [e.guard_type == "GLOBAL_STATE" for e in entries]

    return _filters.any_of(skip_all, keep_global_state)


def floor_levers() -> ConfigLevers:
    """The unsound lower limit (bench only): every guard skipped but Dynamo's global-state
    guard, ``install_free_tensors``, no stance."""
    return ConfigLevers(_levers.Levers(install_free_tensors=True, guard_filter=_floor_filter()))


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


class Runner:
    """One configuration of one model: its own copy of the model, compiled its own way."""

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
        self.dynamo = PROCESS.start_run(OWNER)
        self.stance_on = False
        self.config_values: dict[str, Any] = {}
        self.switched_off: list[dict[str, str]] = []
        self.use_stance = False
        self.steady = False
        self.blocked: str | None = None
        self.misses: list[str] = []
        self.compiles = 0
        self.steady_compiles = 0
        self.check_compiles = 0
        self.check_misses: list[str] = []
        self.measuring = False
        self._compile(config, backend, check_compile_kwargs({"backend": backend}))

    def _compile(self, config: str, backend: str, kwargs: dict[str, Any]) -> None:
        if config == "compile":
            self._compile_plainly(backend)
        elif config == "floor":
            self._compile_targets(floor_levers(), kwargs)
        elif config != "eager":
            self._compile_targets(preset_levers(config, kwargs), kwargs)

    def _compile_plainly(self, backend: str) -> None:
        """``torch.compile``'s defaults: the whole model, or each target's own ``compile()``."""
        if self.model.targets == [""]:
            self.call = torch.compile(self.module, backend=backend)
            return
        for _, m in resolve_targets(self.module, self.model.targets):
            m.compile(backend=backend)

    def _compile_targets(self, chosen: ConfigLevers, kwargs: dict[str, Any]) -> None:
        """One :class:`CompiledTarget` per target, with the configuration's levers."""
        levers = chosen.levers
        self.config_values = chosen.config_values
        self.switched_off = chosen.switched_off
        self.use_stance = levers.use_stance
        with self.active():
            for name, m in resolve_targets(self.module, self.model.targets):
                self.targets.append(
                    CompiledTarget(
                        name,
                        m,
                        kwargs,
                        levers.guard_filter,
                        levers.install_free_tensors,
                        on_compile=lambda t, r: None,
                        on_miss=self._on_miss,
                    )
                )

    # -- the stance and the config, switched on only while this configuration runs -----------

    def _on_miss(self, target: CompiledTarget, miss: Miss) -> bool:
        self.misses.append(f"{target.name or '<root>'}: {miss.text}")
        self._switch_stance(False)
        return not target.graph_breaks

    def _switch_stance(self, on: bool) -> None:
        """The steady state on or off for this configuration's targets (each steady call
        sets the stance around its own compiled call, H41)."""
        if on == self.stance_on:
            return
        self.stance_on = on
        for target in self.targets:
            target.set_under_stance(on, self.dynamo.stances)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Dynamo config and stance of this configuration; compiles counted."""
        before = _frames()
        try:
            self.dynamo.begin(self.config_values)
            if self.steady:
                self._switch_stance(True)
            yield
        finally:
            self._switch_stance(False)
            self.dynamo.restore()
            done = _frames() - before
            self.compiles += done
            if self.measuring:
                self.steady_compiles += done

    def blocker(self) -> str | None:
        """Why the stance must stay off (the engine's rule), or None; and a target at
        Dynamo's recompile limit: this runner sets the stance for whole windows, where a
        call that no entry accepts would raise."""
        limit = getattr(torch._dynamo.config, "recompile_limit", 8)
        full = [t.name or "<model>" for t in self.targets if t.cache_entries() >= limit]
        if full:
            return f"target {full[0]!r} reached recompile_limit={limit}"
        return decisions.blocker(self.targets)

    # -- work ----------------------------------------------------------------------------------

    def forward_no_grad(self) -> Any:
        with torch.no_grad():
            return self.call(*self.args)

    def train_step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        out = first_tensor(self.call(*self.args))
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
            self._enter_stance()
        self.measuring = True

    def _enter_stance(self) -> None:
        """Enter the stance unless the engine's blocker says no; one round to check it holds."""
        self.blocked = self.blocker()
        self.steady = self.blocked is None
        if not self.steady:
            return
        with self.active():
            if self.with_step:
                self.train_step()
            self.forward_no_grad()
        if self.misses:
            self.steady = False

    def timed(self, fn: Callable[[], Any], n: int) -> tuple[list[float], list[float]]:
        """µs of each of ``n`` calls of ``fn``, each timed on its own (gc off): by the
        calling thread's CPU time, and by the wall clock (:mod:`~guardtrain.bench.timing`)."""
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
        """Put the model's ``forward`` back (the stance and config are off outside ``active``)."""
        for target in self.targets:
            target.uninstall()
        self.targets = []


_TRAIN = Loop.TRAIN.value


class EngineRunner(Runner):
    """A preset run by a :class:`~guardtrain.engine.engine.GuardEngine` with its phases, as in
    training: what the engine does on entering the steady state (the stance, direct
    dispatch for ``turbo``) is what is measured.

    The engine compiles the model's targets in place (with ``targets=None`` rules
    off: the bench's targets are named, so repeated blocks share code as in a real
    run, H24). Each turn of this configuration (:meth:`active`) is one training
    batch of the engine (``batch_start`` / ``batch_end``) with the model's input as
    the batch; the engine decides warm-up, entry and re-arms (``warmup_steps=2``,
    ``stable_steps=1``). Audits are off (``audit_every=None``): an audit batch runs
    with full guards, which a window of steady calls must not mix in. The stance is
    set only inside the targets' own steady calls (H41), so the other configurations
    between its turns run with full guards, the engine's own state untouched.
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
        self.config_values = self.engine.config_values()
        self.use_stance = self.engine.levers.use_stance
        self._rearms_seen = 0
        self.warmup_rearms: list[str] = []
        self.warmup_batches = 0
        self.measured_phase: str | None = None
        self.engine.activate(self.module, host, root_by_default=True)
        self.engine.pause()  # its Dynamo config is set only while this configuration runs
        self.targets = list(self.engine.targets.installed)
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
            done = _frames() - before
            self.compiles += done
            if self.measuring:
                self.steady_compiles += done
            rearms = engine.rearms
            self.misses.extend(str(r["reason"]) for r in rearms[self._rearms_seen :])
            self._rearms_seen = len(rearms)
            self.targets = list(engine.targets.installed)

    def blocker(self) -> str | None:
        return self.engine.stance_blocked

    def warm_up(self, max_rounds: int = 12) -> None:
        """Batches of training steps and ``no_grad`` calls until the engine entered the
        steady state and one batch ran in it without a re-arm."""
        for _ in range(max_rounds):
            steady_before = self.engine.phase == "steady"
            rearms = len(self.misses)
            with self.active():
                for _ in range(2 if self.with_step else 0):
                    self.train_step()
                for _ in range(2):
                    self.forward_no_grad()
            if self.blocker() is not None:
                break
            if steady_before and self.engine.phase == "steady" and len(self.misses) == rearms:
                break
        self.blocked = self.blocker()
        self.steady = self.engine.phase == "steady"
        self.warmup_rearms = list(self.misses)
        self.warmup_batches = self.engine.summary()["warmup_steps_taken"]
        self.misses.clear()
        self.measuring = True

    def eval_check(self) -> tuple[bool, float]:
        self.measured_phase = self.engine.phase  # before eval() re-arms the loop
        return super().eval_check()

    def extra(self) -> dict[str, Any]:
        summary = self.engine.summary()
        out: dict[str, Any] = {
            "driver": "engine",
            "engine": {
                "phase_while_measuring": self.measured_phase,
                "phase_after_eval_check": summary["phase"],
                "warmup_batches": self.warmup_batches,
                "steady_steps": summary["steady_steps"],
                "shared_code": summary["shared_code"],
                "warmup_rearms": self.warmup_rearms[:5],
            },
        }
        for key, value in summary.items():  # direct dispatch's own report, where the engine has one
            if "dispatch" in key or "turbo" in key:
                out["engine"][key] = value
        if self.warnings:
            out["engine"]["warnings"] = self.warnings[:5]
        return out

    def close(self) -> None:
        """End the engine's run: everything it changed is put back."""
        self.engine.finish()
        self.targets = []
