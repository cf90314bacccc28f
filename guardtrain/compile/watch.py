"""Change tracking between compiled calls: events for modules, versions for dictionaries.

Under the stance Dynamo evaluates almost no guard, and guard filters drop the
guards on modules, so a change made between two steps must be seen by
guardtrain before the next call (H33, H34, H35). Polling every module's
dictionaries per call costs in proportion to the number of modules, so module
state is tracked by events, the way ``torch/_dynamo/mutation_guard.py`` does:

* ``nn.Module.__setattr__`` and ``__delattr__`` are wrapped while a target is
  installed: an assignment to a watched module that replaces what it held
  (an attribute, a parameter, a buffer, a submodule, ``training``) marks every
  target that contains the module (:attr:`Watched.changed`);
* registrations through any public method (``register_buffer``, ``register_parameter``,
  ``add_module``, ``load_state_dict(assign=True)``, ``parametrize``, ``prune``) reach
  PyTorch's global registration hooks, which mark the same way (H55); so do
  ``Module._apply`` (``to``, ``half``, ``double``: every conversion) and
  ``torch.utils.swap_tensors``, which write tensors past every hook; a tensor held as a
  plain attribute and replaced outside compiled code is noted on the target
  (``tensor_attribute``), whose check switches ``install_free_tensors`` off for it;
* hooks do not go through ``__setattr__``: the ``register_*_hook`` methods of
  ``nn.Module``, the global ``register_module_*_hook`` functions and
  ``RemovableHandle.remove`` are wrapped the same way;
* ``requires_grad`` is a tensor's, not a module's (H42): ``nn.Parameter`` gets a
  ``requires_grad_`` wrapper and a ``requires_grad`` property over the tensor's own
  descriptor, so ``p.requires_grad_()``, ``Module.requires_grad_()`` and
  ``p.requires_grad = ...`` mark the targets that hold the parameter. Reading
  ``p.requires_grad`` goes through the property (one Python call more); the compiled code
  and autograd read the flag in C, unchanged;
* plain objects, classes, global namespaces and lists that guards read are few and
  fixed per compile: they are polled per call (:mod:`guardtrain.compile.polled`).

A ``requires_grad`` flip, a ``training`` assignment and a plain value assigned over a
plain value (an attribute that guards read) are *flips*: besides marking, the event writes
the new value into the target's :class:`~guardtrain.compile.known_states.Flips` (one byte per
parameter or module, in ``parameters()`` and ``modules()`` order, or the attribute's
value), and a target marked only by flips keeps ``Flips.only``.
Such a target may go back to a state it ran in before without a re-check
(:mod:`guardtrain.compile.known_states`, H46).

A marked target checks itself before its next call; nothing else is done per
call. The wrappers are installed when the first target is watched and removed
when the last one goes, leaving every patched class and function as it was.

What no event sees (docs/design.md, H33, H42): ``object.__setattr__``, writes into a
module's ``__dict__``, ``_parameters``, ``_buffers`` or hook dictionaries directly,
``torch.utils.swap_tensors`` called through a reference taken before the run, hooks registered
through a reference to ``register_module_*_hook`` taken before the run (caught at the
next audit or loop boundary), and ``requires_grad`` set on a parameter that is not an
``nn.Parameter`` (FSDP2's ``DTensor``) or through ``torch.Tensor.requires_grad_(p)``
(caught at the first call of the next batch, :func:`guardtrain.compile.forward.first_call_of_batch`).
"""

from __future__ import annotations

import gc
import types
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn
from torch.utils import hooks as _hooks

from guardtrain._torch import (
    DYNAMO_METHOD_IDS,
    GLOBAL_HOOK_DICTS,
    MODULE_CONVERSION,
    MODULE_HOOK_DICTS,
    MODULE_STORES,
    PARAMETERS,
    DisableTorchFunction,
    module_globals,
    module_store,
    requires_grad_descriptor,
    skip_frame,
    unspecialized_module_variable,
)

__all__ = [
    "Watched",
    "class_dict",
    "module_dicts",
    "owner_dict",
    "patched",
    "unwatch",
    "watch",
    "watched",
]

_is_compiling: Callable[[], bool] = torch.compiler.is_compiling
_module_setattr: Callable[[nn.Module, str, Any], None] = nn.Module.__setattr__
_module_delattr = nn.Module.__delattr__


class Watched(Protocol):
    """What a watched target exposes: a flag, the first change seen since it was cleared,
    and what the flips keep."""

    changed: bool
    change_note: str | None
    dirty: bool
    flips: Any
    """What the flips keep (:class:`~guardtrain.compile.known_states.Flips`)."""
    tensor_attribute: str | None
    """A tensor held as a plain attribute (not a parameter or buffer) of one of its
    modules was replaced outside compiled code since it was cleared: which one."""


# id(module) -> targets that contain it; id(hook dict) -> targets whose module owns it;
# id(parameter) -> targets that hold it.
_modules: dict[int, list[Watched]] = {}
_hook_dicts: dict[int, list[Watched]] = {}
_params: dict[int, list[Watched]] = {}
_targets: dict[int, tuple[Watched, list[int], list[int], list[int]]] = {}
_HOOK_METHODS = (
    "register_forward_pre_hook",
    "register_forward_hook",
    "register_full_backward_pre_hook",
    "register_full_backward_hook",
    "register_backward_hook",
)
_GLOBAL_HOOK_FUNCTIONS = (
    "register_module_forward_pre_hook",
    "register_module_forward_hook",
    "register_module_full_backward_pre_hook",
    "register_module_full_backward_hook",
    "register_module_backward_hook",
)
_MISSING = object()
_PLAIN = (bool, int, float, str, type(None))
_STATEFUL = (torch.Tensor, nn.Module)
read_names: set[str] = set()
"""Attribute names that some watched target's guards read (every guard Dynamo built,
kept or dropped): assigning another attribute of a module (Lightning's
``_current_fx_name``, written on every hook call) marks nothing, unless it holds a
tensor or a module."""


def _mark(targets: Iterable[Watched], note: str, flip: bool = False) -> None:
    for target in targets:
        if not target.changed:
            target.changed = target.dirty = True
            target.change_note = note
            target.flips.only = flip
        elif not flip:
            target.flips.only = False


def _current(module: nn.Module, name: str) -> Any:
    d = module.__dict__
    if name in d:
        return d[name]
    for store in MODULE_STORES:
        members = d.get(store)
        if members is not None and name in members:
            return members[name]
    return _MISSING


def _same(old: Any, new: Any) -> bool:
    """Whether assigning ``new`` over ``old`` changes nothing a guard could read."""
    if old is new:
        return True
    kind = type(old)
    return kind is type(new) and kind in _PLAIN and old == new


def _setattr(self: nn.Module, name: str, value: Any) -> None:
    # Dynamo folds `is_compiling()` to True while it traces an assignment in `forward`:
    # the compiled code then only sees nn.Module's own `__setattr__`.
    if not _is_compiling():
        targets = _modules.get(id(self))
        if targets is not None:
            old = _current(self, name)
            if _same(old, value):
                pass
            elif name == "training" and type(value) is bool and type(old) is bool:
                _module_setattr(self, name, value)
                _trained(self, targets, value)  # a flip: the bits follow the flag
                return
            elif name in read_names and type(old) in _PLAIN and type(value) in _PLAIN:
                _module_setattr(self, name, value)
                _assigned(self, targets, name, value)  # a flip: its value is kept
                return
            elif name in read_names or isinstance(value, _STATEFUL) or isinstance(old, _STATEFUL):
                note = f"{type(self).__name__}.{name} was assigned"
                if _plain_tensor(self, name, old, value):
                    for target in targets:
                        target.tensor_attribute = note
                _mark(targets, note)
    _module_setattr(self, name, value)


def _plain_tensor(module: nn.Module, name: str, old: Any, value: Any) -> bool:
    """Whether assigning ``value`` to ``module.name`` replaces a tensor held as a plain
    attribute (in the module's ``__dict__``, not a parameter or buffer): a forward
    pre-hook that computes a tensor per call (``torch.nn.utils.prune``'s masked weight).
    With ``install_free_tensors`` the compiled graph keeps the tensor it read (H3), and
    no fingerprint lists such a tensor."""
    if isinstance(value, (nn.Parameter, nn.Buffer, nn.Module)):
        return False
    if not isinstance(value, torch.Tensor) and not isinstance(old, torch.Tensor):
        return False
    d = module.__dict__
    return not any(name in d.get(store, ()) for store in MODULE_STORES)


@skip_frame
def _registered(module: nn.Module, name: str, value: Any) -> None:
    """PyTorch's global registration hook for buffers, parameters and submodules
    (``register_buffer``, ``register_parameter``, ``add_module``/``register_module``, and
    ``Module.__setattr__``, which routes tensors and modules through them; H55): a
    registration that replaces what a watched module held marks its targets. Returns
    None: the registered value stays as given."""
    if _is_compiling():
        return None
    targets = _modules.get(id(module))
    if targets is not None and _current(module, name) is not value:
        _mark(targets, f"{type(module).__name__}.{name} was registered anew")
    return None


def _wrap_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Module._apply``, which ``to``, ``half``, ``double``, ``float``, ``cpu``, ``cuda``,
    ``type`` and ``to_empty`` run: it writes ``_parameters``, ``_buffers`` and ``.data``
    directly, or swaps tensors, past every registration hook. Each module it visits
    marks its targets."""

    @skip_frame
    def _apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        targets = _modules.get(id(self))
        if targets is not None and not _is_compiling():
            _mark(targets, f"{type(self).__name__} was converted (Module.to, half, ...)")
        return out

    _apply.__wrapped__ = original  # type: ignore[attr-defined]
    _apply.__doc__ = original.__doc__
    return _apply


def _wrap_swap_tensors(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.utils.swap_tensors``: the two tensors keep their Python objects and trade
    their contents, dtype and shape included; every watched target is marked (a rare
    call; the check compares each parameter's and buffer's dtype, device and shape)."""

    @skip_frame
    def swap_tensors(t1: Any, t2: Any) -> Any:
        out = original(t1, t2)
        if _targets and not _is_compiling():
            _mark([t for t, *_ in _targets.values()], "torch.utils.swap_tensors swapped tensors")
        return out

    swap_tensors.__wrapped__ = original  # type: ignore[attr-defined]
    swap_tensors.__doc__ = original.__doc__
    return swap_tensors


def _assigned(module: nn.Module, targets: list[Watched], name: str, value: Any) -> None:
    """A plain attribute that guards read was assigned another plain value (peft's
    ``_disable_adapters``): a flip, whose value each target keeps."""
    slot, kept = (id(module), name), (type(value), value)
    for target in targets:
        target.flips.attr_values[slot] = kept
    _mark(targets, f"{type(module).__name__}.{name} was assigned", flip=True)


def _trained(module: nn.Module, targets: list[Watched], value: bool) -> None:
    """``module.training`` was set to ``value``: its byte in each target's bits follows;
    targets whose guards read ``training`` are marked (a flip)."""
    key = id(module)
    for target in targets:
        flips = target.flips
        flips.train_bits[flips.module_slots[key]] = value
    if "training" in read_names:
        _mark(targets, f"{type(module).__name__}.training was set to {value}", flip=True)


# The tensor's own descriptor (a C getset; typed as a bool by torch's stubs).
_requires_grad: Any = requires_grad_descriptor
_get_requires_grad: Callable[[torch.Tensor], bool] = _requires_grad.__get__
_set_requires_grad: Callable[[torch.Tensor, bool], None] = _requires_grad.__set__
_tensor_requires_grad_ = torch.Tensor.requires_grad_
_no_torch_function = DisableTorchFunction


_GRAD_NOTES = {v: f"requires_grad of a parameter was set to {v}" for v in (False, True)}


def _flipped(param: torch.Tensor, targets: list[Watched], value: bool) -> None:
    """``param``'s ``requires_grad`` is now ``value``: its targets' bits follow, and each is
    marked (a flip, as :func:`_mark` marks one). Called after the flag was set, so that the
    bits never say what it is not; one pass, as toggling an optimizer sets every flag."""
    key = id(param)
    for target in targets:
        flips = target.flips
        flips.grad_bits[flips.param_slots[key]] = value
        if not target.changed:
            target.changed = target.dirty = True
            target.change_note = _GRAD_NOTES[value]
            flips.only = True


# Both forms: the targets holding the parameter, unless Dynamo traces the call or the
# flag keeps its value; the flag is set first, so that the bits never say what it is not.
def _parameter_requires_grad_(self: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    targets = None if _is_compiling() else _params.get(id(self))
    if targets is None or _get_requires_grad(self) is bool(requires_grad):
        return _tensor_requires_grad_(self, requires_grad)
    out = _tensor_requires_grad_(self, requires_grad)
    _flipped(self, targets, bool(requires_grad))
    return out


def _set_parameter_requires_grad(self: torch.Tensor, value: bool) -> None:
    targets = None if _is_compiling() else _params.get(id(self))
    if targets is None or _get_requires_grad(self) is bool(value):
        _set_requires_grad(self, value)
        return
    _set_requires_grad(self, value)
    _flipped(self, targets, bool(value))


_parameter_requires_grad_.__doc__ = _tensor_requires_grad_.__doc__
_parameter_requires_grad_.__name__ = "requires_grad_"
_PARAMETER_REQUIRES_GRAD = property(
    _get_requires_grad, _set_parameter_requires_grad, doc=_requires_grad.__doc__
)


def _delattr(self: nn.Module, name: str) -> None:
    if not _is_compiling():
        targets = _modules.get(id(self))
        if targets is not None:
            _mark(targets, f"{type(self).__name__}.{name} was deleted")
    _module_delattr(self, name)


def _wrap_hook_method(original: Callable[..., Any]) -> Callable[..., Any]:
    def register(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        handle = original(self, *args, **kwargs)
        targets = _modules.get(id(self))
        if targets is not None:
            _mark(targets, f"a hook was added to {type(self).__name__} ({original.__name__})")
        return handle

    register.__wrapped__ = original  # type: ignore[attr-defined]
    register.__name__ = original.__name__
    register.__doc__ = original.__doc__
    return register


def _wrap_global_hook_function(original: Callable[..., Any]) -> Callable[..., Any]:
    def register(*args: Any, **kwargs: Any) -> Any:
        handle = original(*args, **kwargs)
        _mark(
            [t for t, *_ in _targets.values()],
            f"a global module hook was added ({original.__name__})",
        )
        return handle

    register.__wrapped__ = original  # type: ignore[attr-defined]
    register.__name__ = original.__name__
    register.__doc__ = original.__doc__
    return register


_handle_remove = _hooks.RemovableHandle.remove


def _remove(self: _hooks.RemovableHandle) -> None:
    refs = [self.hooks_dict_ref, *getattr(self, "extra_dict_ref", ())]
    for ref in refs:
        d = ref()
        if d is not None and self.id in d:
            targets = _hook_dicts.get(id(d))
            if targets is None and _is_global_hook_dict(d):
                targets = [t for t, *_ in _targets.values()]
            if targets:
                _mark(targets, "a hook was removed")
    _handle_remove(self)


def _is_global_hook_dict(d: Any) -> bool:
    return any(module_globals.get(name) is d for name in GLOBAL_HOOK_DICTS)


class _Patches:
    """The wrappers in place, and what they replaced (put back by :meth:`remove`)."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any, Any]] = []
        self.handles: list[_hooks.RemovableHandle] = []

    def _set(self, owner: Any, name: str, value: Any, add: bool = False) -> None:
        """Replace ``owner.name`` by ``value`` (``add``: also where the class only
        inherits it; :meth:`remove` then deletes it again)."""
        original = owner.__dict__.get(name, _MISSING)
        if original is _MISSING and not add:
            return
        setattr(owner, name, value)
        self.saved.append((owner, name, original, value))

    def install(self) -> None:
        _prime_dynamo()
        self._set(nn.Module, "__setattr__", _setattr)
        self._set(nn.Module, "__delattr__", _delattr)
        for name in _HOOK_METHODS:
            original = nn.Module.__dict__.get(name)
            if original is not None:
                self._set(nn.Module, name, _wrap_hook_method(original))
        self._set(_hooks.RemovableHandle, "remove", _remove)
        conversion = getattr(nn.Module, MODULE_CONVERSION)
        self._set(nn.Module, MODULE_CONVERSION, _wrap_apply(conversion))
        self._set(torch.utils, "swap_tensors", _wrap_swap_tensors(torch.utils.swap_tensors))
        # nn.Parameter inherits both from the tensor's C type: added, then deleted (H42).
        self._set(nn.Parameter, "requires_grad_", _parameter_requires_grad_, add=True)
        self._set(nn.Parameter, "requires_grad", _PARAMETER_REQUIRES_GRAD, add=True)
        from torch.nn import modules as modules_package
        from torch.nn.modules import module as module_module

        for name in _GLOBAL_HOOK_FUNCTIONS:
            original = getattr(module_module, name, None)
            if original is None:
                continue
            wrapper = _wrap_global_hook_function(original)
            self._set(module_module, name, wrapper)
            if getattr(modules_package, name, None) is original:
                self._set(modules_package, name, wrapper)
            if getattr(nn.modules, name, None) is original and nn.modules is not modules_package:
                self._set(nn.modules, name, wrapper)
        # PyTorch's own registration hooks (public): every registration of a buffer, a
        # parameter or a submodule, through whatever public method (H55).
        self.handles = _registration_handles()

    def remove(self) -> None:
        """Put back what :meth:`install` replaced; a wrapper that someone else wrapped in
        turn stays (as a pass-through, since nothing is watched any more)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for owner, name, original, value in reversed(self.saved):
            if owner.__dict__.get(name) is not value:
                continue
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.saved = []


def _prime_dynamo() -> None:
    """Let Dynamo list ``nn.Module``'s own methods before they are wrapped: it caches the
    list once per process, and a wrapper listed there would be refused when ``forward``
    assigns an attribute (a graph break)."""
    variable = unspecialized_module_variable()
    method_ids = getattr(variable, DYNAMO_METHOD_IDS, None)
    if callable(method_ids):
        method_ids()


_HANDLES: list[_hooks.RemovableHandle] = []
"""The registration hooks' handles of the first install, kept for the process."""


def _registration_handles() -> list[_hooks.RemovableHandle]:
    """Register :func:`_registered` as PyTorch's global buffer, parameter and module
    registration hook, under the keys of the first install in this process: code that
    Dynamo traced through a registration (``Module.__setattr__`` of a submodule) guards
    on the hook's key, and a key new at each run would fail those guards at the next
    run's first call (a rebuild, or a recompile of the user's own compiled code)."""
    from torch.nn.modules import module as module_module

    if not _HANDLES:
        _HANDLES.extend(
            [
                module_module.register_module_buffer_registration_hook(_registered),
                module_module.register_module_parameter_registration_hook(_registered),
                module_module.register_module_module_registration_hook(_registered),
            ]
        )
        return list(_HANDLES)
    for handle in _HANDLES:
        hooks = handle.hooks_dict_ref()
        if hooks is not None:
            hooks[handle.id] = _registered
    return list(_HANDLES)


_patches: _Patches | None = None


def patched() -> bool:
    """Whether the wrappers are in place (some target is watched)."""
    return _patches is not None


def watched() -> list[Watched]:
    """The targets watched now (every installed target)."""
    return [t for t, *_ in _targets.values()]


def watch(target: Watched, modules: Iterable[nn.Module]) -> None:
    """Mark ``target`` whenever one of ``modules`` or one of their parameters changes
    (replacing an earlier watch), and take their flags into its bits."""
    global _patches
    _forget(target)  # the wrappers stay: removing and installing them writes namespaces
    with _no_torch_function():  # the flags as they are, unseen by a torch-function mode
        module_ids, dict_ids, param_ids, trainings, grads = _register(target, modules)
    # The order of `modules()` and `parameters()` (each parameter once, at its first module).
    flips = target.flips
    flips.module_slots = {key: i for i, key in enumerate(module_ids)}
    flips.param_slots = {key: i for i, key in enumerate(param_ids)}
    flips.train_bits = bytearray(trainings)
    flips.grad_bits = bytearray(grads)
    _targets[id(target)] = (target, module_ids, dict_ids, param_ids)
    if _patches is None:
        _patches = _Patches()
        _patches.install()


def _register(
    target: Watched, modules: Iterable[nn.Module]
) -> tuple[list[int], list[int], list[int], list[bool], list[bool]]:
    """Register ``target`` for each of ``modules``, their hook dictionaries and parameters:
    the ids of each, and the modules' ``training`` and the parameters' ``requires_grad``."""
    module_ids: list[int] = []
    dict_ids: list[int] = []
    param_ids: list[int] = []
    trainings: list[bool] = []
    grads: list[bool] = []
    seen: set[int] = set()
    for module in modules:
        key = id(module)
        if key in seen:
            continue
        seen.add(key)
        module_ids.append(key)
        trainings.append(bool(module.__dict__.get("training", True)))
        _modules.setdefault(key, []).append(target)
        for name in MODULE_HOOK_DICTS:
            d = module.__dict__.get(name)
            if isinstance(d, dict):
                dict_ids.append(id(d))
                _hook_dicts.setdefault(id(d), []).append(target)
        for param in module_store(module, PARAMETERS).values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                param_ids.append(id(param))
                grads.append(_get_requires_grad(param))
                _params.setdefault(id(param), []).append(target)
    return module_ids, dict_ids, param_ids, trainings, grads


def unwatch(target: Watched) -> None:
    """Stop watching for ``target``; the last one removes the wrappers."""
    global _patches
    _forget(target)
    if not _targets and _patches is not None:
        _patches.remove()
        _patches = None


def _forget(target: Watched) -> None:
    found = _targets.pop(id(target), None)
    if found is None:
        return
    _, module_ids, dict_ids, param_ids = found
    for table, keys in ((_modules, module_ids), (_hook_dicts, dict_ids), (_params, param_ids)):
        for key in keys:
            targets = table.get(key)
            if targets is None:
                continue
            targets[:] = [t for t in targets if t is not target]
            if not targets:
                del table[key]


def owner_dict(obj: Any) -> dict[Any, Any] | None:
    """The dictionary whose version tells that an attribute of ``obj`` changed: a
    dict itself, or the ``__dict__`` of a Python module or plain object; None for a
    ``nn.Module`` (tracked by events), a class (its namespace is not a dict) and
    objects without one."""
    if isinstance(obj, _NOT_OWNERS):
        return None
    if type(obj) is dict:
        return obj
    d = getattr(obj, "__dict__", None)
    return d if type(d) is dict else None


def module_dicts(root: Any) -> set[int]:
    """The ids of the ``__dict__`` of every module in ``root`` (a module, or a method bound
    to one): writes there come through events, not versions."""
    root = getattr(root, "__self__", root)
    return {id(m.__dict__) for m in root.modules()} if isinstance(root, nn.Module) else set()


def class_dict(cls: type) -> dict[Any, Any] | None:
    """A class's real namespace, the dictionary behind its ``__dict__`` mapping proxy:
    ``Net.GAIN = 2.0`` gives it a new version (None where it cannot be reached)."""
    found = gc.get_referents(cls.__dict__)
    return found[0] if len(found) == 1 and type(found[0]) is dict else None


# Functions and bound methods: ``__dict__`` is the function's own attributes, not what
# guards read through them (``bound.__self__`` is the module).
_NOT_OWNERS = (nn.Module, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType)
