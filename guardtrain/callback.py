"""GuardTuneCallback: the Lightning adapter. Hooks only; the engine decides."""

from __future__ import annotations

from typing import Any, Unpack

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from guardtrain._torch import LIGHTNING_COMPILED
from guardtrain.arguments import AdapterSignature, argument_parameters, document_arguments
from guardtrain.engine.agreement import ReduceAgreement
from guardtrain.engine.config import DISABLE_ENV, GuardArguments, GuardConfig
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import Loop
from guardtrain.errors import GuardTrainValueError
from guardtrain.presets import GuardPreset, PresetName
from guardtrain.view import EngineView

__all__ = ["DISABLE_ENV", "GuardTuneCallback"]

_TRAIN, _VALIDATE, _TEST, _PREDICT = (loop.value for loop in Loop)
_SIGNATURE = AdapterSignature(GuardConfig)


class GuardTuneCallback(EngineView, Callback):
    r"""Compile the model, warm up, lock guards, and fall back to full guards on any change.

    When the run starts (after the strategy placed the model) the callback compiles its
    targets in place. Each loop runs with full guards while it warms up; once it stops
    compiling it is *steady* (presets ``auto``, the default, ``balanced``, ``aggressive``
    and ``turbo``): the targets' own compiled calls skip Dynamo's guard evaluation, while
    the loss, the optimizer step and every other compiled function keep full guards.
    guardtrain's own checks (the batch signature and the ``training`` flag every batch;
    parameters, buffers, hooks and module attributes at loop boundaries and every
    ``audit_every`` batches; each call's mode) send the loop back to full guards (a
    *re-arm*, with its reason recorded) whenever the inputs or the model differ from what
    was warmed. At the end of the run everything it changed is restored. ``summary()``
    says what each loop did.

    How it works, and what is checked when: docs/how-it-works.md ("The checks").

    Args:
        {arguments}

    Raises:
        GuardTrainValueError: an argument out of range, e.g. an unknown preset or filter
            name, ``stable_steps=0``, a filter passed twice, unknown ``compile_kwargs``
            keys, ``direct_dispatch=True`` with ``use_stance=False``. When the run
            starts: a model or target compiled already, a ``targets`` entry that
            matches no submodule, an optimizer that ``compile_optimizer=True`` cannot
            compile (``LBFGS``, ``differentiable=True``).
        GuardTrainTypeError: an argument of the wrong type.
        GuardTrainRuntimeError: when the run starts, torch's unsafe stance is already
            set, or a target is compiled by another guardtrain run that is still going.
        TypeError: an unknown keyword argument.

    Example::

        import lightning as L
        from guardtrain import GuardTuneCallback

        trainer = L.Trainer(max_epochs=3, callbacks=[GuardTuneCallback("aggressive")])
        trainer.fit(model, datamodule=dm)  # model: a plain, uncompiled LightningModule
    """

    @_SIGNATURE
    def __init__(self, preset: PresetName = "auto", **arguments: Unpack[GuardArguments]) -> None:
        fields = _SIGNATURE.bind(self, preset, **arguments)
        self.config: GuardConfig = GuardConfig(**fields)
        self._engine = GuardEngine(self.config, self._host(None))

    # -- public ------------------------------------------------------------------------------

    @property
    def preset(self) -> str:
        return self.config.preset

    @property
    def compile_kwargs(self) -> dict[str, Any]:
        return self.config.compile_kwargs

    @property
    def targets(self) -> list[str] | None:
        return self.config.targets

    def __getattr__(self, name: str) -> Any:
        """The other constructor arguments, as validated (``audit_every``, ...)."""
        config = self.__dict__.get("config")
        if config is not None and name in _OTHER_ARGUMENTS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._engine.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._engine.load_state_dict(state_dict)

    # -- setup and teardown ------------------------------------------------------------------

    def _host(self, trainer: Trainer | None) -> Host:
        host = Host(
            info=rank_zero_info,
            warn=rank_zero_warn,
            owner="GuardTuneCallback",
            root_label="<LightningModule>",
            root_as="the LightningModule",
            part_as="the LightningModule's `{}`",
        )
        if trainer is None:
            return host
        host.live = lambda: trainer.state.status == TrainerStatus.RUNNING
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
        if getattr(pl_module, LIGHTNING_COMPILED, None) is not None and not self.disabled:
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
        self._engine.compile_optimizers(trainer.optimizers)  # compile_optimizer=True (H49)

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
        self._engine.step_start()  # the bottom line: the steady step's wall time
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
        self._engine.step_end()

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


GuardTuneCallback.__doc__ = document_arguments(GuardTuneCallback.__doc__, GuardConfig)
#: The constructor arguments read through ``__getattr__``: neither a preset lever nor a property.
_OTHER_ARGUMENTS = frozenset(
    p.name
    for p in argument_parameters(GuardConfig)
    if p.name not in GuardPreset.__dataclass_fields__ and not hasattr(GuardTuneCallback, p.name)
)
