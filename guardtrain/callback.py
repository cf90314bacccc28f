"""GuardTuneCallback: Lightning hooks only; decisions live in phases, compile and monitor."""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from guardtrain import filters as _filters
from guardtrain.compile import (
    CompiledTarget,
    TakeOver,
    check_compile_kwargs,
    resolve_targets,
    take_over_compiled,
)
from guardtrain.errors import GuardTrainRuntimeError, GuardTrainTypeError, GuardTrainValueError
from guardtrain.monitor import (
    CompileMonitor,
    batch_signature,
    describe_signature,
    fingerprint_change,
    module_fingerprint,
)
from guardtrain.phases import PHASE_NUMBERS, PhaseMachine
from guardtrain.presets import GuardPreset, PresetName, get_preset

__all__ = ["GuardTuneCallback"]


def _every(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GuardTrainTypeError(f"`{name}` must be an int or None, got {value!r}.")
    if value < 1:
        raise GuardTrainValueError(f"`{name}` must be >= 1 (or None to disable), got {value}.")
    return value


def _parameters(fn: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


DISABLE_ENV = "GUARDTRAIN_DISABLE"


class GuardTuneCallback(Callback):
    r"""Compile the model, warm up, lock guards, and fall back to full guards on any change.

    The callback compiles its targets in place when the run starts (after the
    strategy placed the model), counts Dynamo compilations while each loop warms
    up, then runs that loop under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
    (presets ``balanced`` and ``aggressive``). Whenever the inputs or the model
    differ from what was warmed, the loop goes back to full guards (a *re-arm*)
    and the reason is recorded. At the end of the run everything it changed is
    restored: the stance, Dynamo's config, and the modules' ``forward``.

    What is checked when:

    * **every batch** (the whole steady-state hook work: about 2.7 µs): the batch
      signature (shapes, dtypes and devices of the batch's tensors) against those
      seen with full guards, and the LightningModule's ``training`` flag. An
      unseen signature leaves the stance *before* the step runs.
    * **at loop and epoch boundaries** (in the first batch-start hook of the loop,
      after every other callback's epoch-start hook), and every ``audit_every``
      batches: identity, ``requires_grad``, dtype, device and shape of every
      parameter and buffer of each target, the hooks of every submodule, and
      every constant, identity, type and hook guard Dynamo built on module
      attributes (``dropout.p``, BatchNorm ``momentum``, a float read in
      ``forward``). A change a dropped guard would have caught rebuilds the target
      (the next call recompiles); one the kept guards catch leaves the stance.
    * **in each compiled call under the stance**: the call's ``(training, grad
      mode, autocast)`` must be a combination compiled with full guards (the
      stance does not check ``training``, H1), else the stance is left first; a
      cache miss (H4) leaves the stance and retries the call once with full
      guards. Dynamo raises before the frame runs, and targets with graph breaks
      keep every guard and never use the stance, so no part of a step runs twice.

    Args:
        preset: ``"off"``, ``"safe"``, ``"balanced"`` or ``"aggressive"`` (see
            :data:`guardtrain.PRESETS`). Explicit arguments below override it.
        warmup_steps: training batches with full guards before the stance (preset: 20).
        stable_steps: the last ``stable_steps`` batches must not have compiled (preset: 10).
        targets: ``None`` (the network the LightningModule delegates to, when it
            has exactly one child with parameters; else the LightningModule), or
            submodule names / glob patterns (``"blocks.*"``, outermost matches).
            ``""`` names the LightningModule itself.
        compile_kwargs: ``backend``, ``mode``, ``fullgraph``, ``dynamic``,
            ``options`` for ``torch.compile``.
        guard_filter: a filter name from :mod:`guardtrain.filters`, a callable
            ``guard_filter_fn``, or a list of them; replaces the preset's filter.
            It is combined with the soundness floor.
        install_free_tensors: compile with ``install_free_tensors``.
        recursive_dict_tags: ``use_recursive_dict_tags_for_guards`` during the run;
            ``None`` (every preset) leaves torch's default (off since torch 2.12,
            after segfaults: pytorch/pytorch#181873). ``True`` where torch's
            default is off warns once.
        use_stance: enter the unsafe stance once a loop is warm.
        unsafe_drop_floor: do not combine the guard filter with the soundness
            floor. Unsafe: ``eval()`` or a new dtype may then silently reuse code.
        log_metrics: log ``guard/phase``, ``guard/compiles`` and ``guard/rearms``
            through the Trainer's loggers when they change.
        audit_every: every ``audit_every`` steady training batches, repeat the
            boundary re-check inside the epoch and run one batch with full guards;
            a compile in that batch means an assumption of the stance broke (a
            global read in ``forward`` changed, say): re-arm with its reason.
            ``None`` disables audits. Cost: one batch with full guards (tens to
            hundreds of µs of guard evaluation) and one walk over the parameters
            per audit; at the default of 200 that is well under 1 µs per step.
        verify_every: every ``verify_every`` steady training batches, run the eager
            ``forward`` beside the compiled one (same RNG state and buffers, under
            ``no_grad``) and rebuild the target with a report when the outputs
            differ beyond ``verify_rtol``/``verify_atol``. Off by default: each
            verified batch costs one more eager forward and one copy of the
            buffers (measured: a 24-module MLP's compiled call went from 721 to
            1727 µs, eager backend, CPU). With inductor, random ops (dropout) in training mode draw
            differently from eager unless ``torch._inductor.config.fallback_random``.
        verify_rtol: relative tolerance of ``verify_every``.
        verify_atol: absolute tolerance of ``verify_every``.
        guard_collectives: with several processes, turn on
            ``torch.compiler.set_enable_guard_collectives`` in the training loop once
            the ranks first entered the stance together, so they agree on every
            guard failure. Cost: one ``all_gather_object`` per compiled call (measured
            on 2 CPU processes with gloo: about +2.6 ms per call, 15x a whole call
            under the stance); targets are rebuilt on all ranks together, and a
            stance miss (on any rank) is retried with the plain ``forward``.
        measure_lookup: ``None`` (default): on in single-process runs, off with
            several processes (a DDP child process once ended with "terminate
            called without an active exception" after a run that had profiled).
            When on: when training first enters the stance, profile
            ``lookup_window`` batches with full guards and then as many under the
            stance, and report Dynamo's guard and pre-graph µs per step for both
            (``summary()["lookup_us"]``, the logged ``guard/lookup_us``). Skipped
            when another profiler is running. Cost, once per run: about 1 ms to
            start and stop the profiler plus about 1.5 ms per profiled compiled
            call, and calls about 12% slower inside the windows (measured on the
            CPU; ``guardtrain.overhead``).
        lookup_window: batches per measuring window.

    Raises:
        GuardTrainValueError: an unknown preset or filter name, a negative step
            count, conflicting filters, unknown ``compile_kwargs`` keys.
        GuardTrainTypeError: an argument of the wrong type.

    Example::

        import lightning as L
        from guardtrain import GuardTuneCallback

        trainer = L.Trainer(max_epochs=3, callbacks=[GuardTuneCallback("aggressive")])
        trainer.fit(model, datamodule=dm)  # model: a plain, uncompiled LightningModule
    """

    def __init__(
        self,
        preset: PresetName = "balanced",
        *,
        warmup_steps: int | None = None,
        stable_steps: int | None = None,
        targets: str | list[str] | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        guard_filter: str | list[str] | _filters.GuardFilter | None = None,
        install_free_tensors: bool | None = None,
        recursive_dict_tags: bool | None = None,
        use_stance: bool | None = None,
        unsafe_drop_floor: bool = False,
        log_metrics: bool = True,
        audit_every: int | None = 200,
        verify_every: int | None = None,
        verify_rtol: float = 1e-4,
        verify_atol: float = 1e-6,
        guard_collectives: bool = False,
        measure_lookup: bool | None = None,
        lookup_window: int = 3,
    ) -> None:
        base = get_preset(preset)
        overrides: dict[str, Any] = {
            k: v
            for k, v in {
                "warmup_steps": warmup_steps,
                "stable_steps": stable_steps,
                "install_free_tensors": install_free_tensors,
                "recursive_dict_tags": recursive_dict_tags,
                "use_stance": use_stance,
            }.items()
            if v is not None
        }
        if isinstance(guard_filter, str):
            overrides["guard_filter"] = guard_filter
        self.preset = preset
        self.settings: GuardPreset = dataclasses.replace(base, **overrides)
        self._dict_tags_warned = False  # the #181873 warning, once per callback
        self._dict_tags_told = False  # the "dict tags are off" INFO line, once per callback
        for flag, value in (
            ("unsafe_drop_floor", unsafe_drop_floor),
            ("log_metrics", log_metrics),
            ("guard_collectives", guard_collectives),
        ):
            if not isinstance(value, bool):
                raise GuardTrainTypeError(f"`{flag}` must be a bool, got {value!r}.")
        self.unsafe_drop_floor = unsafe_drop_floor
        self.log_metrics = log_metrics
        self.guard_collectives = guard_collectives
        if measure_lookup is not None and not isinstance(measure_lookup, bool):
            raise GuardTrainTypeError(
                f"`measure_lookup` must be a bool or None, got {measure_lookup!r}."
            )
        self.measure_lookup = measure_lookup
        window = _every("lookup_window", lookup_window)
        if window is None:
            raise GuardTrainValueError("`lookup_window` must be >= 1, got None.")
        self.lookup_window = window
        self.audit_every = _every("audit_every", audit_every)
        self.verify_every = _every("verify_every", verify_every)
        for flag, tol in (("verify_rtol", verify_rtol), ("verify_atol", verify_atol)):
            if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
                raise GuardTrainValueError(f"`{flag}` must be a number >= 0, got {tol!r}.")
        self.verify_rtol = float(verify_rtol)
        self.verify_atol = float(verify_atol)

        self.compile_kwargs = check_compile_kwargs(compile_kwargs)
        in_options = (self.compile_kwargs.get("options") or {}).get("guard_filter_fn")
        if in_options is not None and guard_filter is not None:
            raise GuardTrainValueError(
                "A guard filter was passed twice: as `guard_filter` and as "
                "`compile_kwargs['options']['guard_filter_fn']`. Pass it once, as `guard_filter`."
            )
        spec: _filters.FilterSpec
        if in_options is not None:
            spec = in_options
        elif guard_filter is not None:
            spec = guard_filter
        else:
            spec = self.settings.guard_filter
        self._filter_spec = spec
        _filters.resolve(spec)  # unknown names fail here, in the constructor

        if isinstance(targets, str):
            targets = [targets]
        if targets is not None:
            if isinstance(targets, (bytes, dict)) or not isinstance(targets, Sequence):
                raise GuardTrainTypeError(
                    f"`targets` must be None, a name or a list of names, got {targets!r}."
                )
            targets = list(targets)
            bad = [t for t in targets if not isinstance(t, str)]
            if bad or not targets:
                raise GuardTrainValueError(
                    f"`targets` must hold submodule names or glob patterns, got {targets!r}."
                )
        self.targets = targets

        self.disabled = os.environ.get(DISABLE_ENV, "").strip() not in ("", "0")
        self._restored: dict[str, Any] = {}
        self._kept: list[CompiledTarget] = []
        """Targets of the last trainer call: the next call on the same modules reinstalls
        them, with their compiled code (H28)."""
        self._took_over_told: list[str] = []
        self._ran = False
        self._reset_run_state()

    # -- public ------------------------------------------------------------------------------

    @property
    def phase(self) -> str:
        """The training loop's phase: ``"warmup"``, ``"steady"``, or ``"off"`` (no stance)."""
        if self.disabled or not self.settings.use_stance or self._stance_blocked:
            return "off"
        return self._machine.phase("train")

    def summary(self) -> dict[str, Any]:
        """Counters and history of the run so far, as a plain dict."""
        r = self._restored
        m = self._machine
        lookup = self._lookup or r.get("lookup_us", {})
        return {
            "preset": self.preset,
            "phase": self.phase,
            "phases": {loop: m.phase(loop) for loop in m.loops},
            "compiles": self._monitor.compiles + r.get("compiles", 0),
            "rearms": list(r.get("rearms", []))
            + list(m.rearms if self._all_rearms is None else self._all_rearms),
            "warmup_steps_taken": m.warmup_steps_taken + r.get("warmup_steps_taken", 0),
            "steady_steps": m.steady_steps + r.get("steady_steps", 0),
            "targets": list(self._target_names),
            "compile_events": (list(r.get("compile_events", [])) + self._monitor.events)[:100],
            "levers": self._levers(),
            "switched_off": list(self._switched_off),
            "stance_blocked": self._stance_blocked,
            "uncompiled_targets": list(self._uncompiled),
            "lookup_us": dict(lookup),
            "lookup_calls": dict(self._lookup_calls or r.get("lookup_calls", {})),
            "took_over": list(self._took_over),
            "disabled": self.disabled,
        }

    def state_dict(self) -> dict[str, Any]:
        s = self.summary()
        return {
            "preset": self.preset,
            "compiles": s["compiles"],
            "rearms": s["rearms"],
            "warmup_steps_taken": s["warmup_steps_taken"],
            "steady_steps": s["steady_steps"],
            "train_batches": self._train_batches(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = {
            "compiles": int(state_dict.get("compiles", 0)),
            "rearms": list(state_dict.get("rearms", [])),
            "warmup_steps_taken": int(state_dict.get("warmup_steps_taken", 0)),
            "steady_steps": int(state_dict.get("steady_steps", 0)),
            "train_batches": int(state_dict.get("train_batches", 0)),
        }

    # -- run state ---------------------------------------------------------------------------

    def _reset_run_state(self) -> None:
        s = self.settings
        self._machine = PhaseMachine(s.warmup_steps, s.stable_steps, s.use_stance)
        self._monitor = CompileMonitor()
        self._targets: list[CompiledTarget] = []
        self._target_names: list[str] = []
        self._took_over: list[str] = []
        self._takeover: TakeOver | None = None
        self._skipped: list[str] = []
        """Targets rebuilt once because Dynamo skipped their code."""
        self._pending: set[str] = set()
        self._loop: str | None = None
        self._stance_on = False
        self._saved_stance: Any = None
        self._saved_config: dict[str, Any] = {}
        self._switched_off: list[dict[str, str]] = []
        self._stance_blocked: str | None = None
        self._uncompiled: list[str] = []
        self._compiles_at_batch = 0
        self._logged: tuple[int, int, int] | None = None
        self._trainer: Trainer | None = None
        self._rank: int | None = None
        self._all_rearms: list[dict[str, Any]] | None = None
        self._entered_together = False
        self._measure: str | None = None
        self._measure_left = 0
        self._window: Any = None
        self._lookup: dict[str, float] = {}
        self._lookup_calls: dict[str, dict[str, int]] = {}
        self._lookup_logged = False
        self._next_check = 0
        self._changes = 0
        """Counts compiles, re-arms and entries: the logger is called only when it moved."""
        self._logged_changes = -1
        self._audit_batch = False
        self._verify_batch = False
        self._guard_collectives_prev: bool | None = None
        self._active = False
        self._summary_logged = False
        self._ift = s.install_free_tensors
        self._dict_tags = s.recursive_dict_tags
        self._use_stance = s.use_stance

    def _levers(self) -> dict[str, Any]:
        spec = self._filter_spec
        name = (
            spec if isinstance(spec, str) or spec is None else getattr(spec, "__name__", "custom")
        )
        return {
            "recursive_dict_tags": self._dict_tags,
            "install_free_tensors": self._ift,
            "guard_filter": name,
            "soundness_floor": not self.unsafe_drop_floor,
            "use_stance": self._use_stance,
        }

    def _switch_off(self, lever: str, why: str) -> None:
        self._switched_off.append({"lever": lever, "why": why})
        rank_zero_warn(f"guardtrain: {lever} is switched off: {why}")

    def _train_batches(self) -> int:
        return self._machine.loops["train"].batches + self._restored.get("train_batches", 0)

    # -- setup and teardown ------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._ran:  # a later trainer call: the summary goes on from the earlier ones
            s = self.summary()
            self._restored = {
                key: s[key] for key in ("compiles", "rearms", "warmup_steps_taken", "steady_steps")
            }
            self._restored.update(
                train_batches=self._train_batches(),
                lookup_us=s["lookup_us"],
                lookup_calls=s["lookup_calls"],
                compile_events=s["compile_events"],
            )
            self._ran = False
        self._reset_run_state()
        if self.disabled:
            rank_zero_info(
                f"guardtrain: {DISABLE_ENV} is set; GuardTuneCallback does nothing "
                "(the model is not compiled)."
            )
            return
        if getattr(pl_module, "_compiler_ctx", None) is not None:
            raise GuardTrainValueError(
                "The model passed to the Trainer was compiled with torch.compile already. "
                "Pass the plain LightningModule: GuardTuneCallback compiles it."
            )
        self._machine.collective = trainer.world_size > 1
        self._rank = trainer.global_rank if self._machine.collective else None
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        if self._ift and isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
            # FSDP gathers and frees the full parameters around every forward, and
            # install_free_tensors bakes the parameter objects into the graph (H3).
            self._ift = False
            self._switch_off(
                "install_free_tensors",
                f"{type(trainer.strategy).__name__} swaps parameters around every forward, "
                "and install_free_tensors freezes parameter identity in the graph",
            )
        dynamo_cfg = torch._dynamo.config
        # Recursive dict tags (H22): None leaves torch's default alone; only an explicit
        # bool from the user sets the config.
        explicit_tags = self.settings.recursive_dict_tags
        default_tags = bool(getattr(dynamo_cfg, "use_recursive_dict_tags_for_guards", False))
        torch_release = torch.__version__.split("+")[0]
        if explicit_tags and not hasattr(dynamo_cfg, "use_recursive_dict_tags_for_guards"):
            self._dict_tags = False
            self._switch_off(
                "recursive_dict_tags", f"needs torch>=2.9 (installed {torch.__version__})"
            )
        else:
            self._dict_tags = default_tags if explicit_tags is None else explicit_tags
            if self._dict_tags and not default_tags and not self._dict_tags_warned:
                self._dict_tags_warned = True
                rank_zero_warn(
                    "guardtrain: recursive_dict_tags=True turns on Dynamo's "
                    f"use_recursive_dict_tags_for_guards, which torch {torch_release} leaves "
                    "off by default: PyTorch switched it off after segfaults in guard "
                    "evaluation (pytorch/pytorch#181873, #181925). Leave recursive_dict_tags "
                    "unset to keep torch's default."
                )
        if not self._dict_tags and not self._dict_tags_told:
            self._dict_tags_told = True
            if explicit_tags is None:
                why = (
                    f"torch {torch_release}'s default; PyTorch switched them off after "
                    "segfaults, pytorch/pytorch#181873"
                )
            elif explicit_tags:
                why = f"not in torch {torch_release}"
            else:
                why = "recursive_dict_tags=False"
            rank_zero_info(f"guardtrain: recursive dict tags are off ({why}).")
        if self._ift and not hasattr(dynamo_cfg, "install_free_tensors"):
            self._ift = False
            self._switch_off(
                "install_free_tensors", f"needs torch>=2.8 (installed {torch.__version__})"
            )
        if self._use_stance and "skip_guard_eval_unsafe" not in _parameters(
            torch.compiler.set_stance
        ):
            self._use_stance = False
            self._switch_off("use_stance", f"needs torch>=2.6 (installed {torch.__version__})")
        self._machine.use_stance = self._use_stance
        resolved = _filters.resolve(self._filter_spec)
        if resolved is None and self._filter_spec not in (None, "keep_all"):
            self._switched_off.append(
                {"lever": "guard_filter", "why": f"{self._filter_spec!r} is not in this torch"}
            )
        if resolved is not None and not self.unsafe_drop_floor:
            resolved = _filters.with_floor(resolved)
        self._resolved_filter = resolved

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._activate(trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """With several processes, collect every rank's re-arms for rank zero's summary."""
        if not self._machine.collective or self.disabled:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(self._machine.rearms))
        merged = [r for rank_rearms in gathered for r in (rank_rearms or [])]
        self._all_rearms = sorted(merged, key=lambda r: (r["step"], r.get("rank", 0)))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        idle = [
            t.name or "<LightningModule>"
            for t in self._targets
            if t.compiles == 0 or (t.calls and t.cache_entries() == 0)
        ]
        if idle:
            self._uncompiled = idle
            rank_zero_warn(
                f"guardtrain: target(s) {idle} ran uncompiled all run: their `forward` was "
                "never called through the module (check `targets`), or Dynamo skipped it."
            )
        self._restore()
        if not self._summary_logged and not self.disabled:
            self._summary_logged = True
            rank_zero_info(self.format_summary())

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    def _activate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active or self.disabled:
            return
        self._trainer = trainer
        stance = torch._dynamo.eval_frame._stance
        if stance.skip_guard_eval_unsafe:
            raise GuardTrainRuntimeError(
                "The unsafe stance (skip_guard_eval_unsafe=True) is already set when the run "
                "starts; GuardTuneCallback needs full guards while it warms up. Call "
                "torch.compiler.set_stance('default') before fit, or drop the callback."
            )
        self._saved_stance = stance
        cfg = torch._dynamo.config
        explicit_tags = self.settings.recursive_dict_tags
        if (
            explicit_tags is not None
            and self._dict_tags == explicit_tags  # not switched off in `setup`
            and getattr(cfg, "use_recursive_dict_tags_for_guards", explicit_tags) != explicit_tags
        ):
            self._saved_config["use_recursive_dict_tags_for_guards"] = (
                cfg.use_recursive_dict_tags_for_guards
            )
            cfg.use_recursive_dict_tags_for_guards = explicit_tags
        self._active = True
        self._ran = True
        try:
            resolved = resolve_targets(pl_module, self.targets)
            self._takeover = take_over_compiled(pl_module, resolved)
            self._tell_take_over(self._takeover.names)
            kept = {
                (t.name, id(t.module)): t
                for t in self._kept
                if t.requested_free_tensors == self._ift
            }
            for name, module in resolved:
                target = kept.get((name, id(module)))
                if target is not None:  # a later trainer call: same code, same Dynamo cache
                    target.install()
                else:
                    target = CompiledTarget(
                        name,
                        module,
                        self.compile_kwargs,
                        self._resolved_filter,
                        self._ift,
                        on_compile=self._on_compile,
                        on_miss=self._on_miss,
                        on_switch_off=self._on_switch_off,
                    )
                target.retry_eagerly = self._paired()
                self._targets.append(target)
                self._target_names.append(name or "<LightningModule>")
            self._kept = list(self._targets)
        except BaseException:
            self._restore()
            raise

    def _tell_take_over(self, names: list[str]) -> None:
        """One warning when the user's own compiles are taken over (once per change)."""
        self._took_over = list(names)
        if names and names != self._took_over_told:
            rank_zero_warn(
                f"guardtrain: took over the compile of {', '.join(names)}: GuardTuneCallback "
                "compiles the original module once itself (state_dict keys stay as they are); "
                "drop your own torch.compile call to silence this."
            )
        self._took_over_told = list(names)

    def _restore(self) -> None:
        if not self._active:
            return
        self._active = False
        self._stop_window()
        self._set_stance(False)
        self._set_guard_collectives(False)
        for target in self._targets:
            target.uninstall()
        self._targets = []
        if self._takeover is not None:
            self._takeover.restore()
            self._takeover = None
        cfg = torch._dynamo.config
        for key, value in self._saved_config.items():
            setattr(cfg, key, value)
        self._saved_config = {}

    # -- the stance and re-arms --------------------------------------------------------------

    def _set_stance(self, on: bool) -> None:
        if on == self._stance_on:
            return
        prev = self._saved_stance
        torch.compiler.set_stance(
            prev.stance,
            skip_guard_eval_unsafe=on or prev.skip_guard_eval_unsafe,
            force_backend=prev.backend,
        )
        for target in self._targets:
            target.fast = on
        self._stance_on = on

    def _set_guard_collectives(self, on: bool) -> None:
        """Dynamo's per-call guard collective (H7). Toggled only where every rank is.

        Each rank gathers once per compiled call while the hook is on, so the hook
        goes on and off at points all ranks pass together (the first collective
        entry, loop ends), never at a rank's own re-arm.
        """
        if on == (self._guard_collectives_prev is not None):
            return
        if on:
            self._guard_collectives_prev = torch.compiler.set_enable_guard_collectives(True)
        else:
            torch.compiler.set_enable_guard_collectives(bool(self._guard_collectives_prev))
            self._guard_collectives_prev = None

    def _paired(self) -> bool:
        """Ranks must act together: guard collectives pair every compiled call across ranks."""
        return self.guard_collectives and self._machine.collective

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` on any rank (one collective when calls are paired), else this rank's."""
        if self._paired() and self._trainer is not None:
            return bool(self._trainer.strategy.reduce_boolean_decision(flag, all=False))
        return flag

    def _rearm(self, loop: str | None, reason: str) -> None:
        self._changes += 1
        if self._measure is not None and loop in (None, "train"):
            self._stop_window()  # measured again at the next entry
        self._set_stance(False)
        self._machine.rearm(loop, step=self._train_batches(), reason=reason, rank=self._rank)

    def _rebuild(self, target: CompiledTarget, reason: str) -> None:
        """Forget every compiled entry of ``target`` and send every loop back to warm-up."""
        label = target.name or "<LightningModule>"
        target.reference = None
        target.rebuild()
        self._rearm(None, f"{label}: {reason}; recompiling")

    def _on_compile(self, target: CompiledTarget, reason: str | None) -> None:
        self._changes += 1
        self._monitor.record(self._train_batches(), target.name, reason)

    def _on_switch_off(self, target: CompiledTarget, why: str) -> None:
        self._switch_off(f"install_free_tensors for {target.name or '<LightningModule>'!r}", why)

    def _on_miss(self, target: CompiledTarget, reason: str) -> bool:
        label = target.name or "<LightningModule>"
        if self._paired():
            reason += " (here or on another rank: guard collectives share misses)"
        self._rearm(self._loop, f"stance miss in {label!r}: {reason}")
        return not target.graph_breaks  # never in the stance with graph breaks (_blocker)

    def _blocker(self) -> str | None:
        """Why the stance must not be entered now, or None."""
        limit = getattr(torch._dynamo.config, "recompile_limit", 8)
        if self._targets and all(t.cache_entries() == 0 for t in self._targets):
            return "no target has compiled code"
        for target in self._targets:
            label = target.name or "<LightningModule>"
            if target.calls and target.cache_entries() == 0:
                return f"target {label!r} ran uncompiled: Dynamo skipped its code"
            if target.graph_breaks:
                return (
                    f"target {label!r} has graph breaks; under the stance a miss in a resumed "
                    "frame would come after part of the forward ran"
                )
            if target.cache_entries() >= limit:
                return (
                    f"target {label!r} reached recompile_limit={limit}; Dynamo runs it eagerly and "
                    "the stance would raise"
                )
        return None

    # -- loops ---------------------------------------------------------------------------------

    def _loop_start(self, loop: str) -> None:
        if not self._active:
            return
        self._set_stance(False)
        self._loop = loop
        self._pending.add(loop)
        self._machine.pass_started(loop)
        if loop != "train" and self._window is not None:
            # A window counts every compiled call: this loop's must not count as
            # training's (H27). Close it on the training batches it has measured.
            self._close_window(self.lookup_window - self._measure_left)

    def _batch_start(self, loop: str, batch: Any, module: LightningModule) -> None:
        if not self._active:
            return
        m = self._machine
        self._loop = loop
        if loop in self._pending:
            self._pending.discard(loop)
            self._boundary_check(loop)
        if m.use_stance:
            steady = m.loops[loop].phase == "steady"
            signature = batch_signature(batch)
            if m.new_signature(loop, signature) and steady:
                self._rearm(loop, f"unseen batch signature {describe_signature(signature)}")
                steady = False
            elif steady and module.training is not (loop == "train"):
                self._rearm(loop, f"module.training is {module.training} in the {loop} loop")
                steady = False
            if loop == "train":
                if self._measure is not None and steady:
                    steady = self._measure_batch()
                elif m.loops["train"].batches >= self._next_check:
                    steady = self._audit_or_verify(steady)
                if self.guard_collectives:
                    self._set_guard_collectives(self._paired() and self._entered_together)
            elif steady and self._trainer_sanity():
                steady = False
            if steady is not self._stance_on:
                self._set_stance(steady)
        self._compiles_at_batch = self._monitor.compiles

    def _measure_batch(self) -> bool:
        """One batch of a lookup window; returns whether it runs under the stance."""
        if self._window is None:
            from guardtrain.overhead import LookupWindow

            self._window = LookupWindow()
            if not self._window.start():  # another profiler is running: do not disturb it
                self._window = None
                self._measure = None
                return True
        if self._measure == "full":
            self._audit_batch = True  # a compile with full guards here re-arms, as in an audit
            return False
        return True

    def _end_measure_batch(self) -> None:
        self._measure_left -= 1
        if self._measure_left > 0 or self._window is None:
            return
        self._close_window(self.lookup_window)

    def _close_window(self, steps: int) -> None:
        """Stop the window after ``steps`` training batches and record what it measured."""
        stats = self._window.stop(calls=max(steps, 1))
        self._window = None
        if stats is None or steps < 1:
            self._measure = None
            return
        per_step = (stats.guard_us_per_call or 0.0) + (stats.pregraph_us_per_call or 0.0)
        self._lookup_calls["full_guards" if self._measure == "full" else "steady"] = {
            "steps": steps,
            "lookups": stats.lookups,
        }
        if self._measure == "full":
            self._lookup["full_guards"] = per_step
            self._measure, self._measure_left = "steady", self.lookup_window
            return
        self._lookup["steady"] = per_step
        full = self._lookup.get("full_guards")
        if full:
            self._lookup["saving"] = 1.0 - per_step / full
        self._measure = None
        self._changes += 1  # log guard/lookup_us

    def _stop_window(self) -> None:
        if self._window is not None:
            self._window.stop()
            self._window = None
        if self._measure is not None:
            self._measure = None

    def _audit_or_verify(self, steady: bool) -> bool:
        """Start an audit or a verify batch when one is due; return whether to use the stance.

        Both are due by the training batch count, the same on every rank.
        """
        batches = self._machine.loops["train"].batches
        self._next_check = min(
            (batches // every + 1) * every
            for every in (self.audit_every, self.verify_every, 1 << 62)
            if every is not None
        )
        if batches == 0:
            return steady
        if self.audit_every is not None and batches % self.audit_every == 0:
            self._boundary_check("train")
            if steady and self._machine.steady("train"):
                self._audit_batch = True
            return False
        if self.verify_every is not None and batches % self.verify_every == 0:
            self._verify_batch = True
            if steady:
                for target in self._targets:
                    target.start_verify(self.verify_rtol, self.verify_atol)
        return steady

    def _end_audit_or_verify(self, compiled: bool) -> None:
        if self._audit_batch:
            self._audit_batch = False
            if compiled:
                event = self._monitor.events[-1] if self._monitor.events else {}
                self._rearm(
                    "train",
                    f"audit batch compiled with full guards ({event.get('reason', 'unknown')}): "
                    "the stance was running code whose guards no longer held",
                )
        if self._verify_batch:
            self._verify_batch = False
            found = [(t, t.stop_verify()) for t in self._targets]
            found = [(t, mismatch) for t, mismatch in found if mismatch is not None]
            for target, mismatch in found:
                label = target.name or "<LightningModule>"
                rank_zero_warn(
                    f"guardtrain: verify: compiled {label!r} differs from eager: {mismatch}. "
                    "Rebuilding it; please report this with the re-arm history."
                )
            if self._any_rank(bool(found)) and not found:
                found = [(t, "on another rank") for t in self._targets]
            for target, mismatch in found:
                self._rebuild(target, f"verify found a difference from eager ({mismatch})")

    def _batch_end(self, loop: str) -> None:
        if not self._active:
            return
        compiled = self._monitor.compiles != self._compiles_at_batch
        m = self._machine
        if self._audit_batch or self._verify_batch:
            self._end_audit_or_verify(compiled)
        if self._window is not None and loop == "train":
            self._end_measure_batch()
        m.batch_done(loop, compiled)
        if compiled:
            self._after_compile()
        if loop == "train":
            if (
                m.use_stance
                and (m.collective or m.loops["train"].phase != "steady")
                and m.is_decision_point(loop)
            ):
                self._decide(loop)
            if self._logged_changes != self._changes:
                self._log_changes()

    def _loop_end(self, loop: str, complete: bool) -> None:
        if not self._active:
            return
        self._set_stance(False)
        self._set_guard_collectives(False)
        m = self._machine
        m.pass_done(loop, complete)
        if loop != "train" and m.use_stance:
            self._decide(loop)
        self._pending.add("train")
        self._loop = None

    def _decide(self, loop: str) -> None:
        """Enter the stance for ``loop`` if this process (or, with several, every one) is ready.

        The only place entry is decided. With several processes it runs at the
        same batches on every rank and costs one collective.
        """
        m = self._machine
        ready = m.ready(loop)
        if not ready and not m.collective:
            return
        blocker = self._blocker() if ready else None
        vote = (ready and blocker is None) or m.steady(loop)
        if m.collective and self._trainer is not None:
            vote = bool(self._trainer.strategy.reduce_boolean_decision(vote, all=True))
        if m.collective and vote and loop == "train":
            self._entered_together = True
        if ready and blocker is None and vote:
            self._changes += 1
            m.enter(loop)
            measure = self.measure_lookup if self.measure_lookup is not None else not m.collective
            # Not with paired calls: the window's batches would shift this rank's audits.
            if loop == "train" and measure and not self._paired() and "steady" not in self._lookup:
                self._measure, self._measure_left = "full", self.lookup_window
        elif blocker is not None and self._stance_blocked is None:
            self._changes += 1
            self._stance_blocked = blocker
            rank_zero_warn(f"guardtrain: the stance stays off: {blocker}.")

    def _trainer_sanity(self) -> bool:
        return bool(self._trainer is not None and self._trainer.sanity_checking)

    # -- state checks --------------------------------------------------------------------------

    def _after_compile(self) -> None:
        """Once per batch that compiled: fingerprints, and no free tensors across graph breaks."""
        for target in self._targets:
            if target.graph_breaks and (target.install_free_tensors or target.drops_guards):
                # The frames after a graph break run the module's own `forward`,
                # whose code other instances share (install_free_tensors there is
                # H12), and their guards name the frame's locals, which the
                # boundary re-check cannot evaluate: keep every guard there.
                label = target.name or "<LightningModule>"
                target.install_free_tensors = False
                target.drops_guards = False
                self._switch_off(
                    f"install_free_tensors and the guard filter for {label!r}",
                    "it has graph breaks: the frames after a break run code shared by every "
                    "instance of its class, and their dropped guards cannot be re-checked",
                )
                self._rebuild(target, "graph breaks: full guards, no install_free_tensors")
            elif target.reference is None:
                target.reference = module_fingerprint(target.module)

    def _boundary_check(self, loop: str) -> None:
        rebuild: list[tuple[CompiledTarget, str]] = []
        for target in self._targets:
            label = target.name or "<LightningModule>"
            if target.calls and target.cache_entries() == 0 and label not in self._skipped:
                # Dynamo marked the code skipped, e.g. after a call under a dispatch
                # mode that guardtrain did not see (H18): a fresh code object compiles.
                self._skipped.append(label)
                rebuild.append((target, "Dynamo skipped its code, it ran uncompiled"))
                continue
            reference = target.reference
            change = None
            if reference is not None:
                change = fingerprint_change(reference, module_fingerprint(target.module))
            stale, unmatched = target.check_assertions()
            if change is None and stale is not None:
                change = f"{stale} (a guard that was dropped or skipped)"
            if change is not None:
                rebuild.append((target, change))
            elif unmatched is not None and self._machine.steady(loop):
                self._rearm(loop, f"{label}: {unmatched}")
        # A rebuilt target has no entries, so its first call issues no guard
        # collective: with paired calls every rank rebuilds together.
        if self._any_rank(bool(rebuild)) and not rebuild:
            rebuild = [(t, "another rank rebuilt its targets") for t in self._targets]
        for target, change in rebuild:
            self._rebuild(target, change)

    # -- logging -------------------------------------------------------------------------------

    def _log_changes(self) -> None:
        self._logged_changes = self._changes
        trainer = self._trainer
        if not self.log_metrics or trainer is None or not trainer.loggers:
            return
        current = (
            PHASE_NUMBERS[self.phase],
            self._monitor.compiles,
            len(self._machine.rearms),
        )
        if current == self._logged and ("steady" not in self._lookup or self._lookup_logged):
            return
        self._logged = current
        if not trainer.is_global_zero:
            return
        metrics = {
            "guard/phase": float(current[0]),
            "guard/compiles": float(current[1]),
            "guard/rearms": float(current[2]),
        }
        if "steady" in self._lookup and not self._lookup_logged:
            self._lookup_logged = True
            metrics["guard/lookup_us"] = self._lookup["steady"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def format_summary(self) -> str:
        """The end-of-run table logged at INFO on rank zero."""
        s = self.summary()
        lines = [
            "guardtrain summary",
            f"  preset           {s['preset']}",
            f"  targets          {', '.join(s['targets']) or '-'}",
            f"  phase            {s['phase']}  (loops: "
            + ", ".join(f"{k}={v}" for k, v in s["phases"].items())
            + ")",
            f"  warm-up steps    {s['warmup_steps_taken']}",
            f"  steady steps     {s['steady_steps']}",
            f"  compiles         {s['compiles']}",
            f"  re-arms          {len(s['rearms'])}",
        ]
        for r in s["rearms"][:10]:
            lines.append(f"    step {r['step']}: {r['reason']}")
        if len(s["rearms"]) > 10:
            lines.append(f"    ... {len(s['rearms']) - 10} more")
        lookup = s["lookup_us"]
        if "steady" in lookup:
            lines.append(
                f"  guards µs/step   {lookup.get('full_guards', float('nan')):.1f} with full guards, "
                f"{lookup['steady']:.1f} under the stance (guard + pre-graph, profiled)"
            )
        for off in s["switched_off"]:
            lines.append(f"  switched off     {off['lever']}: {off['why']}")
        if s["stance_blocked"]:
            lines.append(f"  stance blocked   {s['stance_blocked']}")
        return "\n".join(lines)

    # -- Lightning hooks -------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop_start("train")

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start("train", batch, pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_end("train")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop_end("train", complete=True)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._activate(trainer, pl_module)
        self._loop_start("validate")

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_start("validate", batch, pl_module)

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end("validate")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop_end("validate", complete=not trainer.sanity_checking)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._activate(trainer, pl_module)
        self._loop_start("test")

    def on_test_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_start("test", batch, pl_module)

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end("test")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop_end("test", complete=True)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._activate(trainer, pl_module)
        self._loop_start("predict")

    def on_predict_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_start("predict", batch, pl_module)

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_end("predict")

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loop_end("predict", complete=True)
