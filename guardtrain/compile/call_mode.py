"""The per-call mode and argument keys, and the dispatch-mode and outside-state checks.

A call's :data:`CallMode` (``training``, grad, inference mode, autocast) picks which
entries the stance may run; its argument key (:func:`call_key`) says whether its
plain arguments are ones an entry was shown to accept (H32) and which harvested
entry may serve it directly (H30). Everything here runs on the per-call path and is
written for it: module-level names bound once, no call where a test suffices.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from guardtrain._torch import (
    STANCE,
    any_dispatch_mode,
    callback_handler,
    dispatch_mode_on_stack,
    dynamo_config,
    eval_frame_state,
    frame_callback,
    has_saved_hooks_check,
    hooks_inlineable,
    torch_function_modes,
)
from guardtrain._torch import any_autocast as _any_autocast
from guardtrain._torch import top_saved_hooks as _top_saved_hooks
from guardtrain.compile.caches import class_dicts, versions

__all__ = [
    "ONE_TENSOR",
    "PLAIN_TYPES",
    "CallMode",
    "call_key",
    "callback_handler",
    "describe_call_mode",
    "dispatch_mode_active",
    "inlined_hooks_active",
    "key_sources",
    "masked",
    "mode_of",
    "outside_state_clear",
    "structure",
    "top_saved_hooks",
    "unambiguous_modes",
]

is_grad_enabled = torch.is_grad_enabled
is_inference = torch.is_inference_mode_enabled
any_autocast: Callable[[], bool] = _any_autocast
CallMode = tuple[bool, bool, bool, bool]
"""``(training, grad enabled, inference mode, autocast on)`` of a call."""


def mode_of(module: nn.Module) -> CallMode:
    """The mode a call of ``module`` has now."""
    return (module.training, is_grad_enabled(), is_inference(), any_autocast())


def describe_call_mode(mode: CallMode, compiled: bool) -> str:
    """Why a call of ``mode`` may not run under the stance (``compiled``: entries exist)."""
    training, grad, inference, autocast = mode
    what = (
        f"a call with training={training}, grad enabled={grad}, inference mode={inference}, "
        f"autocast={autocast}"
    )
    if compiled:
        return (
            f"{what}: entries for both training values exist under this grad mode and "
            "autocast, and the stance cannot tell them apart"
        )
    return f"{what}, a combination not compiled with full guards"


def unambiguous_modes(modes: set[CallMode]) -> set[CallMode]:
    """The modes whose grad mode and autocast were compiled with one training value only."""
    trainings: dict[tuple[bool, ...], set[bool]] = {}
    for mode in modes:
        trainings.setdefault(mode[1:], set()).add(mode[0])
    return {m for m in modes if len(trainings[m[1:]]) == 1}


# -- argument keys (H30, H32) ----------------------------------------------------------------

PLAIN_TYPES: tuple[type, ...] = (bool, int, float, str, type(None), torch.dtype, torch.device)
"""Argument types a key holds by value (beside the structure and the tensors)."""
_PLAIN_KINDS = frozenset(PLAIN_TYPES)
ONE_TENSOR: tuple[Any, ...] = (1, torch.Tensor)
"""The key of a call with one tensor and nothing else (``net(x)``), one object."""
_Tensor = torch.Tensor


def _walk(value: Any, key: list[Any], tensors: list[torch.Tensor]) -> bool:
    """Describe ``value`` into ``key`` (structure, plain values) and collect its tensors;
    False for anything else (its state could change without a visible difference)."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        key.append(kind)  # the exact class: TensorGuards does not check a subclass
        tensors.append(value)
        return True
    if kind in PLAIN_TYPES:
        key.append((kind, value))
        return True
    if kind is tuple or kind is list:
        key.append((kind, len(value)))
        return all(_walk(v, key, tensors) for v in value)
    if kind is dict:
        key.append((kind, tuple(value)))
        return all(_walk(v, key, tensors) for v in value.values())
    dicts = class_dicts(kind)
    return dicts is not None and _walk_cache(value, kind, dicts, key, tensors)


def _walk_cache(
    value: Any, kind: type, dicts: tuple[Any, ...], key: list[Any], tensors: list[torch.Tensor]
) -> bool:
    """Describe a transformers cache or model output (:mod:`~guardtrain.compile.caches`,
    H53): its class, its attribute names and its classes' dictionary versions, then each
    attribute as :func:`_walk` describes it (a class it holds, such as the layer class to
    replicate, by identity with its own versions), then a model output's items."""
    try:
        attributes = value.__dict__
    except AttributeError:
        return False
    key.append((kind, tuple(attributes), versions(dicts)))
    for v in attributes.values():
        kind = type(v)
        if kind is _Tensor:
            key.append(_Tensor)
            tensors.append(v)
        elif kind in _PLAIN_KINDS:
            key.append((kind, v))
        elif kind is list:  # a cache's layers: walked here, without a call per layer
            key.append((list, len(v)))
            for item in v:
                held = class_dicts(type(item))
                if held is not None:
                    if not _walk_cache(item, type(item), held, key, tensors):
                        return False
                elif not _walk(item, key, tensors):
                    return False
        elif isinstance(v, type):
            held = class_dicts(v)
            if held is None:
                return False
            key.append((type, v, versions(held)))
        elif not _walk(v, key, tensors):
            return False
    if isinstance(value, dict):  # a model output: its items as well as its attributes
        key.append((dict, tuple(value)))
        return all(_walk(v, key, tensors) for v in value.values())
    return True


# Kept whole: it runs on every call under the stance, and the common cases (one tensor;
# tensors and plain values) are tested inline, without a call per argument.
# Complexity 20: the per-call path; split, it would add a Python call per argument.
def call_key(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
    """A call's structure and plain argument values, and its distinct tensors in order
    (a repeated tensor once, the key saying which arguments are one tensor); None when
    an argument is something else (a module, a custom object): that call is not
    dispatched directly."""
    if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:
        return ONE_TENSOR, args  # type: ignore[return-value]  # `net(x)`, the common call
    key: list[Any] = [len(args)]
    tensors: list[torch.Tensor] = []
    for value in args:
        kind = type(value)
        if kind is _Tensor:  # the common cases, without a call
            key.append(_Tensor)
            tensors.append(value)
        elif kind in _PLAIN_KINDS:
            key.append((kind, value))
        elif not _walk(value, key, tensors):
            return None
    if kwargs:
        key.append(tuple(kwargs))
        for value in kwargs.values():
            kind = type(value)
            if kind is _Tensor:
                key.append(_Tensor)
                tensors.append(value)
            elif kind in _PLAIN_KINDS:
                key.append((kind, value))
            elif not _walk(value, key, tensors):
                return None
    n = len(tensors)
    if n > 1 and (tensors[0] is tensors[1] if n == 2 else len(set(map(id, tensors))) < n):
        # Which arguments are one tensor: Dynamo merges a tensor passed twice into one
        # graph input, so an entry harvested from (x, x) must not serve (x, y), nor the
        # reverse. The key holds that pattern, and the tensors are the distinct ones:
        # ``TensorGuards`` refuses a repeated tensor (``model(input_ids=ids,
        # labels=ids)``, H40), and checking each distinct tensor once checks them all.
        ids = [id(t) for t in tensors]
        pattern = tuple(ids.index(i) for i in ids)
        key.append(pattern)
        tensors = [t for i, t in enumerate(tensors) if pattern[i] == i]
    return tuple(key), tensors


def _walk_sources(value: Any, source: str, into: list[str | None]) -> None:
    """Name each element :func:`_walk` appends for ``value`` by the guard source that
    Dynamo gives it (``L['args'][1]``); None for a structure element."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor) or kind in PLAIN_TYPES:
        into.append(source)
    elif kind is tuple or kind is list:
        into.append(None)
        for i, v in enumerate(value):
            _walk_sources(v, f"{source}[{i}]", into)
    elif kind is dict:
        into.append(None)
        for k, v in value.items():
            _walk_sources(v, f"{source}[{k!r}]", into)
    else:  # a cache: none of its values is one Dynamo's stance checks by its own source
        described: list[Any] = []
        _walk(value, described, [])
        into.extend([None] * len(described))


def key_sources(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str | None]:
    """For each element of :func:`call_key`'s key, the guard source of the argument it
    describes in the trampoline's frame (None for structure): which plain values
    Dynamo's own stance checks (H32)."""
    into: list[str | None] = [None]
    for i, value in enumerate(args):
        _walk_sources(value, f"L['args'][{i}]", into)
    if kwargs:
        into.append(None)
        for name, value in kwargs.items():
            _walk_sources(value, f"L['kwargs'][{name!r}]", into)
    return into


_WILD = object()
"""Stands for a plain value that Dynamo's stance checks itself (see :func:`masked`)."""


def masked(key: tuple[Any, ...], delegated: frozenset[int]) -> tuple[Any, ...]:
    """``key`` with the plain values at ``delegated`` positions replaced by their type."""
    return tuple((e[0], _WILD) if i in delegated else e for i, e in enumerate(key))


def structure(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """``key`` without its plain values: what positions in it mean."""
    return tuple(
        e[0] if type(e) is tuple and len(e) == 2 and e[0] in PLAIN_TYPES else e for e in key
    )


# -- what a frame's guards check about the world outside its arguments ------------------------

_frame_state = eval_frame_state
_frame_callback: Callable[[], Any] = frame_callback
_function_modes: Callable[[], int] = torch_function_modes
top_saved_hooks: Callable[[bool], Any] = _top_saved_hooks
"""The innermost active saved-tensor hooks, ``(pack, unpack)``, or None (one call into C)."""


def inlined_hooks_active() -> bool:
    """Whether active saved-tensor hooks are ones Dynamo traces into the graph (H31).

    Dynamo's guard compares the ids of such hooks (``fx.GraphModule`` pack and
    unpack) and reads any other hooks, or none, as ``None``: those run at run time
    (AOTAutograd's saved tensors go through them), so every entry serves them.
    True on a torch without the functions (the guard is then always kept).
    """
    if not has_saved_hooks_check:
        return True
    hooks = top_saved_hooks(True)
    if hooks is None:
        return False
    inlineable = hooks_inlineable(hooks)
    return True if inlineable is None else inlineable


def outside_state_clear(plain: Any) -> bool:
    """No compile callback, torch-function mode or saved-tensor hooks active (what the
    guards of a frame check about the outside world, beside global state), and torch's
    stance is ``plain``, the one the run started under (not ``force_eager``, not another
    backend, not a stance the user set since): a harvested entry then runs what Dynamo
    would run."""
    return (
        _frame_state[STANCE] is plain
        and _frame_callback() is None
        and not _function_modes()
        and top_saved_hooks(True) is None
    )


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode is active that makes Dynamo skip a frame (H18).

    Mirrors Dynamo's own test in ``convert_frame``; ``False`` on a torch without it.
    """
    if getattr(dynamo_config, "inline_torch_dispatch_torch_compile", False):
        return bool(dispatch_mode_on_stack())
    return bool(any_dispatch_mode())
