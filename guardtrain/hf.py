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
hook (``always_call=True``): the pre-hook tells the engine a batch starts, the hook that
it ended (unless the forward raised; a call that returned inside an outer ``except`` block
ended too). As in every adapter, torch's stance is set only around a target's own
compiled call, by that call (H41): the loss, the optimizer step, the Trainer's and other
callbacks' code and any other compiled function run with full guards.

The same engine as :class:`~guardtrain.GuardTuneCallback` (Lightning) and
:class:`~guardtrain.GuardTuner`, with the same keyword arguments. What is
different in the ``Trainer`` (H38):

* **Every call of the root model is a batch.** A forward pre-hook (with keyword
  arguments) and a forward hook (``always_call=True``) on the model bracket each
  ``model(**inputs)``, in training and in evaluation. ``warmup_steps``,
  ``stable_steps`` and ``audit_every`` count these calls, so with gradient
  accumulation they count micro-batches. The batch signature is that of the
  call's arguments (dynamic padding keeps the stance as H26 describes).
* **The stance is set only inside a target's compiled call** (H41), by that call, and
  put back when it returns or raises: an exception anywhere in a step (a callback's,
  say) finds it off.
* **Loops.** Calls in training mode belong to training (``train()`` is the run;
  each epoch is a pass), calls in evaluation mode to ``"validate"``: evaluation
  inside ``train()``, and a standalone ``evaluate()`` or ``predict()``, which is a
  run of its own (started by its first model call, ended by ``on_evaluate`` /
  ``on_predict``). Model calls in evaluation mode outside a Trainer's evaluation
  (``generate`` after training) are not touched.
* **Default target** (``targets=None``): the outermost ``PreTrainedModel`` (the
  model itself, or the one a PEFT model wraps): at least what ``torch_compile=True``
  compiles, less a PEFT wrapper's ``forward``, and what ``generate()`` calls at every
  decode step. A default target that breaks the graph is replaced by its parts (its base
  model and head, then their blocks, H20); with direct dispatch (turbo, ``auto``) one
  that also has entries without a break (only the training forward breaks, as in TRL's
  GRPO) is kept whole: those calls run directly, the others with full guards.
* **The Trainer's own compile is taken over.** With ``torch_compile=True`` (or
  ``ACCELERATE_DYNAMO_BACKEND``), accelerate's ``TorchDynamoPlugin`` is switched
  off when the Trainer is made (the callback must be passed to ``Trainer(...,
  callbacks=[...])``); its backend, mode, ``fullgraph``, ``dynamic`` and options
  go into guardtrain's ``compile_kwargs`` (explicit ``compile_kwargs`` keys win),
  with one warning. Regional compilation (``use_regional_compilation``) becomes
  block targets (:func:`regional_targets`). The plugin stays off while the
  callback is in the Trainer (guardtrain compiles every later ``train()`` and
  ``evaluate()``); :meth:`GuardTrainerCallback.release` puts it back, as does the
  callback's garbage collection.
* **Distributed.** Under DDP the ranks agree through accelerate's ``reduce`` and
  ``gather_object``. Under accelerate's FSDP ``install_free_tensors`` is switched
  off and direct dispatch (turbo) is refused, as the engine's FSDP rules say.
  Under DeepSpeed the callback switches itself off with one warning.
* **Summary.** :meth:`GuardTrainerCallback.summary` as the other adapters; the table is logged once per
  ``train()`` / ``evaluate()`` / ``predict()`` call through the ``guardtrain``
  logger (INFO) on the main process. Metrics are not added to the Trainer's logs
  (its reporting integrations run before callbacks see them).

At the end of each run everything is put back: the stance, Dynamo's config, the
targets' ``forward``. The hooks stay on the model between runs and do nothing
there; a copy or pickle of the model gets hooks that do nothing. After a run that
raised, the targets stay compiled until the next run starts or :meth:`GuardTrainerCallback.restore`.
"""

from __future__ import annotations

import copy
import sys
import threading
from types import TracebackType
from typing import Any, Unpack

import torch
from torch import nn
from torch.compiler import is_compiling
from transformers import TrainerCallback

from guardtrain import hf_accelerate as hfa
from guardtrain.arguments import AdapterSignature, document_arguments
from guardtrain.engine.config import GuardArguments, GuardConfig
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import Loop
from guardtrain.presets import PresetName
from guardtrain.view import EngineView

__all__ = ["GuardTrainerCallback", "default_targets", "regional_targets"]

default_targets = hfa.default_targets
regional_targets = hfa.regional_targets


_TRAIN, _VALIDATE = Loop.TRAIN.value, Loop.VALIDATE.value
_OWNER = "GuardTrainerCallback"
_SIGNATURE = AdapterSignature(GuardConfig)


class GuardTrainerCallback(EngineView, TrainerCallback):
    r"""Compile the model, warm up, lock guards, and fall back to full guards on any change,
    inside a Hugging Face ``transformers.Trainer``.

    The same engine and keyword arguments as :class:`~guardtrain.GuardTuneCallback`.
    A forward pre-hook and an always-called forward hook on the model bracket every
    ``model(**inputs)``: each call is one batch of the engine (``warmup_steps``,
    ``stable_steps`` and ``audit_every`` count calls, so micro-batches with gradient
    accumulation). Only the targets' own compiled calls skip guards; the loss, the
    optimizer step and the Trainer's code keep full guards. Default target: the
    outermost ``PreTrainedModel``. The Trainer's own compile (``torch_compile=True``)
    is taken over when the Trainer is made, so pass the callback to ``Trainer(...,
    callbacks=[...])``. Under DeepSpeed the callback switches itself off with a warning.

    The rules in the ``Trainer``: docs/hf.md; the mechanism: docs/how-it-works.md.

    Args:
        {arguments}

    Raises:
        GuardTrainValueError: an argument out of range, as
            :class:`~guardtrain.GuardTuneCallback` refuses it. When a run starts: a
            target compiled already, a ``targets`` entry that matches no submodule, an
            optimizer that ``compile_optimizer=True`` cannot compile.
        GuardTrainTypeError: an argument of the wrong type.
        GuardTrainRuntimeError: when a run starts, torch's unsafe stance is already set,
            or a target is compiled by another guardtrain run that is still going.
        TypeError: an unknown keyword argument.

    Example::

        from transformers import Trainer, TrainingArguments
        from guardtrain import GuardTrainerCallback

        trainer = Trainer(model=model, args=TrainingArguments(...),
                          train_dataset=train, eval_dataset=val,
                          callbacks=[GuardTrainerCallback("aggressive")])
        trainer.train()
    """

    @_SIGNATURE
    def __init__(self, preset: PresetName = "auto", **arguments: Unpack[GuardArguments]) -> None:
        fields = _SIGNATURE.bind(self, preset, **arguments)
        self.config: GuardConfig = GuardConfig(**fields)
        self._explicit_compile = set(fields["compile_kwargs"] or {})
        self._engine = GuardEngine(self.config, Host(owner=_OWNER))
        self._root: nn.Module | None = None
        self._handles: list[Any] = []
        self._pass: str | None = None
        """The loop whose pass is open (None between passes)."""
        self._current = _TRAIN
        self._inside: nn.Module | None = None
        """The model whose call is the open batch (the root, or a peft model's base)."""
        self._handling: tuple[BaseException | None, TracebackType | None] = (None, None)
        """The exception being handled when the open batch's call began (see :func:`_raised`)."""
        self._in_train = False
        self._plugins = hfa.Plugins(_OWNER, self._explicit_compile)
        self._run_off: str | None = None
        """Why this ``train()`` is left alone (a compile accelerate made before the callback
        could take it over), or None."""
        self._args: Any = None

    # -- public ------------------------------------------------------------------------------

    @property
    def switched_off(self) -> str | None:
        """Why the callback does nothing in this Trainer (DeepSpeed), or None."""
        return self._plugins.off

    def restore(self) -> None:
        """Put back what a run changed (stance, config, the targets' ``forward``) now;
        a run left open by an exception otherwise ends when the next one starts."""
        self._end_run(logged=False)

    def release(self) -> None:
        """Leave the model and the Trainer as they were: end any run, remove the hooks, and
        put back accelerate's dynamo plugin (the Trainer compiles again itself)."""
        self.restore()
        self._detach()
        self._plugins.give_back()

    # -- events ------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args = args
        if self.disabled:
            return
        plugins = self._plugins
        plugins.main = int(getattr(args, "process_index", 0) or 0) == 0
        if plugins.check_deepspeed() is None:
            plugins.take_over(self.config)
            model = kwargs.get("model")
            if isinstance(model, nn.Module):
                self._attach(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args = args
        self._end_run()  # a run an exception left open (or auto_find_batch_size's retry)
        if self.disabled:
            return
        self._plugins.main = int(getattr(args, "process_index", 0) or 0) == 0
        if self._plugins.check_deepspeed() is not None:
            return
        self._run_off = self._plugins.untaken()
        if self._run_off is not None:
            return
        model = kwargs.get("model")
        if isinstance(model, nn.Module):
            self._attach(model)
        if self._root is None:
            return
        self._in_train = True
        self._start_run(args)
        optimizer = kwargs.get("optimizer")  # accelerate's wrapper: its optimizer (H49)
        if optimizer is not None:
            self._engine.compile_optimizers([getattr(optimizer, "optimizer", optimizer)])

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._in_train:
            self._open(_TRAIN)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._in_train:
            self._close(complete=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._engine.step_start()  # the bottom line: the steady step's wall time

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._engine.backward_done()  # the step's backward ran (H52)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._engine.backward_done()  # an accumulation substep's backward ran (H52)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._engine.step_end()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._evaluation_done()

    def on_predict(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
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
        if self._inside is not None:
            return None  # a call inside the batch: a peft model's call of its base model
        engine = self._engine
        if not engine.active and (is_compiling() or not self._start_evaluation()):
            return None  # no run; or Dynamo traces this hook (a compile made by accelerate)
        training = module.training
        loop = _TRAIN if training else _VALIDATE
        if loop != self._pass:
            self._open(loop)
        self._current = loop
        self._inside = module
        self._handling = _handled()
        engine.batch_start(loop, (args, kwargs) if args else kwargs, training)
        return None

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if module is not self._inside:
            return None
        self._inside = None
        handling, self._handling = self._handling, (None, None)  # no frames kept alive
        if not _raised(handling):
            # In training the step's backward comes after this call (H52).
            backward = self._current == _TRAIN and torch.is_grad_enabled()
            self._engine.batch_end(self._current, backward_follows=backward)
        return None

    # -- runs and passes ---------------------------------------------------------------------

    def _attach(self, model: nn.Module) -> None:
        """Put the hooks on ``model`` (moving them from an earlier model: ``model_init``)."""
        if model is self._root and self._handles:
            return
        self._end_run()
        self._detach()
        self._root = model
        # A peft model's generate() calls its base model, never the peft model's forward:
        # the base model's calls are batches too (H53), but not inside the peft model's.
        for called in (model, *hfa.base_of(model)):
            self._handles += [
                called.register_forward_pre_hook(hfa.Hook(self._before), with_kwargs=True),
                called.register_forward_hook(hfa.Hook(self._after), always_call=True),
            ]

    def _released(self) -> None:
        """Another callback's run released this one, which ended without its events (H45):
        the hooks come off the model and the run is forgotten."""
        self._inside = None
        self._handling = (None, None)
        self._in_train = False
        self._pass = self._run_off = None
        self._detach()

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._root = None

    def _start_run(self, args: Any) -> None:
        engine = self._engine
        world = int(getattr(args, "world_size", 1) or 1)
        rank = int(getattr(args, "process_index", 0) or 0)
        taken = self._plugins.taken
        engine.host = hfa.make_host(world, rank, _OWNER)
        thread = threading.get_ident()
        engine.host.live = lambda: hfa.trainer_running(self, thread)
        engine.host.on_release = self._released
        engine.setup(
            world_size=world,
            rank=rank,
            swaps_parameters=hfa.fsdp_swapper(hfa.accelerate_state()),
            compile_kwargs=None if taken is None else taken.compile_kwargs,
            took_over=None if taken is None else [hfa.took_over_label(taken)],
        )
        assert self._root is not None
        regional = taken is not None and taken.regional
        defaults = hfa.regional_targets(self._root) if regional else hfa.default_targets(self._root)
        engine.activate(self._root, default_targets=defaults)
        self._pass = None

    def _start_evaluation(self) -> bool:
        """A model call in evaluation mode with no run: start one if a Trainer's evaluation
        loop (this callback's Trainer) made it."""
        if self.disabled or self._plugins.off or self._root is None or self._in_train:
            return False
        if self._root.training:
            return False
        trainer = hfa.calling_trainer(self, sys._getframe(2))
        if trainer is None:
            return False
        self._args = getattr(trainer, "args", self._args)
        if self._plugins.check_deepspeed() is not None or self._plugins.untaken() is not None:
            return False
        self._start_run(self._args)
        return self._engine.active

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
        self._inside = None
        self._handling = (None, None)
        self._pass = None
        if not engine.active:
            return
        if logged:
            engine.finish()
        else:
            engine.restore()

    def __deepcopy__(self, memo: dict[int, Any]) -> GuardTrainerCallback:
        """A copy with the same arguments and no run (the Trainer's state is not copied)."""
        new = copy.copy(self)
        new.__dict__.update(
            _engine=GuardEngine(self.config, Host(owner=_OWNER)),
            _root=None,
            _handles=[],
            _plugins=hfa.Plugins(_OWNER, self._explicit_compile),
        )
        return new


def _handled() -> tuple[BaseException | None, TracebackType | None]:
    """The exception being handled now (a call made inside an ``except`` block), with its
    traceback as it stands now; ``(None, None)`` outside any."""
    exc = sys.exc_info()[1]
    return exc, None if exc is None else exc.__traceback__


def _raised(before: tuple[BaseException | None, TracebackType | None]) -> bool:
    """In the always-called forward hook: whether the call raised, ``before`` being what
    :func:`_handled` said when it began. Torch calls the hook inside its own ``except``
    when the forward raised, so an exception is handled there that was not handled
    before: a new one, or the one handled before raised again by the forward (its
    traceback grew). A call that returned, also inside an outer ``except`` block, finds
    the same exception with the same traceback."""
    exc = sys.exc_info()[1]
    return exc is not None and (exc is not before[0] or exc.__traceback__ is not before[1])


GuardTrainerCallback.__doc__ = document_arguments(GuardTrainerCallback.__doc__, GuardConfig)
