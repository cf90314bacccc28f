"""GuardTuneCallback: the Lightning adapter. Hooks only; the engine decides."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from guardtrain import filters as _filters
from guardtrain.engine.agreement import ReduceAgreement
from guardtrain.engine.config import DISABLE_ENV, GuardConfig, make_config
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import Loop
from guardtrain.errors import GuardTrainValueError
from guardtrain.presets import GuardPreset, PresetName

__all__ = ["DISABLE_ENV", "GuardTuneCallback"]

_TRAIN, _VALIDATE, _TEST, _PREDICT = (loop.value for loop in Loop)
_ARGUMENTS = frozenset(
    {
        "unsafe_drop_floor",
        "log_metrics",
        "audit_every",
        "verify_every",
        "verify_rtol",
        "verify_atol",
        "guard_collectives",
        "measure_lookup",
        "lookup_window",
        "compile_cache",
    }
)


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

    * **every batch**: the batch
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
      mode, inference mode, autocast)`` must be a combination compiled with full
      guards (the stance does not check ``training``, H1), else the stance is left
      first; a cache miss (H4) leaves the stance and retries the call once with
      full guards. Dynamo raises before the frame runs, and targets with graph
      breaks keep every guard and never use the stance, so no part of a step runs
      twice. With ``targets=None`` a target that breaks the graph is replaced by
      its parts (H20).

    Args:
        preset: ``"off"``, ``"safe"``, ``"balanced"``, ``"aggressive"`` or ``"turbo"`` (see
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
        direct_dispatch: in the steady state, run each compiled call's cache entry
            directly, below Dynamo's entry path (preset ``turbo``). Each call is
            checked first: its ``(training, grad, inference mode, autocast)``
            mode, Dynamo's global-state guard, the input tensors' dtype, device,
            ``requires_grad``, sizes, strides and dispatch keys, which arguments
            are one tensor, the values of non-tensor arguments, no active compile
            callback, torch-function mode or saved-tensor hooks, that the entry is
            still in Dynamo's cache, and, where a mode has several entries, the
            guards that tell them apart (what the stance evaluates); a call that
            fails one takes the normal path. Cost: about 1.5-2.5 µs per compiled
            call (2 µs more with several entries for a mode), against Dynamo's
            entry path of tens of µs per frame (docs/bench.md). The entry for a mode is
            the one that Dynamo's own guards accept for the first steady call of
            that mode, chosen again after every boundary, audit and re-arm.
            Refused (the summary says why) for a target with graph breaks, under
            FSDP (``FSDPStrategy``, ``ModelParallelStrategy``, ``fully_shard``),
            and with ``guard_collectives=True``. Needs ``use_stance``.
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
        compile_cache: a file for PyTorch's compile-cache artifacts (warm start);
            ``None`` (default): off. At setup every rank loads it
            (``torch.compiler.load_cache_artifacts``) before anything compiles; at
            the end of the run rank zero saves this process's artifacts there
            (``torch.compiler.save_cache_artifacts``, written atomically; the folder
            is created). A second run on a fresh machine then skips Inductor's and
            AOTAutograd's work (not the C++ compiler's on the CPU). Only the inductor
            backend records artifacts. A missing file logs one INFO line; a corrupt
            file or one saved by another torch or Python warns and compiles cold.
            ``summary()["compile_cache"]`` says what was loaded, hit and saved.

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
        direct_dispatch: bool | None = None,
        unsafe_drop_floor: bool = False,
        log_metrics: bool = True,
        audit_every: int | None = 200,
        verify_every: int | None = None,
        verify_rtol: float = 1e-4,
        verify_atol: float = 1e-6,
        guard_collectives: bool = False,
        measure_lookup: bool | None = None,
        lookup_window: int = 3,
        compile_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k != "self"}  # as passed
        self.config: GuardConfig = make_config(**arguments)
        self._engine = GuardEngine(self.config, self._host(None))

    # -- public ------------------------------------------------------------------------------

    @property
    def preset(self) -> str:
        return self.config.preset

    @property
    def settings(self) -> GuardPreset:
        """The preset's levers with the explicit arguments applied."""
        return self.config.levers

    @property
    def compile_kwargs(self) -> dict[str, Any]:
        return self.config.compile_kwargs

    @property
    def targets(self) -> list[str] | None:
        return self.config.targets

    def __getattr__(self, name: str) -> Any:
        """The other constructor arguments, as validated (``audit_every``, ...)."""
        config = self.__dict__.get("config")
        if config is not None and name in _ARGUMENTS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def disabled(self) -> bool:
        """``GUARDTRAIN_DISABLE`` was set when the callback was made: it does nothing."""
        return self.config.disabled

    @property
    def engine(self) -> GuardEngine:
        """The engine (read it; the hooks drive it)."""
        return self._engine

    @property
    def phase(self) -> str:
        """The training loop's phase: ``"warmup"``, ``"steady"``, or ``"off"`` (no stance)."""
        return self._engine.phase

    def summary(self) -> dict[str, Any]:
        """Counters and history of the runs so far, as a plain dict."""
        return self._engine.summary()

    def format_summary(self) -> str:
        """The end-of-run table logged at INFO on rank zero."""
        return self._engine.format_summary()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._engine.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._engine.load_state_dict(state_dict)

    # -- setup and teardown ------------------------------------------------------------------

    def _host(self, trainer: Trainer | None) -> Host:
        host = Host(info=rank_zero_info, warn=rank_zero_warn, owner="GuardTuneCallback")
        if trainer is None:
            return host
        host.agreement = ReduceAgreement(
            trainer.strategy.reduce_boolean_decision, trainer.world_size, trainer.global_rank
        )
        host.sanity_checking = lambda: bool(trainer.sanity_checking)
        if self.config.log_metrics and trainer.loggers:

            def log_metrics(metrics: dict[str, float], step: int) -> None:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)

            host.log_metrics = log_metrics
        return host

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if getattr(pl_module, "_compiler_ctx", None) is not None and not self.disabled:
            raise GuardTrainValueError(
                "The model passed to the Trainer was compiled with torch.compile already. "
                "Pass the plain LightningModule: GuardTuneCallback compiles it."
            )
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        strategy = trainer.strategy
        swaps = isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))
        self._engine.host = self._host(trainer)
        self._engine.setup(
            world_size=trainer.world_size,
            rank=trainer.global_rank,
            swaps_parameters=type(strategy).__name__ if swaps else None,
        )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.activate(pl_module)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.gather_rearms()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._engine.finish()

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._engine.restore()

    # -- loops: each hook tells the engine where the run is ----------------------------------

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.loop_start(_TRAIN)

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int = 0
    ) -> None:
        self._engine.batch_start(_TRAIN, batch, pl_module.training)

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any = None,
        batch: Any = None,
        batch_idx: int = 0,
    ) -> None:
        self._engine.batch_end(_TRAIN)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.loop_end(_TRAIN)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.activate(pl_module)
        self._engine.loop_start(_VALIDATE)

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, *args: Any
    ) -> None:
        self._engine.batch_start(_VALIDATE, batch, pl_module.training)

    @override
    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any
    ) -> None:
        self._engine.batch_end(_VALIDATE)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.loop_end(_VALIDATE, complete=not trainer.sanity_checking)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.activate(pl_module)
        self._engine.loop_start(_TEST)

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, *args: Any
    ) -> None:
        self._engine.batch_start(_TEST, batch, pl_module.training)

    @override
    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._engine.batch_end(_TEST)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.loop_end(_TEST)

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.activate(pl_module)
        self._engine.loop_start(_PREDICT)

    @override
    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, *args: Any
    ) -> None:
        self._engine.batch_start(_PREDICT, batch, pl_module.training)

    @override
    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any
    ) -> None:
        self._engine.batch_end(_PREDICT)

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine.loop_end(_PREDICT)
