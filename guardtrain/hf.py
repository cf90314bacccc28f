"""GuardTrainerCallback: the Hugging Face ``Trainer`` adapter, on the same engine (H38).

Example::

    from transformers import Trainer
    from guardtrain import GuardTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GuardTrainerCallback("aggressive")])
    trainer.train()

No callback event of the ``Trainer`` gets the batch, ``on_step_begin`` fires once per
optimizer step, and there is no evaluation-start or exception event. The callback
therefore brackets every call of the root model with a forward pre-hook and a forward
hook (``always_call=True``): the pre-hook tells the engine a batch starts (and sets the
stance when the loop is steady), the hook lifts the stance again, also when the forward
raises. The stance is never set outside a forward call.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import warnings
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from guardtrain import filters as _filters
from guardtrain.compile import check_compile_kwargs
from guardtrain.engine.agreement import ReduceAgreement, SingleProcess
from guardtrain.engine.config import GuardConfig, make_config
from guardtrain.engine.core import GuardEngine, Host
from guardtrain.engine.phases import Loop
from guardtrain.presets import GuardPreset, PresetName

__all__ = ["GuardTrainerCallback", "default_targets", "regional_targets"]

log = logging.getLogger("guardtrain")

_TRAIN, _VALIDATE = Loop.TRAIN.value, Loop.VALIDATE.value
_OWNER = "GuardTrainerCallback"
_EVAL_FUNCTIONS = frozenset(
    {"evaluation_loop", "prediction_loop", "prediction_step", "evaluate", "predict"}
)
"""Trainer methods whose frames mark a model call as the Trainer's evaluation."""
_FRAMES = 40


def _inert(*args: Any) -> None:
    """What a copied or pickled model's hooks become: they do nothing."""
    return None


class _Hook:
    """A hook that a ``copy.deepcopy`` or pickle of the model turns into :func:`_inert`
    (the copy must not drive this callback's engine, nor drag it along)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _inert

    def __reduce__(self) -> Any:
        return (_inert_factory, ())


def _inert_factory() -> Any:
    return _inert


def _accelerate_state() -> Any:
    """Accelerate's process-wide ``AcceleratorState`` once an ``Accelerator`` exists, else None."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover - transformers needs accelerate for the Trainer
        return None
    if not AcceleratorState._shared_state:
        return None
    return AcceleratorState()


def _quiet(message: str) -> None:
    return None


class _AccelerateAgreement(ReduceAgreement):
    """Rank agreement through accelerate's ``reduce`` and ``gather_object``."""

    def __init__(self, world_size: int, rank: int) -> None:
        super().__init__(self._reduce_flag, world_size, rank, gather=self._gather_value)

    def _reduce_flag(self, flag: bool, all: bool = True) -> bool:
        from accelerate.state import PartialState
        from accelerate.utils import reduce

        value = torch.tensor(float(bool(flag)), device=PartialState().device)
        total = float(reduce(value, reduction="sum").item())
        return total >= self.world_size if all else total > 0

    @staticmethod
    def _gather_value(value: Any) -> list[Any]:
        from accelerate.utils import gather_object

        return list(gather_object([value]))


def default_targets(root: nn.Module) -> list[str] | None:
    """The default targets of a Hugging Face model: its base model (``base_model_prefix``)
    and the other children with parameters (the head), found in the outermost
    ``PreTrainedModel`` inside ``root`` (a PEFT model wraps one).

    A bare base model (``GPT2Model``) gives its own children with parameters. None when
    ``root`` holds no Hugging Face model (the engine's default then applies)."""
    for path, module in root.named_modules():
        prefix = getattr(type(module), "base_model_prefix", None)
        if not isinstance(prefix, str) or not hasattr(type(module), "_no_split_modules"):
            continue
        children = dict(module.named_children())
        names = [prefix] if prefix in children else []
        for name, child in children.items():
            if name != prefix:
                names.extend(_parts(name, child))
        return [f"{path}.{n}" if path else n for n in names] or None
    return None


def _compilable(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None and (
        type(module).forward is not nn.Module.forward
    )


def _parts(name: str, module: nn.Module) -> list[str]:
    """``name`` if ``module`` has parameters and a ``forward``; a container without one
    (``ModuleList``) gives its children's parts; nothing without parameters."""
    if next(module.parameters(), None) is None:
        return []
    if type(module).forward is not nn.Module.forward:
        return [name]
    return [p for n, child in module.named_children() for p in _parts(f"{name}.{n}", child)]


def _repeated(module: nn.Module) -> bool:
    """Accelerate's rule for a block list: a non-empty ``ModuleList`` of one class."""
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and all(type(m) is type(module[0]) for m in module)
    )


def regional_targets(root: nn.Module) -> list[str]:
    """The targets that accelerate's ``use_regional_compilation`` would compile: each
    block of a repeated ``ModuleList``, and every other child with parameters on the way
    to one (``transformer.wte``, ``transformer.h.0``, ..., ``lm_head``)."""
    found: list[str] = []

    def visit(name: str, module: nn.Module) -> None:
        if _repeated(module):
            found.extend(f"{name}.{i}" if name else str(i) for i in range(len(module)))
        elif any(_repeated(m) for m in module.modules()):
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
        elif name and _compilable(module):
            found.append(name)

    visit("", root)
    return found


@dataclasses.dataclass
class _TakenCompile:
    """Accelerate's dynamo plugin, switched off while the callback is in the Trainer."""

    plugin: Any
    backend: Any
    compile_kwargs: dict[str, Any]
    regional: bool


class GuardTrainerCallback(TrainerCallback):
    r"""Compile the model, warm up, lock guards, and fall back to full guards on any change,
    inside a Hugging Face ``transformers.Trainer``.

    The same engine as :class:`~guardtrain.GuardTuneCallback` (Lightning) and
    :class:`~guardtrain.GuardTuner`, with the same keyword arguments. What is
    different in the ``Trainer`` (H38):

    * **Every call of the root model is a batch.** A forward pre-hook (with keyword
      arguments) and a forward hook (``always_call=True``) on the model bracket each
      ``model(**inputs)``, in training and in evaluation. ``warmup_steps``,
      ``stable_steps`` and ``audit_every`` count these calls, so with gradient
      accumulation they count micro-batches. The batch signature is that of the
      call's arguments (dynamic padding keeps the stance as H26 describes).
    * **The stance is set only inside a forward call.** The pre-hook sets it when the
      loop is steady, the hook lifts it when the call returns or raises: an exception
      anywhere in a step (a callback's, say) leaves the stance off.
    * **Loops.** Calls in training mode belong to training (``train()`` is the run;
      each epoch is a pass), calls in evaluation mode to ``"validate"``: evaluation
      inside ``train()``, and a standalone ``evaluate()`` or ``predict()``, which is a
      run of its own (started by its first model call, ended by ``on_evaluate`` /
      ``on_predict``). Model calls in evaluation mode outside a Trainer's evaluation
      (``generate`` after training) are not touched.
    * **Default targets** (``targets=None``): the base model (``base_model_prefix``)
      and the other children with parameters (the head), so that the loss and the
      Trainer's keyword arguments (``num_items_in_batch``) stay in eager code. A
      default target that breaks the graph is replaced by its parts (its blocks, H20).
    * **The Trainer's own compile is taken over.** With ``torch_compile=True`` (or
      ``ACCELERATE_DYNAMO_BACKEND``), accelerate's ``TorchDynamoPlugin`` is switched
      off when the Trainer is made (the callback must be passed to ``Trainer(...,
      callbacks=[...])``); its backend, mode, ``fullgraph``, ``dynamic`` and options
      go into guardtrain's ``compile_kwargs`` (explicit ``compile_kwargs`` keys win),
      with one warning. Regional compilation (``use_regional_compilation``) becomes
      block targets (:func:`regional_targets`). The plugin stays off while the
      callback is in the Trainer (guardtrain compiles every later ``train()`` and
      ``evaluate()``); :meth:`release` puts it back.
    * **Distributed.** Under DDP the ranks agree through accelerate's ``reduce`` and
      ``gather_object``. Under accelerate's FSDP ``install_free_tensors`` is switched
      off and direct dispatch (turbo) is refused, as the engine's FSDP rules say.
      Under DeepSpeed the callback switches itself off with one warning.
    * **Summary.** :meth:`summary` as the other adapters; the table is logged once per
      ``train()`` / ``evaluate()`` / ``predict()`` call through the ``guardtrain``
      logger (INFO) on the main process. Metrics are not added to the Trainer's logs
      (its reporting integrations run before callbacks see them).

    At the end of each run everything is put back: the stance, Dynamo's config, the
    targets' ``forward``. The hooks stay on the model between runs and do nothing
    there; a copy or pickle of the model gets hooks that do nothing. After a run that
    raised, the targets stay compiled until the next run starts or :meth:`restore`.

    Args:
        preset: as for :class:`~guardtrain.GuardTuneCallback`.
        **kwargs: every keyword argument of :class:`~guardtrain.GuardTuneCallback`.

    Raises:
        GuardTrainValueError, GuardTrainTypeError: bad arguments, as the callback's.

    Example::

        trainer = Trainer(model=model, args=TrainingArguments(...),
                          train_dataset=train, eval_dataset=val,
                          callbacks=[GuardTrainerCallback("aggressive")])
        trainer.train()
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
        self._explicit_compile = set(compile_kwargs or {})
        self._engine = GuardEngine(self.config, Host(owner=_OWNER, root_label="<model>"))
        self._root: nn.Module | None = None
        self._handles: list[Any] = []
        self._pass: str | None = None
        """The loop whose pass is open (None between passes)."""
        self._current = _TRAIN
        self._inside = False
        self._in_train = False
        self._taken: _TakenCompile | None = None
        self._off: str | None = None
        """Why the callback does nothing (DeepSpeed, a compile it could not take over)."""
        self._run_off: str | None = None
        self._args: Any = None
        self._warned: set[str] = set()

    # -- public ------------------------------------------------------------------------------

    @property
    def settings(self) -> GuardPreset:
        """The preset's levers with the explicit arguments applied."""
        return self.config.levers

    @property
    def engine(self) -> GuardEngine:
        """The engine (read it; the hooks drive it)."""
        return self._engine

    @property
    def phase(self) -> str:
        """The training loop's phase: ``"warmup"``, ``"steady"``, or ``"off"`` (no stance)."""
        return self._engine.phase

    @property
    def disabled(self) -> bool:
        """``GUARDTRAIN_DISABLE`` was set when the callback was made: it does nothing."""
        return self.config.disabled

    @property
    def switched_off(self) -> str | None:
        """Why the callback does nothing in this Trainer (DeepSpeed), or None."""
        return self._off

    def summary(self) -> dict[str, Any]:
        """Counters and history, with the same keys as ``GuardTuneCallback.summary()``."""
        return self._engine.summary()

    def format_summary(self) -> str:
        """The end-of-run table logged at INFO on the main process."""
        return self._engine.format_summary()

    def restore(self) -> None:
        """Put back what a run changed (stance, config, the targets' ``forward``) now;
        a run left open by an exception otherwise ends when the next one starts."""
        self._end_run(logged=False)

    def release(self) -> None:
        """Leave the model and the Trainer as they were: end any run, remove the hooks, and
        put back accelerate's dynamo plugin (the Trainer compiles again itself)."""
        self.restore()
        self._detach()
        taken, self._taken = self._taken, None
        if taken is not None:
            taken.plugin.backend = taken.backend

    # -- events ------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args = args
        if self.disabled:
            return
        self._check_plugins()
        if self._off is None:
            self._take_over_compile()
            model = kwargs.get("model")
            if isinstance(model, nn.Module):
                self._attach(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args = args
        self._end_run()  # a run an exception left open (or auto_find_batch_size's retry)
        if self.disabled:
            return
        self._check_plugins()
        if self._off is not None:
            return
        self._run_off = self._untaken_compile()
        if self._run_off is not None:
            return
        model = kwargs.get("model")
        if isinstance(model, nn.Module):
            self._attach(model)
        if self._root is None:
            return
        self._in_train = True
        self._start_run(args)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._in_train:
            self._open(_TRAIN)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._in_train:
            self._close(complete=True)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._evaluation_done()

    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._evaluation_done()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._in_train = False
        self._run_off = None
        if self._engine.active:
            self._close(complete=True)
            self._engine.gather_rearms()
        self._end_run()

    # -- the hooks (per call) ----------------------------------------------------------------

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._inside or module is not self._root:
            return None
        engine = self._engine
        if not engine.run.active and not self._start_evaluation():
            return None
        training = module.training
        loop = _TRAIN if training else _VALIDATE
        if loop != self._pass:
            self._open(loop)
        self._current = loop
        self._inside = True
        engine.batch_start(loop, (args, kwargs) if args else kwargs, training)
        engine.session.resume()
        return None

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._inside or module is not self._root:
            return None
        self._inside = False
        engine = self._engine
        engine.session.pause()
        if sys.exc_info()[0] is None:
            engine.batch_end(self._current)
        return None

    # -- runs and passes ---------------------------------------------------------------------

    def _attach(self, model: nn.Module) -> None:
        """Put the hooks on ``model`` (moving them from an earlier model: ``model_init``)."""
        if model is self._root and self._handles:
            return
        self._end_run()
        self._detach()
        self._root = model
        self._handles = [
            model.register_forward_pre_hook(_Hook(self._before), with_kwargs=True),
            model.register_forward_hook(_Hook(self._after), always_call=True),
        ]

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._root = None

    def _start_run(self, args: Any) -> None:
        engine = self._engine
        world = int(getattr(args, "world_size", 1) or 1)
        rank = int(getattr(args, "process_index", 0) or 0)
        engine.config = self.config
        if self._taken is not None:
            engine.config = dataclasses.replace(
                self.config, compile_kwargs=self._taken.compile_kwargs
            )
        engine.host = self._host(world, rank)
        engine.setup(world_size=world, rank=rank, swaps_parameters=self._swapper())
        assert self._root is not None
        regional = self._taken is not None and self._taken.regional
        defaults = regional_targets(self._root) if regional else default_targets(self._root)
        engine.activate(self._root, default_targets=defaults)
        self._pass = None

    def _start_evaluation(self) -> bool:
        """A model call in evaluation mode with no run: start one if a Trainer's evaluation
        loop (this callback's Trainer) made it."""
        if self.disabled or self._off is not None or self._root is None or self._in_train:
            return False
        if self._root.training:
            return False
        trainer = self._calling_trainer()
        if trainer is None:
            return False
        self._args = getattr(trainer, "args", self._args)
        self._check_plugins()
        if self._off is not None or self._untaken_compile() is not None:
            return False
        self._start_run(self._args)
        return self._engine.active

    def _calling_trainer(self) -> Any:
        frame = sys._getframe(3)
        for _ in range(_FRAMES):
            if frame is None:
                return None
            if frame.f_code.co_name in _EVAL_FUNCTIONS:
                owner = frame.f_locals.get("self")
                handler = getattr(owner, "callback_handler", None)
                if handler is not None and any(cb is self for cb in handler.callbacks):
                    return owner
            frame = frame.f_back
        return None

    def _open(self, loop: str) -> None:
        """Start a pass of ``loop``, ending the open pass of another loop first."""
        engine = self._engine
        if self._pass is not None:
            engine.loop_end(self._pass, complete=self._pass == _TRAIN)
        self._pass = loop
        engine.loop_start(loop)

    def _close(self, complete: bool) -> None:
        if self._pass is not None:
            self._engine.loop_end(self._pass, complete=complete)
        self._pass = None

    def _evaluation_done(self) -> None:
        """``on_evaluate`` / ``on_predict``: the evaluation pass is complete."""
        if not self._engine.active:
            return
        if self._pass == _VALIDATE:
            self._close(complete=True)
        if not self._in_train:
            self._end_run()

    def _end_run(self, logged: bool = True) -> None:
        engine = self._engine
        self._inside = False
        self._pass = None
        if not engine.active:
            return
        if logged:
            engine.finish()
        else:
            engine.restore()

    # -- the Trainer's compile and plugins ---------------------------------------------------

    def _check_plugins(self) -> None:
        """DeepSpeed: switch off with one warning naming the plugin."""
        state = _accelerate_state()
        if state is None or self._off is not None:
            return
        kind = str(getattr(getattr(state, "distributed_type", None), "value", ""))
        plugin = getattr(state, "deepspeed_plugin", None)
        if kind.upper() == "DEEPSPEED" or plugin is not None:
            stage = getattr(plugin, "zero_stage", None)
            self._off = (
                f"DeepSpeed (accelerate's {type(plugin).__name__}"
                + (f", ZeRO stage {stage}" if stage is not None else "")
                + ") manages the model's parameters and its own compile"
            )
            self._tell(f"guardtrain: {_OWNER} switches itself off: {self._off}.")

    def _swapper(self) -> str | None:
        """accelerate's FSDP: parameters are swapped around every forward (the engine's rules)."""
        state = _accelerate_state()
        kind = str(getattr(getattr(state, "distributed_type", None), "value", ""))
        if kind.upper() != "FSDP":
            return None
        plugin = getattr(state, "fsdp_plugin", None)
        version = getattr(plugin, "fsdp_version", None)
        return f"accelerate's FSDP ({type(plugin).__name__}" + (
            f", fsdp_version {version})" if version is not None else ")"
        )

    def _take_over_compile(self) -> None:
        """Switch accelerate's dynamo plugin off; its settings go into guardtrain's compile."""
        state = _accelerate_state()
        plugin = getattr(state, "dynamo_plugin", None)
        backend = getattr(plugin, "backend", None)
        name = str(getattr(backend, "value", backend or "no")).lower()
        if plugin is None or name == "no" or self._taken is not None:
            return
        from_trainer: dict[str, Any] = {"backend": name}
        mode = getattr(plugin, "mode", None)
        if mode not in (None, "default"):
            from_trainer["mode"] = mode
        if getattr(plugin, "fullgraph", False):
            from_trainer["fullgraph"] = True
        if getattr(plugin, "dynamic", None) is not None:
            from_trainer["dynamic"] = plugin.dynamic
        if getattr(plugin, "options", None):
            from_trainer["options"] = dict(plugin.options)
        merged = dict(from_trainer)
        merged.update({k: v for k, v in self.config.compile_kwargs.items()})
        for key in self._explicit_compile:
            merged[key] = self.config.compile_kwargs.get(key, merged.get(key))
        regional = bool(getattr(plugin, "use_regional_compilation", False))
        self._taken = _TakenCompile(plugin, backend, check_compile_kwargs(merged), regional)
        from accelerate.utils import DynamoBackend

        plugin.backend = DynamoBackend.NO
        kept = sorted(k for k in from_trainer if k in self._explicit_compile)
        self._tell(
            f"guardtrain: took over the Trainer's compile (accelerate's {type(plugin).__name__}: "
            f"{from_trainer}{', regional compilation' if regional else ''}): {_OWNER} compiles "
            + ("its block targets" if regional and self.config.targets is None else "its targets")
            + " with these settings"
            + (f" (your compile_kwargs win for {kept})" if kept else "")
            + "; state_dict keys stay as they are. Drop torch_compile to silence this."
        )

    def _untaken_compile(self) -> str | None:
        """The Trainer compiled the model itself (the callback was added after the Trainer
        was made): this run is left alone, with one warning."""
        state = _accelerate_state()
        plugin = getattr(state, "dynamo_plugin", None)
        backend = getattr(plugin, "backend", None)
        name = str(getattr(backend, "value", backend or "no")).lower()
        if plugin is None or name == "no" or (self._taken and self._taken.plugin is plugin):
            return None
        why = (
            f"the Trainer compiled the model itself (torch_compile, backend {name!r}) before "
            f"{_OWNER} could take its compile over: pass the callback to Trainer(callbacks=[...]) "
            "rather than add_callback, or drop torch_compile"
        )
        self._tell(f"guardtrain: {_OWNER} does nothing in this run: {why}.")
        return why

    # -- messages ----------------------------------------------------------------------------

    def _main(self) -> bool:
        return int(getattr(self._args, "process_index", 0) or 0) == 0

    def _tell(self, message: str) -> None:
        """One warning per message, on the main process."""
        if message in self._warned:
            return
        self._warned.add(message)
        if self._main():
            warnings.warn(message, UserWarning, stacklevel=3)

    def _host(self, world: int, rank: int) -> Host:
        main = rank == 0

        def warn(message: str) -> None:
            warnings.warn(message, UserWarning, stacklevel=4)

        return Host(
            info=log.info if main else _quiet,
            warn=warn if main else _quiet,
            log_metrics=None,
            agreement=_AccelerateAgreement(world, rank) if world > 1 else SingleProcess(),
            owner=_OWNER,
            root_label="<model>",
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> GuardTrainerCallback:
        """A copy with the same arguments and no run (the Trainer's state is not copied)."""
        new = copy.copy(self)
        new.__dict__.update(
            _engine=GuardEngine(self.config, Host(owner=_OWNER, root_label="<model>")),
            _root=None,
            _handles=[],
            _taken=None,
            _warned=set(),
        )
        return new
