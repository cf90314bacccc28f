"""GuardTuner: guardtrain for plain PyTorch loops and Lightning Fabric, on the same engine.

Example::

    from guardtrain import GuardTuner

    with GuardTuner(model, preset="aggressive", compile_kwargs={"backend": "inductor"}) as tuner:
        for batch in loader:                      # steps outside any loop are training
            with tuner.step(batch):
                loss = loss_fn(model(batch[0]), batch[1])
                loss.backward()
                opt.step()
                opt.zero_grad()
        model.eval()
        with tuner.loop("validate"), torch.no_grad():
            for batch in val_loader:
                with tuner.step(batch):
                    model(batch[0])
        model.train()
    print(tuner.phase, tuner.summary())           # everything is restored here
"""

from __future__ import annotations

import inspect
import logging
import warnings
from types import TracebackType
from typing import Any, Unpack

from torch import nn

from guardtrain.arguments import AdapterSignature, document_arguments
from guardtrain.engine.agreement import RankAgreement, ReduceAgreement, TorchDistributed
from guardtrain.engine.config import GuardArguments, GuardConfig
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import LOOPS, Loop
from guardtrain.errors import GuardTrainRuntimeError, GuardTrainValueError
from guardtrain.presets import PresetName
from guardtrain.view import EngineView

__all__ = ["GuardTuner"]

_TRAIN = Loop.TRAIN.value

log = logging.getLogger("guardtrain")
_P = inspect.Parameter
_SIGNATURE = AdapterSignature(
    GuardConfig,
    before=[_P("model", _P.POSITIONAL_OR_KEYWORD, annotation=nn.Module)],
    keyword=[
        _P("fabric", _P.KEYWORD_ONLY, default=None, annotation=Any),
        _P("optimizers", _P.KEYWORD_ONLY, default=None, annotation=Any),
    ],
)


class _Step:
    """``tuner.step(batch)``: a reusable, class-based context manager (cheaper per step
    than ``@contextmanager``)."""

    __slots__ = ("_batch", "_tuner")

    def __init__(self, tuner: GuardTuner) -> None:
        self._tuner = tuner
        self._batch: Any = None

    def __enter__(self) -> None:
        tuner = self._tuner
        if tuner._in_step or not tuner._entered:
            self._refuse(tuner)
        tuner._in_step = True
        loop = tuner._loop
        training = tuner._root.training
        engine = tuner._engine
        warmed = tuner._warmed
        if not engine.steady(loop):
            warmed[loop] = training
        if loop == _TRAIN:
            engine.step_start()  # the bottom line: the steady step's wall time
        engine.batch_start(loop, self._batch, training, warmed.get(loop))

    @staticmethod
    def _refuse(tuner: GuardTuner) -> None:
        if tuner._in_step:
            raise GuardTrainRuntimeError("`tuner.step()` is already open: steps do not nest.")
        raise GuardTrainRuntimeError(
            "`tuner.step()` is used outside `with GuardTuner(...) as tuner:`."
        )

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        tuner = self._tuner
        tuner._in_step = False
        self._batch = None
        if exc_type is None:
            tuner._engine.batch_end(tuner._loop)
            if tuner._loop == _TRAIN:
                tuner._engine.step_end()


class _LoopPass:
    """``tuner.loop(name)``: one pass of an evaluation loop (or an epoch of training)."""

    __slots__ = ("_name", "_tuner")

    def __init__(self, tuner: GuardTuner, name: str) -> None:
        self._tuner = tuner
        self._name = name

    def __enter__(self) -> None:
        tuner = self._tuner
        if not tuner._entered:
            raise GuardTrainRuntimeError(
                "`tuner.loop()` is used outside `with GuardTuner(...) as tuner:`."
            )
        if tuner._in_loop or tuner._in_step:
            raise GuardTrainRuntimeError(
                f"`tuner.loop({self._name!r})` inside another loop or step: loops do not nest."
            )
        tuner._in_loop = True
        tuner._engine.loop_end(tuner._loop)  # the implicit training pass ends here
        tuner._loop = self._name
        tuner._engine.loop_start(self._name)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        tuner = self._tuner
        tuner._in_loop = False
        tuner._engine.loop_end(self._name, complete=exc_type is None)
        tuner._loop = Loop.TRAIN.value  # steps outside any loop are training again
        tuner._engine.loop_start(Loop.TRAIN.value)


class GuardTuner(EngineView):
    r"""Compile ``model``, warm up, lock guards, and fall back to full guards on any change.

    The same engine as :class:`~guardtrain.GuardTuneCallback`, for loops you write
    yourself. Entering the ``with`` block compiles the targets in place; leaving it
    restores everything (the model's ``forward``, Dynamo's config, the patched
    classes), also after an exception.

    Wrap each step in ``with tuner.step(batch):``: on entry it checks the batch and
    decides whether the step is steady, on exit it counts compiles. Only the targets' own
    compiled calls skip guards in a steady step; your loss, the optimizer step (also one
    you compiled yourself) and any compiled code between steps keep full guards.
    GuardTuner never calls ``train()``/``eval()`` and never changes grad mode. Steps
    outside any ``with tuner.loop(name):`` belong to training; ``tuner.loop("train")``
    marks an epoch. With several processes every rank must run the same number of steps
    per loop.

    The rules in full: docs/how-it-works.md ("GuardTuner: the rules").

    Args:
        model: the module to compile, or a Fabric-wrapped module (``fabric.setup``);
            targets are then names in ``model.module``.
        fabric: a ``lightning.fabric.Fabric``: votes go through its strategy and
            metrics to ``fabric.log_dict``. Without it, votes go through the default
            ``torch.distributed`` group when one is initialised, and metrics to the
            ``guardtrain`` logger.
        optimizers: the optimizer, or a sequence of optimizers (Fabric-wrapped ones
            too), whose steps ``compile_optimizer=True`` compiles; required with it,
            unused without it.
        {arguments}

    Raises:
        GuardTrainValueError: ``model`` is not an ``nn.Module``;
            ``compile_optimizer=True`` without ``optimizers``; an argument out of
            range, as :class:`~guardtrain.GuardTuneCallback` refuses it. On entering the
            ``with``: a target compiled already, a ``targets`` entry that matches no
            submodule, an optimizer that cannot be compiled (``LBFGS``,
            ``differentiable=True``) or is given twice. ``tuner.loop(name)``: an
            unknown loop name.
        GuardTrainTypeError: an argument of the wrong type.
        GuardTrainRuntimeError: nested ``with`` blocks, steps or loops, or
            ``tuner.step``/``tuner.loop`` outside the ``with``; on entering the
            ``with``, torch's unsafe stance already set or a target compiled by another
            guardtrain run that is still going.
        TypeError: an unknown keyword argument.

    Example::

        import torch
        from guardtrain import GuardTuner

        opt = torch.optim.AdamW(model.parameters())  # model: a plain, uncompiled nn.Module
        with GuardTuner(model, preset="aggressive") as tuner:
            for x, y in loader:
                with tuner.step((x, y)):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
    """

    @_SIGNATURE
    def __init__(
        self,
        model: nn.Module,
        preset: PresetName = "auto",
        *,
        fabric: Any = None,
        optimizers: Any = None,
        **arguments: Unpack[GuardArguments],
    ) -> None:
        fields = _SIGNATURE.bind(
            self, model, preset, fabric=fabric, optimizers=optimizers, **arguments
        )
        if not isinstance(model, nn.Module):
            raise GuardTrainValueError(
                f"`model` must be an nn.Module, got {model!r} ({type(model).__name__})."
            )
        self.config: GuardConfig = GuardConfig(**fields)
        self.optimizers = _optimizers(optimizers, self.config.compile_optimizer)
        self.model = model
        self.fabric = fabric
        self._root: nn.Module = _unwrap(model)
        self._engine = GuardEngine(self.config, Host(owner="GuardTuner"))
        self._step = _Step(self)
        self._loop = Loop.TRAIN.value
        self._warmed: dict[str, bool] = {}
        self._entered = False
        self._in_step = False
        self._in_loop = False

    # -- public ------------------------------------------------------------------------------

    def step(self, batch: Any) -> _Step:
        """The context manager around one step of the current loop (see the class docstring)."""
        self._step._batch = batch
        return self._step

    def loop(self, name: str) -> _LoopPass:
        """The context manager around one pass of ``name``: ``"train"``, ``"validate"``,
        ``"test"`` or ``"predict"``.

        Raises:
            GuardTrainValueError: an unknown loop name.
        """
        if name not in LOOPS:
            raise GuardTrainValueError(f"`loop` must be one of {list(LOOPS)}, got {name!r}.")
        return _LoopPass(self, str(name))

    # -- the with block ----------------------------------------------------------------------

    def __enter__(self) -> GuardTuner:
        if self._entered:
            raise GuardTrainRuntimeError(
                "This GuardTuner is already in use: `with` blocks do not nest."
            )
        agreement = self._agreement()
        host = Host(
            info=self._info,
            warn=self._warn,
            log_metrics=self._log_metrics if self.config.log_metrics else None,
            agreement=agreement,
            owner="GuardTuner",
            live=lambda: self._entered,
        )
        self._engine.host = host
        self._engine.setup(
            world_size=agreement.world_size,
            rank=agreement.rank,
            swaps_parameters=self._swapping_strategy(),
            sharded_by_hand=self._sharded_by_hand(),
        )
        self._engine.activate(self._root, host, root_by_default=True)
        self._entered = True
        self._loop = Loop.TRAIN.value
        try:
            self._engine.compile_optimizers(self.optimizers)
            self._engine.loop_start(self._loop)
        except BaseException:
            self._entered = False
            self._engine.restore()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        engine = self._engine
        self._entered = self._in_step = self._in_loop = False
        try:
            if exc_type is None:
                engine.loop_end(self._loop)
                engine.gather_rearms()
        finally:
            engine.finish()

    # -- helpers -----------------------------------------------------------------------------

    def _agreement(self) -> RankAgreement:
        fabric = self.fabric
        if fabric is None:
            return TorchDistributed.if_initialized()
        strategy = fabric.strategy
        return ReduceAgreement(
            strategy.reduce_boolean_decision, fabric.world_size, fabric.global_rank
        )

    def _swapping_strategy(self) -> str | None:
        if self.fabric is None:
            return None
        from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy

        strategy = self.fabric.strategy
        if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            return type(strategy).__name__
        return None

    def _sharded_by_hand(self) -> str | None:
        """FSDP2's ``fully_shard`` applied to the model without a Fabric strategy (H37)."""
        from guardtrain.engine.targets import fully_sharded

        found = fully_sharded(self._root)
        return None if found is None else f"FSDP2's fully_shard on {found}"

    def _rank_zero(self) -> bool:
        return self._engine.host.agreement.rank == 0

    def _info(self, message: str) -> None:
        if self._rank_zero():
            log.info(message)

    def _warn(self, message: str) -> None:
        if self._rank_zero():
            warnings.warn(message, UserWarning, stacklevel=4)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.fabric is not None:
            self.fabric.log_dict(metrics, step=step)
        else:
            log.debug("guard metrics at step %d: %s", step, metrics)


GuardTuner.__doc__ = document_arguments(GuardTuner.__doc__, GuardConfig)


def _optimizers(optimizers: Any, compile_optimizer: bool) -> list[Any]:
    """``optimizers`` as a list (one optimizer, or a sequence of them; Fabric's wrapped
    ones unwrapped); required with ``compile_optimizer=True``."""
    if optimizers is None:
        if compile_optimizer:
            raise GuardTrainValueError(
                "`compile_optimizer=True` needs `optimizers=`: GuardTuner compiles the "
                "steps of the optimizers passed to it (e.g. `optimizers=[opt]`)."
            )
        return []
    found = [optimizers] if hasattr(optimizers, "param_groups") else list(optimizers)
    return [getattr(opt, "optimizer", opt) for opt in found]


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a Fabric wrapper (``_FabricModule.module``), else ``model``."""
    inner = getattr(model, "module", None) if type(model).__name__ == "_FabricModule" else None
    return inner if isinstance(inner, nn.Module) else model
