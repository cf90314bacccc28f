"""Compiling targets in place, and undoing it.

Each target module gets a *private* copy of its ``forward`` code object
(``code.replace()``), bound to that one instance, compiled with
``torch.compile`` and installed as the instance attribute ``forward``:

* ``module(x)`` and ``module.forward(x)`` both run the compiled code (H13);
* ``state_dict`` keys do not change (no ``_orig_mod.`` prefix, H8);
* Dynamo keeps one cache per code object, so every instance has a cache of
  its own: ``install_free_tensors`` cannot hand one instance's weights to
  another instance of the same class (H12), also across two ``fit`` calls;
* forgetting the private code (:meth:`CompiledTarget.rebuild`) invalidates
  every entry compiled for the target, resume functions of graph breaks
  included, without touching other compiled code in the process.

``install_free_tensors`` is read by Dynamo while it traces. It is set only
around calls that may trace (outside the stance), so other compiled code in the
process never sees it.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import functools
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import _python_dispatch

from guardtrain import watch as _watch
from guardtrain.errors import GuardTrainRuntimeError, GuardTrainTypeError, GuardTrainValueError
from guardtrain.filters import SAVED_TENSORS_HOOKS, GuardFilter, is_rechecked, keep_all
from guardtrain.guardcheck import check as _guard_check
from guardtrain.watch import DictVersions

__all__ = [
    "COMPILE_KWARGS",
    "Assertion",
    "CompiledTarget",
    "build_compile_kwargs",
    "check_compile_kwargs",
    "TakeOver",
    "is_stance_miss",
    "resolve_targets",
    "take_over_compiled",
]

#: Keys ``compile_kwargs`` accepts; each is passed to ``torch.compile``.
COMPILE_KWARGS = ("backend", "mode", "fullgraph", "dynamic", "options")
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_MISSING = object()
STANCE_MISS_TEXT = "Recompilation triggered with skip_guard_eval_unsafe stance"


def is_stance_miss(err: BaseException) -> bool:
    """Whether ``err`` is Dynamo's error for a cache miss under the unsafe stance (H4)."""
    return isinstance(err, RuntimeError) and STANCE_MISS_TEXT in str(err)


def check_compile_kwargs(compile_kwargs: Any) -> dict[str, Any]:
    """Validate ``compile_kwargs`` and return a copy. Raises with the bad key named."""
    if compile_kwargs is None:
        return {}
    if not isinstance(compile_kwargs, dict) and not hasattr(compile_kwargs, "items"):
        raise GuardTrainTypeError(
            f"`compile_kwargs` must be a dict, got {compile_kwargs!r} "
            f"({type(compile_kwargs).__name__})."
        )
    kwargs = dict(compile_kwargs.items())
    unknown = sorted(set(kwargs) - set(COMPILE_KWARGS))
    if unknown:
        raise GuardTrainValueError(
            f"`compile_kwargs` has unknown key(s) {unknown}; allowed: {list(COMPILE_KWARGS)}."
        )
    backend = kwargs.get("backend", "inductor")
    if not (isinstance(backend, str) or callable(backend)):
        raise GuardTrainTypeError(
            f"`compile_kwargs['backend']` must be a backend name or a callable, got {backend!r}."
        )
    mode = kwargs.get("mode")
    if mode is not None:
        if mode not in _MODES:
            raise GuardTrainValueError(
                f"`compile_kwargs['mode']` must be one of {list(_MODES)}, got {mode!r}."
            )
        if backend != "inductor":
            raise GuardTrainValueError(
                f"`compile_kwargs['mode']={mode!r}` works only with backend='inductor' "
                f"(got backend={backend!r}): guardtrain combines a mode with its guard "
                "filter by expanding the mode into inductor options."
            )
    for key in ("fullgraph",):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise GuardTrainTypeError(
                f"`compile_kwargs['{key}']` must be a bool, got {kwargs[key]!r}."
            )
    if kwargs.get("dynamic") is not None and not isinstance(kwargs["dynamic"], bool):
        raise GuardTrainTypeError(
            f"`compile_kwargs['dynamic']` must be a bool or None, got {kwargs['dynamic']!r}."
        )
    options = kwargs.get("options")
    if options is not None:
        if not hasattr(options, "items"):
            raise GuardTrainTypeError(
                f"`compile_kwargs['options']` must be a dict, got {options!r}."
            )
        kwargs["options"] = dict(options.items())
        if backend != "inductor" and set(kwargs["options"]) - {"guard_filter_fn"}:
            raise GuardTrainValueError(
                f"`compile_kwargs['options']` keys {sorted(kwargs['options'])} are inductor "
                f"options, but backend={backend!r}."
            )
    return kwargs


def build_compile_kwargs(kwargs: dict[str, Any], guard_filter: GuardFilter) -> dict[str, Any]:
    """Arguments for one ``torch.compile`` call: a fresh ``options`` dict every time (H10).

    A ``mode`` is expanded into inductor options so it can travel beside the
    guard filter (``torch.compile`` refuses ``mode`` together with ``options``).
    """
    backend = kwargs.get("backend", "inductor")
    options: dict[str, Any] = {}
    mode = kwargs.get("mode")
    if mode is not None and mode != "default":
        import torch._inductor

        options.update(torch._inductor.list_mode_options(mode, kwargs.get("dynamic")))
    options.update(kwargs.get("options") or {})
    options.pop("guard_filter_fn", None)
    options["guard_filter_fn"] = guard_filter
    return {
        "backend": backend,
        "fullgraph": kwargs.get("fullgraph", False),
        "dynamic": kwargs.get("dynamic"),
        "options": options,
    }


@dataclass(frozen=True, slots=True)
class Assertion:
    """What one guard on a module attribute asserted when it was built."""

    name: str
    """The guard's source expression, e.g. ``self._modules['drop'].p``."""
    kind: str
    """``"value"`` (equal), ``"identity"``, ``"type"`` or ``"empty"`` (no hooks)."""
    value: Any
    kept: bool
    """Whether the guard filter kept the guard (a dropped one needs a recompile)."""
    expr: types.CodeType = field(compare=False)
    label: str = field(default="", compare=False)
    """The same path as the user knows it (``net.drop.p``); see :func:`user_path`."""
    glob: bool = field(default=False, compare=False)
    """An identity guard on a global (``G[...]``) that the filter dropped (H31): it
    holds for every instance alike, so a change rebuilds the code, never moves one
    member of shared code to code of its own."""
    code: str = field(default="", compare=False)
    """Dynamo's own check, from ``GuardFilterEntry.code_parts`` (torch 2.15 on; empty
    before): named in the messages beside the user's path."""

    def holds(self, scope: dict[str, Any]) -> bool:
        """Evaluate the expression now and compare with what was asserted."""
        try:
            current = eval(self.expr, {}, scope)
        except Exception:
            return False
        if self.kind == "value":
            return type(current) is type(self.value) and bool(current == self.value)
        if self.kind == "identity":
            return current is self.value
        if self.kind == "type":
            return type(current) is self.value
        return len(current) == 0

    def describe(self, scope: dict[str, Any], target: str | None = None) -> str:
        """What changed, named for ``target`` (default: the target that compiled it)."""
        try:
            current = eval(self.expr, {}, scope)
        except Exception as err:
            current = f"<{type(err).__name__}>"
        if target is not None and not self.glob:
            name = user_path(self.name, target, self.name.startswith(_SHARED_NAME))
        else:
            name = self.label or self.name
        guard = f" (Dynamo's guard: {self._code(target)})" if self.code else ""
        if self.kind == "value":
            return f"{name}: {self.value!r} -> {current!r}{guard}"
        if self.kind == "empty":
            return f"{name}: hooks added ({len(current)}){guard}"  # type: ignore[arg-type]
        return f"{name}: {self.kind} changed{guard}"

    def _code(self, target: str | None) -> str:
        """Dynamo's check, its sources named as the user knows them (like ``name``)."""
        text = _LOCAL.sub(r"\1", self.code)
        if self.glob:
            return global_path(text)
        return user_path(text, target or "", self.name.startswith(_SHARED_NAME))


_LOCAL = re.compile(r"L\[['\"](\w+)['\"]\]")


def guard_code(entry: Any) -> str:
    """Dynamo's check for a ``GuardFilterEntry`` (its ``code_parts``, torch 2.15 on), or ""."""
    parts = getattr(entry, "code_parts", None) or ()
    return "; ".join(str(p) for p in parts)


_SHARED_PREFIX = re.compile(r"(?<![\w.'\"])module\b(?!['\"])")
_GETATTRIBUTE = re.compile(r"object\.__getattribute__\(([^,()]+), (['\"])(\w+)\2\)")
_SUBSCRIPT = re.compile(r"\.(?:_modules|_parameters|_buffers|__dict__)\[(['\"])([^'\"]+)\1\]")


def user_path(text: str, target: str, shared: bool = False) -> str:
    """Name guard sources by the path the user knows: ``bound.__self__._modules['drop'].p``
    (``module._modules['drop'].p`` in shared code) becomes ``net.drop.p`` for the target
    ``net`` (``self.drop.p`` for the root)."""
    text = text.replace(f"{_CLOSURE_NAME}.__self__", target or "self")
    if shared:
        text = _SHARED_PREFIX.sub(target or "self", text)
    return plain_attributes(_SUBSCRIPT.sub(lambda m: "." + m.group(2), text))


def plain_attributes(text: str) -> str:
    """``object.__getattribute__(x, 'a')`` as ``x.a``: how torch 2.11 and 2.12 write some
    attribute reads in guard sources (a transformers config's ``problem_type``, H25)."""
    if "__getattribute__" not in text:
        return text
    while True:
        plain = _GETATTRIBUTE.sub(r"\1.\3", text)
        if plain == text:
            return text
        text = plain


_IMPORTED = re.compile(r"G\['__import_(\w+)'\]")
_BUILTIN = re.compile(r"G\['__builtins_dict___\d+'\]\['(\w+)'\]")
_GLOBAL = re.compile(r"G\['([\w.]+)'\]")


def global_path(name: str) -> str:
    """Name a global guard source as the user knows it: ``G['__import_torch_dot_nn_dot_
    functional'].relu`` becomes ``torch.nn.functional.relu``, a builtin ``builtins.iter``."""
    text = _IMPORTED.sub(lambda m: m.group(1).replace("_dot_", "."), name)
    text = _BUILTIN.sub(r"builtins.\1", text)
    return _GLOBAL.sub(r"\1", text)


_GLOBALS: dict[str, Any] = globals()
"""The trampolines' globals: where Dynamo installs the ``__import_*`` names its global
guards read (``G`` in a guard's source)."""


def _global_assertions(entry: Any) -> list[Assertion] | None:
    """What a dropped identity guard on a global asserted, to re-check at boundaries
    (H31); None when it cannot be re-checked (the guard must then stay).

    ``CLOSURE_MATCH`` on a Python function asserts its ``__code__``, as Dynamo does;
    ``DUPLICATE_INPUT`` (two globals are one object) asserts the identity of both.
    """
    if not entry.has_value:
        return None
    value = entry.value
    names = [entry.name]
    kind = "identity"
    if entry.guard_type == "TYPE_MATCH":
        kind, value = "type", type(value)
    elif entry.guard_type == "CLOSURE_MATCH" and type(value) is types.FunctionType:
        names, value = [entry.name + ".__code__"], value.__code__
    elif entry.guard_type == "DUPLICATE_INPUT":
        keywords = getattr(getattr(entry.orig_guard, "create_fn", None), "keywords", None) or {}
        other = getattr(keywords.get("source_b"), "name", None)
        other = other() if callable(other) else other
        if not isinstance(other, str) or not other.startswith("G["):
            return None  # aliasing with an input or a local: checked per frame
        names.append(other)
    scope = {"G": _GLOBALS}
    found = []
    for name in names:
        try:
            expr = compile(name, "<guard>", "eval")
        except SyntaxError:
            return None
        a = Assertion(
            name, kind, value, False, expr, global_path(name), glob=True, code=guard_code(entry)
        )
        if not a.holds(scope):  # not what Dynamo guarded (another frame's globals)
            return None
        found.append(a)
    return found


def _kept_global_assertions(entries: Sequence[Any], keep: list[bool]) -> list[Assertion]:
    """What the kept value and identity guards on globals asserted (a global scalar, a
    function). The stance skips them (H33): guardtrain re-checks them when the version
    of a namespace they read moves, and leaves the stance when one fails."""
    found: list[Assertion] = []
    scope = {"G": _GLOBALS}
    for entry, kept in zip(entries, keep):
        if not kept or not entry.is_global or not entry.has_value:
            continue
        if is_rechecked(entry) and entry.guard_type != SAVED_TENSORS_HOOKS:
            # An identity guard kept on a global (a function, a module): as H31 records a
            # dropped one, but kept, so a change leaves the stance and Dynamo recompiles.
            moved = _global_assertions(entry) or []
            found.extend(dataclasses.replace(a, kept=True) for a in moved)
            continue
        kind = _RECORDED.get(entry.guard_type)
        name = entry.name
        if kind is None or kind == "empty" or not name.startswith("G["):
            continue
        value = type(entry.value) if kind == "type" else entry.value
        if kind == "value" and type(value) not in _PLAIN:
            continue
        try:
            expr = compile(name, "<guard>", "eval")
        except SyntaxError:
            continue
        a = Assertion(name, kind, value, True, expr, global_path(name), glob=True)
        if a.holds(scope):
            found.append(a)
    return found


_NAME_PARTS = re.compile(r"\.(\w+)|\[['\"](\w+)['\"]\]")


def _attribute_names(entries: Sequence[Any]) -> set[str]:
    """Every attribute or key name in the guards' sources (``p`` of ``self.drop.p``)."""
    names: set[str] = set()
    for entry in entries:
        for a, b in _NAME_PARTS.findall(entry.name or ""):
            names.add(a or b)
    return names


@functools.cache
def _owner_expr(name: str) -> types.CodeType | None:
    """The expression of the object whose attribute or item ``name`` reads
    (``bound.__self__.cfg`` for ``bound.__self__.cfg.flag``), compiled; None for a bare
    name."""
    if name.endswith("]"):
        depth, i = 0, len(name) - 1
        while i >= 0:
            if name[i] == "]":
                depth += 1
            elif name[i] == "[":
                depth -= 1
                if depth == 0:
                    break
            i -= 1
        head = name[:i]
    else:
        head = name.rpartition(".")[0]
    if not head:
        return None
    try:
        return compile(head, "<guard owner>", "eval")
    except SyntaxError:
        return None


_top_saved_hooks: Callable[[bool], Any] = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None
)
"""The innermost active saved-tensor hooks, ``(pack, unpack)``, or None (0.04-0.09 µs a call)."""


def _inlined_hooks_active() -> bool:
    """Whether active saved-tensor hooks are ones Dynamo traces into the graph (H31).

    Dynamo's guard compares the ids of such hooks (``fx.GraphModule`` pack and
    unpack) and reads any other hooks, or none, as ``None``: those run at run time
    (AOTAutograd's saved tensors go through them), so every entry serves them.
    True on a torch without the functions (the guard is then always kept).
    """
    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        return True
    hooks = _top_saved_hooks(True)
    if hooks is None:
        return False
    inlineable = _hooks_inlineable()
    return True if inlineable is None else bool(inlineable(hooks))


@functools.cache
def _hooks_inlineable() -> Callable[[Any], bool] | None:
    """AOTAutograd's test of inlineable hooks, imported once (None on another torch)."""
    try:
        from torch._functorch._aot_autograd.utils import saved_tensors_hooks_are_inlineable
    except ImportError:  # pragma: no cover - another torch layout
        return None
    return saved_tensors_hooks_are_inlineable  # type: ignore[no-any-return]


_RECORDED = {
    "CONSTANT_MATCH": "value",
    "EQUALS_MATCH": "value",
    "ID_MATCH": "identity",
    "BUILTIN_MATCH": "identity",
    "FUNCTION_MATCH": "identity",
    "TYPE_MATCH": "type",
    "EMPTY_NN_MODULE_HOOKS_DICT": "empty",
}


def _compiling_frame() -> tuple[types.CodeType | None, str | None]:
    """The code object Dynamo is compiling and its recompile reason.

    Read from Dynamo's ``_compile`` frame on the stack (the guard filter is
    called from inside it); ``(None, None)`` if this torch lays it out otherwise.
    """
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            break
        if frame.f_code.co_name == "_compile":
            loc = frame.f_locals
            code = loc.get("code")
            if isinstance(code, types.CodeType):
                reason = loc.get("recompile_reason")
                return code, reason if isinstance(reason, str) else None
        frame = frame.f_back
    return None, None


_CLOSURE_NAME = "bound"
_TRAMPOLINE_NAME = "guardtrain_forward"


def _make_template() -> types.CodeType:
    bound: Callable[..., Any] = print

    def guardtrain_forward(*args: Any, **kwargs: Any) -> Any:
        return bound(*args, **kwargs)

    return guardtrain_forward.__code__


_TEMPLATE = _make_template()


def _make_shared_template() -> types.CodeType:
    forward: Callable[..., Any] = print

    def guardtrain_shared_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(module, *args, **kwargs)

    return guardtrain_shared_forward.__code__


_SHARED_TEMPLATE = _make_shared_template()
_SHARED_TRAMPOLINE_NAME = "guardtrain_shared_forward"


def _trampoline_code() -> types.CodeType:
    """A new code object that calls the closure variable ``bound``.

    Dynamo compiles this frame and inlines the module's ``forward``. Its file
    is guardtrain's, so Dynamo does not wrap it in its shared ``inner`` frame
    (which it does for functions in torch's own files, e.g. ``nn.Sequential``),
    and each copy has a cache of its own.
    """
    return _TEMPLATE.replace()


CompileHook = Callable[["CompiledTarget", str | None], None]
MissHook = Callable[["CompiledTarget", str], bool]
SwitchOffHook = Callable[["CompiledTarget", str], None]
ChangeHook = Callable[["CompiledTarget", str], None]
"""Called with what changed before a call of a target whose state may have changed:
the engine checks the target and rebuilds it or leaves the stance (H33)."""
_INSTALLED = ("forward", "__getstate__")
_FREEVAR_ERROR = "Freevar has no source"
_MISS = "no compiled entry accepted the call"
UNACCEPTED = "no compiled entry's guards accept the call's inputs"
UNSEEN_ARGUMENTS = "the call's plain arguments are new, and no compiled entry accepts them"
_WRITTEN = "a global or an object its guards read was written"
_NOT_RUN = object()
"""What a steady call returns when it left the stance instead of running."""
_SHARED_NAME = "module"


_cache_entry_list: Callable[[types.CodeType], list[Any]] | None = getattr(
    torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None
)
"""Dynamo's cache entries of a code object, newest first (None on a torch without it)."""


# -- direct dispatch (turbo) ------------------------------------------------------------------

_guards = torch._C._dynamo.guards
_eval_frame = torch._dynamo.eval_frame
_frame_callback: Callable[[], Any] = torch._C._dynamo.eval_frame.get_eval_frame_callback
_function_modes: Callable[[], int] = torch._C._len_torch_function_stack
_live_codes: dict[int, Any] | None = getattr(
    getattr(torch._dynamo.utils, "orig_code_map", None), "values", None
)
"""Dynamo's map from each compiled entry's code to its original code, keyed by ``id``.

``torch._dynamo.reset()`` empties it in place, and an entry's code stays alive while
a dispatch holds it, so ``id(code) in _live_codes`` tells whether Dynamo still knows
the entry (H30)."""
DIRECT_LIMIT = 8
"""Dispatches kept per mode (input signatures, e.g. a short last batch)."""
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
_PLAIN_KINDS = frozenset(_PLAIN)
_ONE_TENSOR: tuple[Any, ...] = (1, torch.Tensor)
_Tensor = torch.Tensor


def direct_supported() -> bool:
    """Whether this torch has what direct dispatch needs (else turbo is refused)."""
    return (
        _cache_entry_list is not None
        and _live_codes is not None
        and hasattr(_guards, "TensorGuards")
        and hasattr(_guards, "GlobalStateGuard")
    )


def _walk(value: Any, key: list[Any], tensors: list[torch.Tensor]) -> bool:
    """Describe ``value`` into ``key`` (structure, plain values) and collect its tensors;
    False for anything else (its state could change without a visible difference)."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        key.append(kind)  # the exact class: TensorGuards does not check a subclass
        tensors.append(value)
        return True
    if kind in _PLAIN:
        key.append((kind, value))
        return True
    if kind is tuple or kind is list:
        key.append((kind, len(value)))
        return all(_walk(v, key, tensors) for v in value)
    if kind is dict:
        key.append((kind, tuple(value)))
        return all(_walk(v, key, tensors) for v in value.values())
    return False


def call_key(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
    """A call's structure and plain argument values, and its distinct tensors in order
    (a repeated tensor once, the key saying which arguments are one tensor); None when
    an argument is something else (a module, a custom object): that call is not
    dispatched directly."""
    if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:
        return _ONE_TENSOR, args  # type: ignore[return-value]  # `net(x)`, the common call
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
    if kind is torch.Tensor or isinstance(value, torch.Tensor) or kind in _PLAIN:
        into.append(source)
    elif kind is tuple or kind is list:
        into.append(None)
        for i, v in enumerate(value):
            _walk_sources(v, f"{source}[{i}]", into)
    elif kind is dict:
        into.append(None)
        for k, v in value.items():
            _walk_sources(v, f"{source}[{k!r}]", into)


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
    return tuple(e[0] if type(e) is tuple and len(e) == 2 and e[0] in _PLAIN else e for e in key)


ACCEPT_LIMIT = 64
"""Argument keys remembered per mode as accepted (:meth:`CompiledTarget.admit`); past it
the table starts again (an argument that takes a new value every call, and that
Dynamo's stance does not check itself, is then checked on every call)."""


def outside_state_clear() -> bool:
    """No compile callback, torch-function mode or saved-tensor hooks active (what the
    guards of a frame check about the outside world, beside global state), and the
    stance is the plain unsafe one guardtrain sets (not ``force_eager``, not another
    backend): a harvested entry then runs what Dynamo would run."""
    stance = _eval_frame._stance
    return (
        stance.skip_guard_eval_unsafe
        and stance.stance == "default"
        and stance.backend is None
        and _frame_callback() is None
        and not _function_modes()
        and _top_saved_hooks(True) is None
    )


class Direct:
    """One harvested cache entry of a trampoline, and what a call must match to run it.

    Made from a real call that the entry's own guard manager accepted (every guard
    the filter kept); a later call runs the entry's code directly when its mode is
    the same, Dynamo's global-state guard holds, its arguments have the same
    structure and plain values, and its tensors pass ``TensorGuards`` built from the
    harvested call (dtype, device, ``requires_grad``, dispatch keys, sizes, strides).
    The key also holds which arguments are one tensor (Dynamo guards aliasing
    between inputs). When several entries were compiled for the call's mode, a call
    must also pass the entry's *diff guards*, the guards that tell its entries apart (a module
    attribute, a submodule's ``training`` flag, a global value): what the stance
    itself evaluates.
    """

    __slots__ = ("code", "fn", "global_state", "key", "manager", "tensors")

    def __init__(
        self,
        entry: Any,
        closure: tuple[types.CellType, ...],
        key: tuple[Any, ...],
        tensors: list[torch.Tensor],
        several: bool,
    ) -> None:
        self.code: types.CodeType = entry.code
        self.fn = types.FunctionType(entry.code, globals(), entry.code.co_name, None, closure)
        self.key = key
        # Static sizes and strides (None: every dimension as the tensor has it now).
        self.tensors = _guards.TensorGuards(
            *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None
        )
        self.global_state = _guards.GlobalStateGuard()
        self.manager: Any = entry.guard_manager if several else None
        """The entry's guard manager when other entries may serve a call of the same
        mode: its diff guards pick between them. With one compile per mode the mode
        key and global state already tell the entries apart (their guards check
        grad mode, ``.training`` and autocast), and the diff guards are skipped.
        Entries are added only with the stance off, which empties every dispatch
        table, so a table never outlives a change in their number."""

    def matches(
        self,
        key: tuple[Any, ...],
        tensors: list[torch.Tensor],
        scope: Callable[[], dict[str, Any]],
    ) -> bool:
        assert _live_codes is not None
        if not (
            key == self.key
            and id(self.code) in _live_codes
            and self.global_state.check()
            and self.tensors.check(*tensors)
        ):
            return False
        if self.manager is None:
            return True
        root = self.manager.diff_guard_root  # Dynamo rebuilds it when entries change
        return root is None or _guard_check(root, scope())


class TargetCode:
    """One compiled trampoline and what Dynamo compiled for it.

    A target alone has *private* code: the trampoline calls the instance's bound
    ``forward`` from a closure, and may use ``install_free_tensors`` (H12).
    Targets of one class and one structure (:func:`structure_key`) *share* code
    (H24): the trampoline takes the module as its first argument, so parameters
    are graph inputs and one Dynamo trace serves every instance, as with
    ``block.compile()``; ``install_free_tensors`` is off for it.
    """

    def __init__(
        self,
        func: types.FunctionType,
        compile_kwargs: dict[str, Any],
        guard_filter: GuardFilter | None,
        install_free_tensors: bool,
        shared: bool,
    ) -> None:
        self.func = func
        self.shared = shared
        self.install_free_tensors = install_free_tensors and not shared
        self.drops_guards = guard_filter is not None and guard_filter is not keep_all
        self.members: list[CompiledTarget] = []
        self.current: CompiledTarget | None = None
        """The member whose call is running (the one a compile is reported for)."""
        self.generation = 0
        """Counts compiles and rebuilds: a member re-checks its fit when it moved."""
        self.compiles = 0
        self._kwargs = compile_kwargs
        self._filter = guard_filter or keep_all
        self._shared_codes: set[types.CodeType] = set()
        self.prefix = _SHARED_NAME if shared else _CLOSURE_NAME
        self.key: tuple[Any, ...] | None = None
        """The :func:`structure_key` its members had when they were grouped (shared code)."""
        self.code: types.CodeType
        self.compiled: Callable[..., Any]
        self.assertions: list[tuple[Assertion, ...]] = []
        self.modes: set[Mode] = set()
        self.mode_compiles: dict[Mode, int] = {}
        """Compiles per mode: with more than one, entries of one mode differ by guards
        that the mode key does not cover (a module attribute, a global; H30)."""
        """``(training, grad enabled, inference mode, autocast on)`` of every compile."""
        self.fast_modes: set[Mode] = set()
        """The modes a call may have under the stance: compiled, and, unless a
        ``.training`` guard failed once (the stance evaluates guards that failed,
        H1), the only training value compiled with that grad mode and autocast:
        otherwise the stance picks among entries by global state and shapes and
        cannot tell a training entry from an eval one (a validation call would run
        the training graph)."""
        self.graph_breaks = False
        self.closure: tuple[types.CellType, ...] = ()
        self.keep_hooks_guard = False
        """Keep the saved-tensor-hooks guard in every compile: hooks that Dynamo
        inlines were active at a call or a compile (H31). Survives rebuilds."""
        self.dropped_hooks_guard = False
        """A compile of the current code dropped the saved-tensor-hooks guard."""

    def rebuild(self) -> None:
        """Compile a fresh code object: every entry of the old one is forgotten.

        Code objects other than the trampoline that were compiled for it (the
        module's own ``forward`` and its resume functions after a graph break)
        are shared with other instances of the class; their entries are dropped
        too (``torch._dynamo.reset_code``).
        """
        reset_code = getattr(torch._dynamo, "reset_code", None)
        for code in self._shared_codes:
            if reset_code is not None:
                reset_code(code)
        self._shared_codes = set()
        self.code = (_SHARED_TEMPLATE if self.shared else _TEMPLATE).replace()
        self.assertions = []
        self.modes = set()
        self.mode_compiles = {}
        self.fast_modes = set()
        self._training_failed = False
        self._root_entries = 0
        self.graph_breaks = False
        self.dropped_hooks_guard = False
        self.generation += 1
        for member in self.members:
            member.forget_dispatch()
            member.calls = 0
            member.reference = None
        if not self.drops_guards:
            self._filter = keep_all
        cell = types.CellType(self.func if self.shared else self.members[0]._bound)
        name = _SHARED_TRAMPOLINE_NAME if self.shared else _TRAMPOLINE_NAME
        self.closure = (cell,)
        fn = types.FunctionType(self.code, globals(), name, None, self.closure)
        self.compiled = torch.compile(fn, **build_compile_kwargs(self._kwargs, self._track))

    def _track(self, entries: Sequence[Any]) -> list[bool]:
        keep = [bool(k) for k in self._filter(entries)]
        member = self.current or self.members[0]
        code, reason = _compiling_frame()
        if code is not None and code is not self.code:
            # A graph break: this frame is the module's own `forward` or a resume
            # function of it, code shared with every instance of the class.
            self.graph_breaks = True
            self._shared_codes.add(code)
        elif code is self.code:
            existing = self.cache_entries()
            if 0 <= existing < self._root_entries:
                # Entries we recorded are gone (torch._dynamo.reset()): so is what
                # they asserted, and the modes they were compiled for.
                self.modes.clear()
                self.mode_compiles.clear()
                self.assertions = []
                self._training_failed = False
            self._root_entries = existing + 1
        if reason is not None and ".training" in reason:
            # A failed `.training` guard is one the stance evaluates from now on.
            self._training_failed = True
        mode = _mode(member.module)
        self.modes.add(mode)
        self.mode_compiles[mode] = self.mode_compiles.get(mode, 0) + 1
        self.fast_modes = set(self.modes) if self._training_failed else _unambiguous(self.modes)
        self.compiles += 1
        self.generation += 1
        prefix = self.prefix
        recorded = []
        for entry, kept in zip(entries, keep):
            kind = _RECORDED.get(entry.guard_type)
            name = plain_attributes(entry.name)
            if kind is None or not entry.has_value or not name.startswith(prefix):
                continue
            if len(name) > len(prefix) and name[len(prefix)] not in ".[":
                continue
            value = type(entry.value) if kind == "type" else entry.value
            if kind == "value" and not isinstance(
                value, (bool, int, float, str, type(None), torch.dtype, torch.device)
            ):
                continue
            try:
                expr = compile(name, "<guard>", "eval")
            except SyntaxError:
                continue
            label = user_path(name, member.name, self.shared)
            recorded.append(Assertion(name, kind, value, kept, expr, label, code=guard_code(entry)))
        own_frame = code is not None and code is self.code
        recorded.extend(self._moved(entries, keep, own_frame))
        if own_frame:
            recorded.extend(_kept_global_assertions(entries, keep))
        self.assertions.append(tuple(recorded))
        _watch.read_names.update(_attribute_names(entries))
        for m in self.members:
            # The entries change: what was accepted or harvested may no longer be what
            # the stance picks (a compile can happen under the stance, H32).
            m.forget_dispatch()
            m.versions.reset(m.read_dicts())
        member.fits = self.generation
        member._on_compile(
            member, None if reason is None else user_path(reason, member.name, self.shared)
        )
        return keep

    def _moved(self, entries: Sequence[Any], keep: list[bool], own_frame: bool) -> list[Assertion]:
        """The guards that guardtrain checks itself and the filter dropped (H31).

        Identity guards on globals are recorded for the boundary re-check; one that
        cannot be recorded (a frame other than the trampoline, whose globals are
        another module's, or an expression that does not evaluate to the guarded
        object) is kept. The saved-tensor-hooks guard is kept once hooks that
        Dynamo inlines were seen; otherwise the wrapper checks for hooks per call.
        """
        moved: dict[str, Assertion] = {}
        for i, (entry, kept) in enumerate(zip(entries, keep)):
            if kept or not is_rechecked(entry):
                continue
            if entry.guard_type == SAVED_TENSORS_HOOKS:
                if not self.keep_hooks_guard and _inlined_hooks_active():
                    self.keep_hooks_guard = True
                if self.keep_hooks_guard:
                    keep[i] = True
                else:
                    self.dropped_hooks_guard = True
                continue
            found = _global_assertions(entry) if own_frame else None
            if found is None:
                keep[i] = True  # never drop what cannot be re-checked
                continue
            for a in found:
                moved.setdefault(a.name, a)
        return list(moved.values())

    def cache_entries(self) -> int:
        """Cache entries Dynamo holds for the trampoline (-1 when this torch cannot tell)."""
        if _cache_entry_list is None:
            return -1
        return len(_cache_entry_list(self.code))


_SCALAR_TYPES = (bool, int, float, str, type(None))
_NOT_STRUCTURE = ("training", "forward")  # `forward`: the one guardtrain installs
_IDENTITY_TYPES = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
    type,
)
_VALUE_TYPES = (torch.dtype, torch.device, enum.Enum)


def structure_key(module: nn.Module, func: Any = None) -> tuple[Any, ...]:
    """What two instances must have in common to share compiled code (H24).

    The class and its ``forward``; every submodule's name and class; every parameter's and buffer's name, dtype, device, shape and
    ``requires_grad``; the hooks (by identity); and each submodule's other public
    attributes: a plain tensor's metadata, a function's identity, a dtype's,
    device's or enum's value, any other object's type. A guard filter may drop
    the guards on these, so an instance that differed in one of them would run
    another's graph. Scalar attributes need not match: their guards are kept
    (H19), so a differing value compiles an entry of its own. What an object
    attribute holds is compared per call by :meth:`CompiledTarget._fit`.
    """
    rows: list[Any] = [type(module), func or _forward_function("", module)]
    for name, sub in module.named_modules():
        rows.append((name, type(sub)))
        for key, value in sub.__dict__.items():
            if key.startswith("_") or key in _NOT_STRUCTURE or isinstance(value, _SCALAR_TYPES):
                continue  # a scalar's guard is kept (H19): Dynamo tells values apart
            if isinstance(value, torch.Tensor):  # a plain tensor attribute
                row: Any = (value.dtype, value.device, tuple(value.shape), value.requires_grad)
            elif isinstance(value, _IDENTITY_TYPES):
                row = id(value)
            elif isinstance(value, _VALUE_TYPES):
                row = value
            else:
                row = type(value)
            rows.append((name, key, row))
    for kind, items in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, t in items:
            rows.append((kind, name, t.dtype, t.device, tuple(t.shape), t.requires_grad))
    from guardtrain.monitor import module_fingerprint

    rows.extend(row for row in module_fingerprint(module) if row[0] == "hooks")
    return tuple(rows)


def share_groups(modules: Sequence[nn.Module]) -> list[int | None]:
    """For each module, the index of the first module whose compiled code it shares.

    Modules with equal :func:`structure_key` share one code object when there
    are two or more of them (H24); each of the others gets ``None`` (code of its
    own, with ``install_free_tensors`` where the preset asks for it).
    """
    keys = [structure_key(m) for m in modules]
    first: dict[Any, int] = {}
    counts: dict[Any, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
        counts[key] = counts.get(key, 0) + 1
    return [first[key] if counts[key] > 1 else None for key in keys]


class CompiledTarget:
    """One module whose ``forward`` runs through a compiled trampoline.

    Args:
        name: the module's dotted name in the LightningModule (``""`` for itself).
        module: the module to compile in place.
        compile_kwargs: validated ``compile_kwargs`` (see :func:`check_compile_kwargs`).
        guard_filter: the filter to install (floor already added), or ``None``.
        install_free_tensors: compile this target with ``install_free_tensors``
            (ignored when it shares code).
        on_compile: called after each frame compilation of this target.
        on_miss: called with a reason on a stance miss, or on a call whose
            ``(training, grad, autocast)`` mode was never compiled; it must leave
            the stance. Returns True when the call may be retried with full guards.
        on_switch_off: called with a reason when ``install_free_tensors`` is switched
            off for this target.
        share_with: a target of the same class and structure whose code this one
            shares (see :func:`share_groups`); None: code of its own.
        shared: with ``share_with=None``, make code that later targets may share
            (the module is an argument of the trampoline, no ``install_free_tensors``).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        compile_kwargs: dict[str, Any],
        guard_filter: GuardFilter | None,
        install_free_tensors: bool,
        on_compile: CompileHook,
        on_miss: MissHook,
        on_switch_off: SwitchOffHook | None = None,
        share_with: CompiledTarget | None = None,
        shared: bool = False,
        on_change: ChangeHook | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.requested_free_tensors = install_free_tensors
        self.fast = False
        """True while the unsafe stance is on: calls skip the config patch."""
        self.direct_allowed = False
        """Direct dispatch is wanted for this target (``direct_dispatch``, not refused)."""
        self.direct = False
        """True while calls under the stance may run a harvested entry directly."""
        self.direct_calls = 0
        """Calls that ran a harvested entry directly."""
        self.table: dict[Mode, list[Direct]] = {}
        """Harvested entries per mode (direct dispatch), for this module: with shared
        code another member's kept guards (a scalar attribute) may pick another entry.
        Emptied whenever the stance goes off and on every rebuild."""
        self.harvests = 0
        """Guard-manager evaluations spent harvesting since the table was last emptied."""
        self.checking = False
        """While True (a batch with an unseen signature under the stance), each call
        under the stance first evaluates the cache entries' guards itself (H26)."""
        self.checks = 0
        """Calls checked that way, and accepted."""
        self.retry_eagerly = False
        """Retry a stance miss with the plain ``forward``: with guard collectives the miss
        may be another rank's, and a second compiled call here would issue a collective
        that the other ranks never match."""
        self._on_compile = on_compile
        self._on_miss = on_miss
        self._on_switch_off = on_switch_off
        self._on_change = on_change
        self.changed = False
        """Set by an event (:mod:`guardtrain.watch`): a module in this target was assigned
        to, or gained or lost a hook; the next call checks the target first (H33, H34)."""
        self.change_note: str | None = None
        """What the first event since the last check was."""
        self.versions = DictVersions()
        """Global namespaces and plain objects that this target's guards read, with the
        versions they had at the last compile or check."""
        self.accepted: dict[Mode, set[tuple[Any, ...]]] = {}
        """Argument keys (:func:`call_key`) that the stance's own choice of entry was
        shown to accept, per mode (H32); emptied whenever the entries may change."""
        self.accepted_masked: dict[Mode, set[tuple[Any, ...]]] = {}
        """The same with the plain values that Dynamo's stance checks itself masked
        (:func:`masked`): an int that Dynamo made dynamic (a step counter)."""
        self.delegated: dict[tuple[Any, ...], frozenset[int]] = {}
        """Per key :func:`structure`, the positions of plain values in the entries' diff
        guards, which the stance evaluates on every call."""
        self.last_key: tuple[Any, ...] | None = None
        self.last_mode: Mode | None = None
        self.full_guard_calls = 0
        """Calls under the stance whose arguments no key describes (a module, an object):
        they ran with full guards."""
        self.last_failed: Assertion | None = None
        """The assertion :meth:`check_assertions` last named, if any."""
        self.calls = 0
        """Calls outside the stance since the last rebuild (a called target with no
        compile ran uncompiled: Dynamo skipped its code)."""
        self.reference: Any = None
        """The module's fingerprint when its entries were compiled (set by the caller)."""
        self.fits = 0
        """The code's generation at which this member was last checked against its entries."""
        self.own_code: str | None = None
        """Why this target left the code it shared, if it did."""
        self._previous: dict[str, Any] = {}
        self._func = _forward_function(name, module)
        self._bound = types.MethodType(self._func, module)
        self._plain: Callable[..., Any] | None = None
        self._mismatch: str | None = None
        self.compiled: Callable[..., Any]
        self.c: TargetCode
        if share_with is not None:
            self.c = share_with.c
            self.c.members.append(self)
            self.compiled = self._caller()
        else:
            self._own_code(compile_kwargs, guard_filter, install_free_tensors, shared=shared)
        self._wrapper = self._make_wrapper()
        self.install()

    def _own_code(
        self,
        compile_kwargs: dict[str, Any],
        guard_filter: GuardFilter | None,
        install_free_tensors: bool,
        shared: bool,
    ) -> None:
        self.c = TargetCode(self._func, compile_kwargs, guard_filter, install_free_tensors, shared)
        self.c.members.append(self)
        if shared:
            self.c.key = structure_key(self.module, self._func)
        if self.c.install_free_tensors:
            region = _nested_compile_region(self.module)
            if region is not None:
                self._free_tensors_off(
                    f"it contains a nested compile region ({region}); Dynamo cannot trace "
                    "one with install_free_tensors (H23)"
                )
        self.c.rebuild()
        self.compiled = self._caller()

    def detach(self) -> bool:
        """Stop sharing code with other targets (this target is being replaced).

        Returns False when no other target shares its code."""
        if self in self.c.members and len(self.c.members) > 1:
            self.c.members.remove(self)
            self.c.current = None
            return True
        return False

    def drifted(self) -> bool:
        """Whether this member of shared code no longer has the group's structure."""
        return self.c.key is not None and structure_key(self.module, self._func) != self.c.key

    def _caller(self) -> Callable[..., Any]:
        """What a call of the module runs: the code's compiled trampoline."""
        c = self.c
        if not c.shared:
            return c.compiled
        module = self.module

        def call(*args: Any, **kwargs: Any) -> Any:
            return c.compiled(module, *args, **kwargs)

        return call

    # -- the code's state, as this target sees it -------------------------------------------

    @property
    def shared(self) -> bool:
        return self.c.shared

    @property
    def code(self) -> types.CodeType:
        return self.c.code

    @property
    def compiles(self) -> int:
        return self.c.compiles

    @property
    def graph_breaks(self) -> bool:
        return self.c.graph_breaks

    @graph_breaks.setter
    def graph_breaks(self, value: bool) -> None:
        self.c.graph_breaks = value

    @property
    def assertions(self) -> list[tuple[Assertion, ...]]:
        return self.c.assertions

    @property
    def install_free_tensors(self) -> bool:
        return self.c.install_free_tensors

    @install_free_tensors.setter
    def install_free_tensors(self, value: bool) -> None:
        self.c.install_free_tensors = value

    @property
    def drops_guards(self) -> bool:
        """Whether the installed filter drops guards; turned off (keep all) by the
        engine for a target with graph breaks."""
        return self.c.drops_guards

    @drops_guards.setter
    def drops_guards(self, value: bool) -> None:
        self.c.drops_guards = value

    def _free_tensors_off(self, why: str) -> None:
        self.c.install_free_tensors = False
        if self._on_switch_off is not None:
            self._on_switch_off(self, why)

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        """Install the compiled ``forward`` on the module (again, after :meth:`uninstall`).

        The module also gets an instance ``__getstate__`` that leaves guardtrain's
        attributes out of its state: ``pickle``, ``torch.save`` and ``copy.deepcopy``
        of the module give a plain module that runs its own weights eagerly (H17,
        H29), while this one keeps running compiled. Re-installing keeps the
        compiled code and its Dynamo cache.

        Raises:
            GuardTrainValueError: the module's ``forward`` is no longer the one
                compiled (it was replaced between two runs).
        """
        if self.installed:
            return
        module = self.module
        if _forward_function(self.name, module) is not self._func:
            raise GuardTrainValueError(
                f"Target {self.name or 'the LightningModule'!r} has another `forward` than "
                "the one compiled before."
            )
        self._previous = {key: module.__dict__.get(key, _MISSING) for key in _INSTALLED}
        previous = dict(self._previous)
        class_getstate = type(module).__getstate__

        def __getstate__() -> Any:
            state = class_getstate(module)
            if isinstance(state, dict):
                state = dict(state)
                for key, value in previous.items():
                    if value is _MISSING:
                        state.pop(key, None)
                    else:
                        state[key] = value
            return state

        module.__dict__["forward"] = self._wrapper
        module.__dict__["__getstate__"] = __getstate__
        self.changed = False
        self.change_note = None
        self._watch()

    def _watch(self) -> None:
        """Events of every module in the target mark it (:mod:`guardtrain.watch`)."""
        _watch.watch(self, self.module.modules())

    # -- compiling ---------------------------------------------------------------------------

    def rebuild(self) -> None:
        """Compile a fresh code object: every entry of the old one is forgotten, for
        every target that shares it."""
        self.c.rebuild()
        if self.c.shared:
            for member in self.c.members:
                member.compiled = member._caller()
        else:
            self.compiled = self._caller()

    def leave_shared_code(self, why: str) -> None:
        """Give this target private code of its own (it no longer fits the shared one)."""
        old = self.c
        old.members.remove(self)
        old.current = None
        self.own_code = why
        self._own_code(
            old._kwargs,
            old._filter if old.drops_guards else None,
            self.requested_free_tensors,
            shared=False,
        )

    def _fit(self) -> None:
        """Before a call through shared code that compiled since this target's last
        check: leave it for code of its own if an entry that Dynamo could pick for
        this instance asserted something a dropped guard no longer checks, or if no
        entry's kept assertions hold for it (a scalar or flag that differs between
        instances: each distinct value would add an entry, up to the recompile
        limit, after which the instances would run eagerly) (H24)."""
        c = self.c
        self.fits = c.generation
        if len(c.members) < 2:
            return
        stale, unmatched = self.check_assertions(globals_too=False)
        why = None
        if self.drifted():
            why = "its structure changed (parameters, submodules or attributes)"
        elif stale is not None:
            why = f"{stale}: a dropped guard; the shared code does not fit it"
        elif unmatched is not None and _mode(self.module) in c.modes:
            # Not for a mode no entry was compiled for yet: Dynamo compiles that one.
            why = f"{unmatched}: no shared entry fits it"
        if why is None:
            return
        self.leave_shared_code(why)
        if self.fast:  # under the stance: leave it, the new code has no entry yet
            self._on_miss(self, f"left its class's shared code ({why})")

    def set_fast(self, on: bool) -> None:
        """The stance went on or off: calls under it skip the config patch, and with
        direct dispatch allowed run harvested entries. Off empties the dispatch table
        (it is harvested again, from real calls, when the stance is next on)."""
        self.fast = on
        self.direct = on and self.direct_allowed and self._plain is None and not self.graph_breaks
        if not on:
            self.forget_dispatch()

    def forget_dispatch(self) -> None:
        """Empty the dispatch table and the accepted argument keys: later calls harvest
        and are checked again, from real calls (the entries may have changed)."""
        self.table = {}
        self.harvests = 0
        self.accepted = {}
        self.accepted_masked = {}
        self.delegated = {}
        self.last_key = None
        self.last_mode = None

    # -- arguments under the stance (H32) ---------------------------------------------------

    def admit(
        self, mode: Mode, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        """Whether a call whose argument key differs from the last call's may run under
        the stance: its key (or its key with the values the stance checks itself masked)
        was accepted before, or the entry the stance would pick accepts it with full
        guards now. The stance evaluates only the guards that tell entries apart, so a
        plain argument (an int, a flag, ``None`` for a tensor, a keyword) that no entry
        was compiled against otherwise runs a stale entry."""
        accepted = self.accepted.setdefault(mode, set())
        if key in accepted:
            self.last_key, self.last_mode = key, mode
            return True
        shape = structure(key)
        delegated = self.delegated.get(shape)
        seen_masked = self.accepted_masked.setdefault(mode, set())
        if delegated and masked(key, delegated) in seen_masked:
            self.last_key, self.last_mode = key, mode
            return True
        manager = self._stance_choice(args, kwargs)
        if manager is None:
            return False
        if len(accepted) >= ACCEPT_LIMIT:
            accepted.clear()
            seen_masked.clear()
        accepted.add(key)
        if delegated is None:
            sources = getattr(manager, "diff_guard_sources", None) or ()
            delegated = frozenset(
                i
                for i, source in enumerate(key_sources(args, kwargs))
                if source is not None
                and source in sources
                and i < len(key)
                and type(key[i]) is tuple
            )
            self.delegated[shape] = delegated
        if delegated:
            seen_masked.add(masked(key, delegated))
        self.last_key, self.last_mode = key, mode
        return True

    def _stance_choice(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The guard manager of the entry the stance would run for this call, if its full
        guards accept the call; else None.

        The stance runs the first entry (in cache order) whose *diff* guards pass; when
        that entry's full guards pass too, it is the entry Dynamo would pick with full
        guards (every earlier entry fails a diff guard, which is one of its guards).
        """
        if _cache_entry_list is None:
            return None
        scope = self.call_scope(args, kwargs)
        for entry in _cache_entry_list(self.c.code):
            manager = getattr(entry, "guard_manager", None)
            if manager is None:
                continue
            diff = getattr(manager, "diff_guard_root", None)
            if diff is None or _guard_check(diff, scope):
                return manager if _guard_check(manager, scope) else None
        return None

    def with_full_guards(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one call with Dynamo's full guards although the stance is on (its arguments
        hold something no key describes): the stance is lifted around this call only."""
        self.full_guard_calls += 1
        stance = _eval_frame._stance
        _eval_frame._stance = dataclasses.replace(stance, skip_guard_eval_unsafe=False)
        try:
            return self._guarded(args, kwargs)
        finally:
            _eval_frame._stance = stance

    def call_scope(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The trampoline frame's locals for a call: what its guard managers read."""
        if self.c.shared:
            return {
                _SHARED_NAME: self.module,
                "args": args,
                "kwargs": kwargs,
                "forward": self.c.func,
            }
        return {"args": args, "kwargs": kwargs, _CLOSURE_NAME: self._bound}

    def may_harvest(self, mode: Mode) -> bool:
        """Whether another harvest is allowed: :data:`DIRECT_LIMIT` per mode, four
        times that in all, until the table is next emptied (inputs that change every
        call would otherwise pay a guard evaluation and a table search each)."""
        return len(self.table.get(mode, ())) < DIRECT_LIMIT and self.harvests < 4 * DIRECT_LIMIT

    def harvest(
        self, mode: Mode, key: tuple[Any, ...], tensors: list[torch.Tensor], args: Any, kwargs: Any
    ) -> Direct | None:
        """The cache entry that Dynamo would choose for this call with full guards (the
        first whose guard manager accepts it, in cache order), as a :class:`Direct`
        for calls like it; None when no entry accepts the call."""
        self.harvests += 1
        found = self._accepting_entry(args, kwargs)
        if found is None:
            return None
        entry, entries = found
        c = self.c
        several = entries > 1 and c.mode_compiles.get(mode, 0) != 1
        direct = Direct(entry, c.closure, key, tensors, several=several)
        self.table.setdefault(mode, []).append(direct)
        return direct

    def _accepting_entry(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``(entry, number of entries)`` for the first cache entry of the root code whose
        guard manager accepts a call with these arguments (Dynamo's choice with full
        guards, in cache order), or None."""
        if _cache_entry_list is None:
            return None
        scope = self.call_scope(args, kwargs)
        entries = _cache_entry_list(self.c.code)
        for entry in entries:
            manager = getattr(entry, "guard_manager", None)
            if manager is not None and _guard_check(manager, scope):
                return entry, len(entries)
        return None

    def cache_entries(self) -> int:
        """Cache entries Dynamo holds for the root code (-1 when this torch cannot tell)."""
        return self.c.cache_entries()

    def accepts(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the entry the stance would run accepts a call with these inputs (H26).

        Finds the entry as the stance does (diff guards) and evaluates its guard
        manager, with every guard it kept (the input tensors' sizes, strides and
        dtypes, the shape environment's ranges and 0/1 specialisation, global
        state), on the call's arguments: what Dynamo checks without the stance.
        """
        if self._stance_choice(args, kwargs) is None:
            return False
        self.checks += 1
        return True

    # -- state checks ------------------------------------------------------------------------

    def scope(self) -> dict[str, Any]:
        if self.c.shared:
            return {_SHARED_NAME: self.module, "G": _GLOBALS}
        return {_CLOSURE_NAME: self._bound, "G": _GLOBALS}

    def read_dicts(self) -> list[dict[Any, Any]]:
        """The namespaces and plain objects' ``__dict__`` that hold what this target's
        assertions read (a global, a config object's field); modules are not among
        them (:mod:`guardtrain.watch` tracks those by events)."""
        scope = self.scope()
        found: list[dict[Any, Any]] = []
        for entry in self.c.assertions:
            for a in entry:
                owner = _owner_expr(a.name)
                if owner is None:
                    continue
                try:
                    obj = eval(owner, {}, scope)
                except Exception:
                    continue
                d = _watch.owner_dict(obj)
                # Not the trampolines' globals: only Dynamo writes them (its `__import_*`
                # aliases, at compile time); what users change lives in their modules.
                if d is not None and d is not scope and d is not _GLOBALS:
                    found.append(d)
        return found

    def check_assertions(self, globals_too: bool = True) -> tuple[str | None, str | None]:
        """Re-check what this target's guards asserted.

        Returns ``(stale, unmatched)``: ``stale`` names a *dropped* (or stance-
        skipped) assertion that changed under an entry whose kept guards still
        pass, so Dynamo would silently reuse it: the target must be rebuilt.
        ``unmatched`` is set when no entry's kept guards pass: Dynamo will
        recompile by itself, with full guards. ``globals_too=False`` leaves out the
        dropped identity guards on globals (H31), which hold for every member alike.
        """
        self.last_failed = None
        if not self.assertions:
            return None, None
        scope = self.scope()
        if globals_too:
            # A dropped identity guard on a global holds for every entry alike (H31):
            # checked first, so that a kept assertion failing on the same swap (a value
            # read through the swapped module) cannot hide it.
            for entry in self.assertions:
                for a in entry:
                    if a.glob and not a.kept and not a.holds(scope):
                        self.last_failed = a
                        return a.describe(scope, self.name), None
        any_kept = False
        for entry in self.assertions:
            if not all(a.holds(scope) for a in entry if a.kept):
                continue
            any_kept = True
            for a in entry:
                if not a.kept and (globals_too or not a.glob) and not a.holds(scope):
                    self.last_failed = a
                    return a.describe(scope, self.name), None
        if any_kept:
            return None, None
        # Name what changed for the entry that is closest to matching (the fewest
        # failing assertions; the newest of those): not another mode's `.training`.
        best: list[Assertion] | None = None
        for entry in reversed(self.assertions):
            failing = [a for a in entry if not a.holds(scope)]
            if failing and (best is None or len(failing) < len(best)):
                best = failing
        if best:
            self.last_failed = best[0]
            return None, best[0].describe(scope, self.name)
        return None, "no compiled entry matches the module's state"

    def _saved_hooks_seen(self) -> None:
        """Saved-tensor hooks are active at this call (H31).

        The filter may drop Dynamo's saved-tensor-hooks guard; this per-call check
        replaces it (a once-per-batch check would miss ``save_on_cpu()`` entered
        inside the step). Hooks that Dynamo does not inline (``save_on_cpu``, any
        Python pair) are read by that guard as no hooks, so every entry serves
        them and they run at run time: nothing to do. Hooks that Dynamo inlines
        (``fx.GraphModule`` pack and unpack) need the guard: the code keeps it
        from now on and, when an entry was compiled without it, is rebuilt, so
        this call compiles with the guard (after leaving the stance).
        """
        c = self.c
        if c.keep_hooks_guard and not c.dropped_hooks_guard:
            return  # every entry has the guard: Dynamo tells them apart
        if not _inlined_hooks_active():
            return
        c.keep_hooks_guard = True
        if not c.dropped_hooks_guard:
            return
        # An entry without the guard would accept a call under these hooks.
        self.rebuild()
        if self.fast:
            self._on_miss(
                self,
                "saved-tensor hooks that Dynamo inlines are active; compiling with their guard",
            )

    # -- installing --------------------------------------------------------------------------

    def check_changed(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], note: str | None = None
    ) -> None:
        """Before a call: something this target reads may have changed (an event, or a
        namespace whose version moved). The engine checks and acts (rebuilds the target or
        leaves the stance); then, still under the stance, the entry the stance would run
        must accept this call with its full guards, or the call leaves the stance: the
        recorded assertions do not say which entry serves the call's grad mode or
        autocast (an eval entry compiled under ``no_grad`` matches a submodule switched to
        ``eval()`` in training). Then the versions and the watched modules start again."""
        note = note or self.change_note or "a watched module changed"
        self.changed = False
        self.change_note = None
        if self._on_change is not None:
            self._on_change(self, note)
        if self.fast and not self.retry_eagerly and self._stance_choice(args, kwargs) is None:
            # In a batch with an unseen signature (H26) that is what the call is new in.
            self._on_miss(self, UNACCEPTED if self.checking else f"{note}; {UNACCEPTED}")
        self.versions.reset()
        if self.installed:
            self._watch()

    def _steady(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call under the stance; :data:`_NOT_RUN` when it left the stance instead (the
        caller then runs it with full guards)."""
        c, module = self.c, self.module
        mode = (module.training, is_grad_enabled(), is_inference(), any_autocast())
        if mode not in c.fast_modes:
            # The stance could pick an entry compiled for another mode.
            self._on_miss(self, _describe_mode(mode, mode in c.modes))
            return _NOT_RUN
        found = call_key(args, kwargs)
        if found is None:
            return self.with_full_guards(args, kwargs)  # no key describes the arguments
        key, tensors = found
        # With guard collectives (retry_eagerly) a check on this rank alone would break
        # the pairing of collectives: Dynamo's shared misses decide there.
        if (
            (key != self.last_key or mode != self.last_mode)
            and not self.retry_eagerly
            and not self.admit(mode, key, args, kwargs)
        ):
            if (self.last_key is not None and key != self.last_key) or any(
                type(e) is tuple for e in key
            ):
                reason = UNSEEN_ARGUMENTS  # plain values, None, keywords or structure
            else:
                # Only tensors: new inputs, as H26's check (an unseen batch) or turbo's
                # harvest would find, else as the stance's own miss would say.
                reason = UNACCEPTED if self.direct or self.checking else _MISS
            self._on_miss(self, reason)
            return _NOT_RUN
        if self.direct and outside_state_clear():
            # Turbo (H30): the entry Dynamo chose for a call like this one, run below
            # Dynamo's entry path once guardtrain's own checks pass.
            direct = self._direct_entry(mode, key, tensors, args, kwargs)
            if direct is not None:
                self.direct_calls += 1
                if self.checking:
                    self.checks += 1
                if c.shared:
                    return direct.fn(module, *args, **kwargs)
                return direct.fn(*args, **kwargs)
            if not self.fast:
                return _NOT_RUN
        if self.checking and not self.accepts(args, kwargs):
            # Unseen inputs (H26): no entry's guards accept them, so the stance would
            # run an entry compiled for other shapes.
            self._on_miss(self, UNACCEPTED)
            return _NOT_RUN
        try:
            return self.compiled(*args, **kwargs)
        except RuntimeError as err:
            if not (is_stance_miss(err) and self._on_miss(self, _MISS)):
                raise
            if self.retry_eagerly:
                return self._bound(*args, **kwargs)
        return _NOT_RUN

    def _direct_entry(
        self,
        mode: Mode,
        key: tuple[Any, ...],
        tensors: list[torch.Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Direct | None:
        """The harvested entry for this call, harvesting one if allowed; None when the
        call takes the stance's path (or left the stance: no entry accepts it)."""
        for direct in self.table.get(mode, ()):
            if direct.matches(key, tensors, lambda: self.call_scope(args, kwargs)):
                return direct
        if not self.may_harvest(mode) or dispatch_mode_active():
            return None
        harvested = self.harvest(mode, key, tensors, args, kwargs)
        if harvested is None:
            # No entry's guards accept the call: the stance would run one compiled for
            # other inputs (H26).
            self._on_miss(self, UNACCEPTED)
        return harvested

    def _guarded(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call with Dynamo's guards (outside the stance): may trace, so
        ``install_free_tensors`` is set around it where this target uses it."""
        if dispatch_mode_active():
            # Dynamo would skip the frame and mark our code skipped for good
            # (ModelSummary's FLOP count, H18): run this call eagerly instead.
            return self._bound(*args, **kwargs)
        self.calls += 1
        c = self.c
        c.current = self
        if not c.install_free_tensors:
            return self.compiled(*args, **kwargs)
        cfg = torch._dynamo.config
        previous = cfg.install_free_tensors
        cfg.install_free_tensors = True
        compiles = self.compiles
        callbacks = _callback_handler()
        only_the_trampoline = self._only_the_trampoline
        if callbacks is not None:
            callbacks.register_start_callback(only_the_trampoline)
        try:
            return self.compiled(*args, **kwargs)
        except AssertionError as err:
            if _FREEVAR_ERROR not in str(err) or self.graph_breaks or self.compiles != compiles:
                raise
            # A nested compile region the static scan did not see (H23). No frame
            # compiled in this call, so the error came from tracing the first
            # frame, before any of the forward ran: compile again without it.
            self._free_tensors_off(
                "Dynamo cannot trace a nested compile region with install_free_tensors "
                f"(H23: {_FREEVAR_ERROR})"
            )
            self.rebuild()
        finally:
            if callbacks is not None:
                callbacks.remove_start_callback(only_the_trampoline)
            cfg.install_free_tensors = previous
        return self.compiled(*args, **kwargs)

    def _only_the_trampoline(self, _: Any) -> None:
        # Only the trampoline's own frame may trace with free tensors: a frame Dynamo
        # compiles after a graph break in the same call is code that other instances
        # share (the class's `forward` or its resume functions, H12).
        torch._dynamo.config.install_free_tensors = _compiling_frame()[0] is self.c.code

    def _make_wrapper(self) -> Callable[..., Any]:
        target = self

        @functools.wraps(self._func)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if target.fits != target.c.generation:
                target._fit()  # the code compiled since: does it still fit this instance?
            if _top_saved_hooks(True) is not None:
                target._saved_hooks_seen()  # saved-tensor hooks at this call (H31)
            if target.changed:
                target.check_changed(args, kwargs)  # an event: a module changed (H33, H34)
            if target.fast:
                if target.versions.moved():
                    target.check_changed(args, kwargs, _WRITTEN)
                if target.fast:
                    out = target._steady(args, kwargs)
                    if out is not _NOT_RUN:
                        return out
            elif target.c.drops_guards and target.versions.moved():
                target.check_changed(args, kwargs, _WRITTEN)
            return target._guarded(args, kwargs)

        forward.__wrapped__ = self._bound  # type: ignore[attr-defined]
        forward._guardtrain_target = self  # type: ignore[attr-defined]
        return forward

    # -- verification ------------------------------------------------------------------------

    def start_verify(self, rtol: float, atol: float) -> None:
        """Until :meth:`stop_verify`, run the eager ``forward`` beside each compiled call.

        The eager call sees the same RNG state and copies of the buffers as the
        compiled one saw them, under ``no_grad``; the module's own buffers and the
        RNG end as the compiled call left them. Cost per verified call: one eager
        forward plus one copy of the module's buffers.
        """
        self._mismatch = None
        plain = self.compiled
        module, bound = self.module, self._bound

        def verifying(*args: Any, **kwargs: Any) -> Any:
            slots = [
                (owner._buffers, name, b)
                for owner in module.modules()
                for name, b in owner._buffers.items()
                if b is not None
            ]
            before = [b.detach().clone() for _, _, b in slots]
            rng = _rng_state()
            out = plain(*args, **kwargs)
            rng_after = _rng_state()
            # The eager call runs on copies of the buffers as they were before the
            # compiled call: the originals (saved for backward) are not touched.
            try:
                for (buffers, name, _), copy in zip(slots, before):
                    buffers[name] = copy
                _set_rng_state(rng)
                with torch.no_grad():
                    ref = bound(*args, **kwargs)
            finally:
                for buffers, name, original in slots:
                    buffers[name] = original
                _set_rng_state(rng_after)
            if self._mismatch is None:
                self._mismatch = _compare(out, ref, rtol, atol)
            return out

        self._plain = plain
        self.compiled = verifying
        self.direct = False  # a verified call takes the path that compares it with eager

    def stop_verify(self) -> str | None:
        """End verification; describe the first mismatch seen, or return None."""
        plain = getattr(self, "_plain", None)
        if plain is None:
            return None
        # The current code's caller: the code may have been rebuilt, or this target
        # may have left shared code, while it verified.
        self.compiled = self._caller()
        self._plain = None
        self.set_fast(self.fast)
        return self._mismatch

    def uninstall(self) -> None:
        """Restore the module's ``forward`` and ``__getstate__`` as they were.

        The compiled code and its Dynamo cache are kept for :meth:`install`.
        """
        for key, value in self._previous.items():
            if value is _MISSING:
                self.module.__dict__.pop(key, None)
            else:
                self.module.__dict__[key] = value
        self._previous = {}
        _watch.unwatch(self)
        self.set_fast(False)


is_grad_enabled = torch.is_grad_enabled
is_inference = torch.is_inference_mode_enabled
any_autocast: Callable[[], bool] = getattr(
    torch._C, "_is_any_autocast_enabled", lambda: torch.is_autocast_enabled()
)
Mode = tuple[bool, bool, bool, bool]
"""``(training, grad enabled, inference mode, autocast on)`` of a call."""


_any_mode_on_stack: Callable[[], bool] = getattr(
    _python_dispatch, "any_torch_dispatch_mode_on_stack", lambda: False
)
_any_mode: Callable[[], bool] = getattr(
    _python_dispatch, "is_in_any_mode_without_ignore_compile_internals", lambda: False
)


def _callback_handler() -> Any:
    """Dynamo's compile callbacks (``torch._dynamo.callback_handler``), or None."""
    return getattr(torch._dynamo, "callback_handler", None)


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode is active that makes Dynamo skip a frame (H18).

    Mirrors Dynamo's own test in ``convert_frame``; ``False`` on a torch without it.
    """
    if getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", False):
        return bool(_any_mode_on_stack())
    return bool(_any_mode())


def _mode(module: nn.Module) -> Mode:
    return (module.training, is_grad_enabled(), is_inference(), any_autocast())


def _describe_mode(mode: Mode, compiled: bool) -> str:
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


def _unambiguous(modes: set[Mode]) -> set[Mode]:
    trainings: dict[tuple[bool, ...], set[bool]] = {}
    for mode in modes:
        trainings.setdefault(mode[1:], set()).add(mode[0])
    return {m for m in modes if len(trainings[m[1:]]) == 1}


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _compare(out: Any, ref: Any, rtol: float, atol: float) -> str | None:
    """Describe the first difference between two outputs (pytrees of tensors), or None."""
    from torch.utils._pytree import tree_flatten

    got, got_spec = tree_flatten(out)
    exp, exp_spec = tree_flatten(ref)
    if got_spec != exp_spec:
        return f"output structure differs: {got_spec} vs {exp_spec}"
    for i, (a, b) in enumerate(zip(got, exp)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                return f"output {i}: {tuple(a.shape)} {a.dtype} vs eager {tuple(b.shape)} {b.dtype}"
            if not torch.allclose(a.detach(), b, rtol=rtol, atol=atol, equal_nan=True):
                diff = (a.detach().double() - b.double()).abs().max().item()
                return f"output {i}: max abs difference {diff:.3g} (rtol={rtol}, atol={atol})"
        elif a != b:
            return f"output {i}: {a!r} vs eager {b!r}"
    return None


def _forward_function(name: str, module: nn.Module) -> types.FunctionType:
    """The plain function behind ``module.forward``, with clear errors."""
    label = repr(name) if name else "the LightningModule"
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        raise GuardTrainValueError(
            f"Target {label} is already compiled (torch.compile returned an OptimizedModule). "
            "Pass the plain module: GuardTuneCallback compiles it."
        )
    attr = module.__dict__.get("forward", _MISSING)
    if attr is not _MISSING:
        if getattr(attr, "_guardtrain_target", None) is not None:
            raise GuardTrainRuntimeError(
                f"Target {label} is compiled by another GuardTuneCallback already."
            )
        if hasattr(attr, "_torchdynamo_orig_callable") or hasattr(attr, "_compiled_call_impl"):
            raise GuardTrainValueError(
                f"Target {label} has a compiled `forward` already. Remove your torch.compile "
                "call: GuardTuneCallback compiles it."
            )
        func = getattr(attr, "__func__", None)
        if getattr(attr, "__self__", None) is module and isinstance(func, types.FunctionType):
            return func
        raise GuardTrainTypeError(
            f"Target {label} has an instance attribute `forward` of type "
            f"{type(attr).__name__}; guardtrain compiles plain methods only."
        )
    if getattr(module, "_compiled_call_impl", None) is not None:
        raise GuardTrainValueError(
            f"Target {label} was compiled with nn.Module.compile() already. Remove that call: "
            "GuardTuneCallback compiles it."
        )
    func = type(module).forward
    if not isinstance(func, types.FunctionType) or func is nn.Module.forward:
        raise GuardTrainValueError(
            f"Target {label} ({type(module).__name__}) defines no `forward` to compile."
        )
    return func


def resolve_targets(root: nn.Module, targets: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """Resolve target names and glob patterns to ``(name, module)`` pairs.

    ``None`` picks the default: the one direct child that owns parameters when
    there is exactly one (the network the LightningModule delegates to; its
    ``__dict__`` is not written by Lightning on every hook, so recursive dict
    tags keep working, H15), else the LightningModule itself. A pattern
    (``"blocks.*"``) keeps its outermost matches only. ``""`` names the root.
    """
    if targets is None:
        children = [
            _look_through(n, m)
            for n, m in root.named_children()
            if next(m.parameters(), None) is not None
        ]
        if len(children) == 1 and type(children[0][1]).forward is not nn.Module.forward:
            return [children[0]]
        return [("", root)]
    modules = dict(root.named_modules())
    aliases = dict(root.named_modules(remove_duplicate=False))  # a module under two names
    chosen: dict[str, nn.Module] = {}
    for pattern in targets:
        if any(ch in pattern for ch in "*?["):  # globs see each module once, by its first name
            names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        else:
            names = [pattern] if pattern in aliases else []
        if not names:
            sample = [n for n in modules if n and n.count(".") < 2][:12]
            raise GuardTrainValueError(
                f"`targets` entry {pattern!r} matches no submodule of "
                f"{type(root).__name__}; some names: {sample}."
            )
        for n in names:
            n, m = _look_through(n, aliases[n])
            chosen.setdefault(n, m)
    # Outermost matches only: drop a name whose ancestor is also chosen.
    outer = {
        n: m
        for n, m in chosen.items()
        if not any(n != o and (o == "" or n.startswith(o + ".")) for o in chosen)
    }
    seen: dict[int, str] = {}
    for n, m in outer.items():
        if id(m) in seen:
            raise GuardTrainValueError(
                f"`targets` names the same module twice: {seen[id(m)]!r} and {n!r}."
            )
        seen[id(m)] = n
    return list(outer.items())


def _look_through(name: str, module: nn.Module) -> tuple[str, nn.Module]:
    """``torch.compile(module)`` returns a wrapper: the target is the module inside it."""
    while isinstance(module, OptimizedModule):
        name, module = (f"{name}._orig_mod" if name else "_orig_mod"), module._orig_mod
    return name, module


OptimizedModule = torch._dynamo.eval_frame.OptimizedModule


class TakeOver:
    """Compiles of the user's own inside the targets, switched off while guardtrain runs.

    The lightning-hydra-template's ``compile=true`` does ``self.net =
    torch.compile(self.net)`` in the LightningModule's ``setup``, which Lightning
    runs after the callbacks' ``setup`` (H29). guardtrain compiles the original
    module once itself: each ``OptimizedModule`` wrapping a target (or inside one)
    calls its module plainly, ``nn.Module.compile()`` and a compiled ``forward``
    attribute are set aside. Module structure and ``state_dict`` keys
    (``net._orig_mod.*``) stay as the user's code made them. :meth:`restore` puts
    everything back.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        """What was taken over, e.g. ``"net (torch.compile)"``."""
        self._undo: list[tuple[dict[str, Any], str, Any]] = []

    def _set(self, module: nn.Module, key: str, value: Any) -> None:
        """Set (or, with ``_MISSING``, remove) an instance attribute, remembering the old one."""
        self._undo.append((module.__dict__, key, module.__dict__.get(key, _MISSING)))
        if value is _MISSING:
            module.__dict__.pop(key, None)
        else:
            module.__dict__[key] = value

    def take(self, name: str, module: nn.Module) -> None:
        """Switch off every compile of the user's in ``module`` and below it."""
        for sub_name, sub in module.named_modules(prefix=name):
            label = sub_name or "<LightningModule>"
            if isinstance(sub, OptimizedModule):
                self._set(sub, "forward", sub._orig_mod.__call__)
                self.names.append(f"{label} (torch.compile)")
                continue
            if sub.__dict__.get("_compiled_call_impl") is not None:
                self._set(sub, "_compiled_call_impl", None)
                self.names.append(f"{label} (nn.Module.compile)")
            original = _compiled_forward_source(sub)
            if original is None:
                continue
            if getattr(original, "__func__", None) is type(sub).forward:
                self._set(sub, "forward", _MISSING)  # the class's own forward
            else:
                self._set(sub, "forward", original)
            self.names.append(f"{label} (a compiled forward)")

    def restore(self) -> None:
        for owner, key, value in reversed(self._undo):
            if value is _MISSING:
                owner.pop(key, None)
            else:
                owner[key] = value
        self._undo = []


def _compiled_forward_source(module: nn.Module) -> Any:
    """For ``module.forward = torch.compile(module.forward)``: the bound method inside, or None."""
    original = getattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable", None)
    for _ in range(8):  # torch.compile wraps a bound method in a function: unwrap it
        if original is None or getattr(original, "__self__", None) is module:
            return original
        original = getattr(original, "__wrapped__", None)
    return None


def take_over_compiled(root: nn.Module, targets: Sequence[tuple[str, nn.Module]]) -> TakeOver:
    """Switch off the user's own compiles of ``targets``, of modules inside them, and of the
    ``OptimizedModule`` wrappers around them (see :class:`TakeOver`)."""
    taken = TakeOver()
    modules = dict(root.named_modules(remove_duplicate=False))
    for name, module in targets:
        wrapper = name
        while wrapper.endswith("_orig_mod"):  # the OptimizedModules resolve_targets looked through
            wrapper = wrapper[: -len("_orig_mod")].rstrip(".")
            taken.take(wrapper, modules[wrapper] if wrapper else root)
        if wrapper == name:
            taken.take(name, module)
    return taken


def _nested_compile_region(module: nn.Module) -> str | None:
    """Name a nested compile region in ``module`` (H23), or None.

    Looks at each submodule's ``forward`` and at the globals its code names.
    """
    for name, sub in module.named_modules():
        forward = type(sub).forward
        if hasattr(forward, "__marked_compile_region_fn__"):
            return f"{type(sub).__name__}.forward" + (f" of {name!r}" if name else "")
        code = getattr(forward, "__code__", None)
        scope = getattr(forward, "__globals__", {})
        for global_name in code.co_names if code is not None else ():
            if hasattr(scope.get(global_name), "__marked_compile_region_fn__"):
                return f"{global_name} in {type(sub).__name__}.forward"
    return None
