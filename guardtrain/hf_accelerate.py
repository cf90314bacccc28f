"""What the Hugging Face ``Trainer`` adapter reads from the model and from accelerate (H38).

No transformers import: the default and regional targets of a model, the hooks' wrapper,
accelerate's process-wide state (its dynamo, FSDP and DeepSpeed plugins), rank agreement
through accelerate's collectives, and the frames of a ``Trainer``'s evaluation and run.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
import types
import warnings
from typing import Any

import torch
from torch import nn

from guardtrain._torch import accelerate_state_empty
from guardtrain.compile import check_compile_kwargs
from guardtrain.engine.agreement import ReduceAgreement, SingleProcess
from guardtrain.engine.host import Host
from guardtrain.engine.process import PROCESS

__all__ = [
    "AccelerateAgreement",
    "Hook",
    "Plugins",
    "TakenCompile",
    "accelerate_state",
    "base_of",
    "calling_trainer",
    "compiling_plugin",
    "deepspeed_reason",
    "default_targets",
    "fsdp_swapper",
    "make_host",
    "plugin_kwargs",
    "regional_targets",
    "take_over",
    "take_over_message",
    "took_over_label",
    "trainer_running",
]

log = logging.getLogger("guardtrain")

_EVAL_FUNCTIONS = frozenset(
    {"evaluation_loop", "prediction_loop", "prediction_step", "evaluate", "predict"}
)
"""Trainer methods whose frames mark a model call as the Trainer's evaluation."""
_FRAMES = 40
_RUN_FUNCTIONS = frozenset({"train", "_inner_training_loop"}) | _EVAL_FUNCTIONS
"""Trainer methods whose frames mark its run as live (H45)."""


def _inert(*args: Any) -> None:
    """What a copied or pickled model's hooks become: they do nothing."""
    return None


class Hook(functools.partial):  # type: ignore[type-arg]
    """A hook that a ``copy.deepcopy`` or pickle of the model turns into :func:`_inert`
    (the copy must not drive this callback's engine, nor drag it along). A ``partial``
    with no bound arguments: calling it costs no Python frame of its own."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _inert

    def __reduce__(self) -> Any:
        return (_inert_factory, ())


def _inert_factory() -> Any:
    return _inert


def accelerate_state() -> Any:
    """Accelerate's process-wide ``AcceleratorState`` once an ``Accelerator`` exists, else None."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover - transformers needs accelerate for the Trainer
        return None
    if accelerate_state_empty(AcceleratorState):
        return None
    return AcceleratorState()


def _quiet(message: str) -> None:
    return None


class AccelerateAgreement(ReduceAgreement):
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


def base_of(model: nn.Module) -> tuple[nn.Module, ...]:
    """A peft model's base model (``get_base_model()``), which its ``generate()`` calls
    without its own ``forward``; ``()`` for any other model."""
    get = getattr(model, "get_base_model", None)
    base = get() if callable(get) else None
    return (base,) if isinstance(base, nn.Module) and base is not model else ()


def default_targets(root: nn.Module) -> list[str] | None:
    """The default target of a Hugging Face model: the outermost ``PreTrainedModel`` in
    ``root`` (``root`` itself, or the model a PEFT model wraps). Its ``forward`` is what a
    training step calls through the wrappers and what its ``generate()`` calls at every
    decode step (a PEFT model's ``generate()`` calls its base model, never the PEFT
    wrapper's ``forward``). When it breaks the graph it is split into its parts (its base
    model and head, H20), unless direct dispatch serves the calls that do not break.

    None when ``root`` holds no Hugging Face model (the engine's default then applies)."""
    for path, module in root.named_modules():
        prefix = getattr(type(module), "base_model_prefix", None)
        if isinstance(prefix, str) and hasattr(type(module), "_no_split_modules"):
            return [path]
    return None


def _compilable(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None and (
        type(module).forward is not nn.Module.forward
    )


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
        if isinstance(module, nn.ModuleList) and _repeated(module):
            found.extend(f"{name}.{i}" if name else str(i) for i in range(len(module)))
        elif any(_repeated(m) for m in module.modules()):
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
        elif name and _compilable(module):
            found.append(name)

    visit("", root)
    return found


@dataclasses.dataclass
class TakenCompile:
    """accelerate's dynamo plugin, switched off while the callback is in the Trainer."""

    plugin: Any
    backend: Any
    compile_kwargs: dict[str, Any]
    regional: bool
    from_trainer: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the plugin would have passed to ``torch.compile``."""


def _kind(state: Any) -> str:
    return str(getattr(getattr(state, "distributed_type", None), "value", "")).upper()


def deepspeed_reason(state: Any) -> str | None:
    """Why guardtrain stays out under DeepSpeed (naming the plugin), or None."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if state is None or (_kind(state) != "DEEPSPEED" and plugin is None):
        return None
    stage = getattr(plugin, "zero_stage", None)
    return (
        f"DeepSpeed (accelerate's {type(plugin).__name__}"
        + (f", ZeRO stage {stage}" if stage is not None else "")
        + ") manages the model's parameters and its own compile"
    )


def fsdp_swapper(state: Any) -> str | None:
    """accelerate's FSDP, named for the engine's rules (parameters swapped every forward)."""
    if _kind(state) != "FSDP":
        return None
    plugin = getattr(state, "fsdp_plugin", None)
    version = getattr(plugin, "fsdp_version", None)
    return f"accelerate's FSDP ({type(plugin).__name__}" + (
        f", fsdp_version {version})" if version is not None else ")"
    )


def compiling_plugin(state: Any) -> tuple[Any, str] | None:
    """accelerate's dynamo plugin and its backend's name when it would compile, else None."""
    plugin = getattr(state, "dynamo_plugin", None)
    backend = getattr(plugin, "backend", None)
    name = str(getattr(backend, "value", backend or "no")).lower()
    return None if plugin is None or name == "no" else (plugin, name)


def plugin_kwargs(plugin: Any, name: str) -> dict[str, Any]:
    """The ``torch.compile`` arguments that the plugin would pass (defaults left out)."""
    found: dict[str, Any] = {"backend": name}
    mode = getattr(plugin, "mode", None)
    if mode not in (None, "default"):
        found["mode"] = mode
    if getattr(plugin, "fullgraph", False):
        found["fullgraph"] = True
    if getattr(plugin, "dynamic", None) is not None:
        found["dynamic"] = plugin.dynamic
    if getattr(plugin, "options", None):
        found["options"] = dict(plugin.options)
    return found


def take_over(
    state: Any, compile_kwargs: dict[str, Any], explicit: set[str]
) -> TakenCompile | None:
    """Switch accelerate's dynamo plugin off; its settings, under the explicit
    ``compile_kwargs`` keys, become guardtrain's compile arguments. None: nothing to take."""
    found = compiling_plugin(state)
    if found is None:
        return None
    plugin, name = found
    from_trainer = plugin_kwargs(plugin, name)
    merged = {**from_trainer, **{k: compile_kwargs[k] for k in explicit if k in compile_kwargs}}
    regional = bool(getattr(plugin, "use_regional_compilation", False))
    taken = TakenCompile(plugin, plugin.backend, check_compile_kwargs(merged), regional)
    taken.from_trainer = from_trainer
    from accelerate.utils import DynamoBackend

    plugin.backend = DynamoBackend.NO
    return taken


def took_over_label(taken: TakenCompile) -> str:
    """How the summary's ``took_over`` names a taken compile, with its backend and mode."""
    what = "accelerate's regional compilation" if taken.regional else "the Trainer's torch_compile"
    mode = getattr(taken.plugin, "mode", None) or "default"
    backend = taken.from_trainer.get("backend")
    return f"{what} ({type(taken.plugin).__name__}, backend {backend!r}, mode {mode!r})"


def take_over_message(taken: TakenCompile, owner: str, explicit: set[str], blocks: bool) -> str:
    kept = sorted(k for k in taken.from_trainer if k in explicit)
    return (
        f"guardtrain: took over the Trainer's compile (accelerate's "
        f"{type(taken.plugin).__name__}: {taken.from_trainer}"
        f"{', regional compilation' if taken.regional else ''}): {owner} compiles "
        + ("its block targets" if blocks else "its targets")
        + " with these settings"
        + (f" (your compile_kwargs win for {kept})" if kept else "")
        + "; state_dict keys stay as they are. Drop torch_compile to silence this."
    )


def _holds(trainer: Any, callback: Any) -> bool:
    """Whether ``trainer`` (a frame's ``self``) is a ``Trainer`` holding ``callback``."""
    handler = getattr(trainer, "callback_handler", None)
    return handler is not None and any(cb is callback for cb in handler.callbacks)


def _trainer_on_stack(
    callback: Any, frame: types.FrameType | None, names: frozenset[str], limit: int | None
) -> Any:
    """The ``Trainer`` holding ``callback`` in a frame of one of its methods ``names``, from
    ``frame`` outwards (at most ``limit`` frames; None: the whole stack), or None."""
    depth = 0
    while frame is not None and (limit is None or depth < limit):
        if frame.f_code.co_name in names:
            owner = frame.f_locals.get("self")
            if _holds(owner, callback):
                return owner
        frame = frame.f_back
        depth += 1
    return None


def calling_trainer(callback: Any, frame: types.FrameType | None) -> Any:
    """The ``Trainer`` (holding ``callback``) whose evaluation made this call, or None."""
    return _trainer_on_stack(callback, frame, _EVAL_FUNCTIONS, _FRAMES)


def trainer_running(callback: Any, thread: int) -> bool:
    """Whether the ``Trainer`` holding ``callback``, whose run began in thread ``thread``, is
    still inside its ``train``, ``evaluate`` or ``predict`` (an HF run's liveness, H45).

    In this thread: a frame of one is on this thread's stack. A run begun in another thread
    counts as live while that thread lives (no other thread's frames are read).
    """
    if thread != threading.get_ident():
        return any(t.ident == thread for t in threading.enumerate())
    return _trainer_on_stack(callback, sys._getframe(1), _RUN_FUNCTIONS, None) is not None


def make_host(world: int, rank: int, owner: str) -> Host:
    """Messages on the main process only (the ``guardtrain`` logger, warnings), no
    metrics, and accelerate's collectives with several processes."""
    main = rank == 0

    def warn(message: str) -> None:
        warnings.warn(message, UserWarning, stacklevel=4)

    return Host(
        info=log.info if main else _quiet,
        warn=warn if main else _quiet,
        log_metrics=None,
        agreement=AccelerateAgreement(world, rank) if world > 1 else SingleProcess(),
        owner=owner,
        root_label="<model>",
    )


class Plugins:
    """accelerate's plugins as one adapter sees them: DeepSpeed switches it off, the
    dynamo plugin is taken over (and given back). Each warning is given once, on the
    main process.

    Args:
        owner: the adapter named in messages.
        explicit: the ``compile_kwargs`` keys the user passed (they win over the plugin's).
    """

    def __init__(self, owner: str, explicit: set[str]) -> None:
        self.owner = owner
        self.explicit = explicit
        self.taken: TakenCompile | None = None
        self.off: str | None = None
        """Why the adapter does nothing in this Trainer (DeepSpeed), or None."""
        self.main = True
        self._told: set[str] = set()

    def tell(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            if self.main:
                warnings.warn(message, UserWarning, stacklevel=4)

    def check_deepspeed(self) -> str | None:
        """DeepSpeed: switched off, with one warning naming the plugin; returns why."""
        if self.off is None:
            self.off = deepspeed_reason(accelerate_state())
            if self.off is not None:
                self.tell(f"guardtrain: {self.owner} switches itself off: {self.off}.")
        return self.off

    def take_over(self, config: Any) -> None:
        """Switch accelerate's dynamo plugin off; its settings go into guardtrain's compile."""
        if self.taken is not None:
            return
        taken = take_over(accelerate_state(), config.compile_kwargs, self.explicit)
        self.taken = taken
        if taken is not None:

            def give_back() -> None:
                taken.plugin.backend = taken.backend

            PROCESS.take(self, f"{took_over_label(taken)}, taken over by {self.owner}", give_back)
            blocks = taken.regional and config.targets is None
            self.tell(take_over_message(taken, self.owner, self.explicit, blocks))

    def untaken(self) -> str | None:
        """Why this run is left alone: accelerate compiled the model itself (the adapter
        was added after the Trainer was made), with one warning; None otherwise."""
        found = compiling_plugin(accelerate_state())
        if found is None or (self.taken is not None and self.taken.plugin is found[0]):
            return None
        why = (
            f"the Trainer compiled the model itself (torch_compile, backend {found[1]!r}) "
            f"before {self.owner} could take its compile over: pass the callback to "
            "Trainer(callbacks=[...]) rather than add_callback, or drop torch_compile"
        )
        self.tell(f"guardtrain: {self.owner} does nothing in this run: {why}.")
        return why

    def give_back(self) -> None:
        """Put accelerate's dynamo plugin back as it was."""
        self.taken = None
        PROCESS.give_back(self)
