"""Moved guards: what a compile's guards asserted, recorded, and re-checked by guardtrain.

A guard filter drops guards on module attributes and on globals; the stance skips
the rest. What those guards asserted is recorded per compiled entry
(:class:`Assertion`, from the filter's view of each guard) and re-checked at loop
boundaries, audits and before a call that follows a change (H19, H31, H33).
Messages name each guard by the path the user knows (:func:`user_path`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from guardtrain.compile.call_mode import PLAIN_TYPES
from guardtrain.compile.fastcheck import entry_checks
from guardtrain.compile.trampoline import CLOSURE_NAME, SHARED_NAME, TRAMPOLINE_GLOBALS
from guardtrain.compile.watch import class_dict, module_dicts, owner_dict
from guardtrain.filters import SAVED_TENSORS_HOOKS, is_rechecked

__all__ = [
    "Assertion",
    "Recorded",
    "attribute_names",
    "check",
    "global_assertions",
    "global_path",
    "guard_code",
    "kept_global_assertions",
    "polled_objects",
    "plain_attributes",
    "reads_state_values",
    "recorded_guards",
    "user_path",
]


@dataclass(frozen=True, slots=True)
class Assertion:
    """What one guard on a module attribute asserted when it was built."""

    name: str
    """The guard's source expression, e.g. ``self._modules['drop'].p``."""
    kind: str
    """``"value"`` (equal), ``"identity"``, ``"type"``, ``"length"`` (a list's or tuple's
    length) or ``"empty"`` (no hooks)."""
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
        if self.kind == "length":
            return len(current) == self.value
        return len(current) == 0

    def describe(self, scope: dict[str, Any], target: str | None = None) -> str:
        """What changed, named for ``target`` (default: the target that compiled it)."""
        try:
            current = eval(self.expr, {}, scope)
        except Exception as err:
            current = f"<{type(err).__name__}>"
        if target is not None and not self.glob:
            name = user_path(self.name, target, self.name.startswith(SHARED_NAME))
        else:
            name = self.label or self.name
        guard = f" (Dynamo's guard: {self._code(target)})" if self.code else ""
        if self.kind == "value":
            return f"{name}: {self.value!r} -> {current!r}{guard}"
        if self.kind == "empty":
            return f"{name}: hooks added ({len(current)}){guard}"  # type: ignore[arg-type]
        if self.kind == "length":
            length = len(current) if hasattr(current, "__len__") else current
            return f"{name}: length {self.value} -> {length}{guard}"
        return f"{name}: {self.kind} changed{guard}"

    def _code(self, target: str | None) -> str:
        """Dynamo's check, its sources named as the user knows them (like ``name``)."""
        text = _LOCAL.sub(r"\1", self.code)
        if self.glob:
            return global_path(text)
        return user_path(text, target or "", self.name.startswith(SHARED_NAME))


class Recorded(tuple):  # type: ignore[type-arg]
    """What one compile's guards asserted (a tuple of :class:`Assertion`), with room for
    its grouped checks (:func:`~guardtrain.compile.fastcheck.entry_checks`)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Recorded, (tuple(self),))  # a copy or pickle leaves the checks behind


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
    text = text.replace(f"{CLOSURE_NAME}.__self__", target or "self")
    if shared:
        text = _SHARED_PREFIX.sub(target or "self", text)
    text = _CLASS_ATTRIBUTE.sub(r"type(\g<obj>).\g<name>", text)  # dict(type(self)...)['GAIN']
    return plain_attributes(_SUBSCRIPT.sub(lambda m: "." + m.group(2), text))


_CLASS_ATTRIBUTE = re.compile(
    r"dict\(type\((?P<obj>(?:[^()]|\([^()]*\))+)\)(?:\.__mro__\[(?P<k>\d+)\])?\.__dict__\)"
    r"\[(?P<q>['\"])(?P<name>\w+)(?P=q)\]"
)
"""How Dynamo names a class attribute read through an instance (``self.GAIN`` with
``GAIN`` on the class, or on its ``k``-th base): ``dict(type(self).__dict__)['GAIN']``.
Matched whole for a guard's source, substituted in its user-facing text."""


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


_RECORDED = {
    "CONSTANT_MATCH": "value",
    "EQUALS_MATCH": "value",
    "ID_MATCH": "identity",
    "BUILTIN_MATCH": "identity",
    "FUNCTION_MATCH": "identity",
    "TYPE_MATCH": "type",
    "EMPTY_NN_MODULE_HOOKS_DICT": "empty",
    "SEQUENCE_LENGTH": "length",
    "LIST_LENGTH": "length",
    "TUPLE_LENGTH": "length",
}


def global_assertions(entry: Any) -> list[Assertion] | None:
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
    scope = {"G": TRAMPOLINE_GLOBALS}
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


def kept_global_assertions(entries: Sequence[Any], keep: list[bool]) -> list[Assertion]:
    """What the kept value and identity guards on globals asserted (a global scalar, a
    function). The stance skips them (H33): guardtrain re-checks them when the version
    of a namespace they read moves, and leaves the stance when one fails."""
    found: list[Assertion] = []
    for entry, kept in zip(entries, keep):
        if not kept or not entry.is_global or not entry.has_value:
            continue
        if is_rechecked(entry) and entry.guard_type != SAVED_TENSORS_HOOKS:
            # An identity guard kept on a global (a function, a module): as H31 records a
            # dropped one, but kept, so a change leaves the stance and Dynamo recompiles.
            moved = global_assertions(entry) or []
            found.extend(dataclasses.replace(a, kept=True) for a in moved)
            continue
        a = _kept_global_value(entry)
        if a is not None:
            found.append(a)
    return found


def _kept_global_value(entry: Any) -> Assertion | None:
    """What a kept value, identity or type guard on a global asserted, if it can be
    re-checked (a plain value, an expression that evaluates to what Dynamo guarded)."""
    kind = _RECORDED.get(entry.guard_type)
    name = entry.name
    if kind is None or kind == "empty" or not name.startswith("G["):
        return None
    value = type(entry.value) if kind == "type" else entry.value
    if kind == "value" and type(value) not in PLAIN_TYPES:
        return None
    try:
        expr = compile(name, "<guard>", "eval")
    except SyntaxError:
        return None
    a = Assertion(name, kind, value, True, expr, global_path(name), glob=True)
    return a if a.holds({"G": TRAMPOLINE_GLOBALS}) else None


_NAME_PARTS = re.compile(r"\.(\w+)|\[['\"](\w+)['\"]\]")


def attribute_names(entries: Sequence[Any]) -> set[str]:
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


def recorded_guards(
    entries: Sequence[Any], keep: list[bool], prefix: str, target: str, shared: bool
) -> list[Assertion]:
    """What the value, identity, type, length and hook guards on the module (sources
    starting with ``prefix``, and class attributes read through it) asserted at one
    compile, kept or dropped, named for ``target``."""
    recorded = []
    for entry, kept in zip(entries, keep):
        kind = _RECORDED.get(entry.guard_type)
        name = plain_attributes(entry.name)
        if kind is None or not entry.has_value or not _on_the_module(name, prefix):
            continue
        value = entry.value
        if kind == "type":
            value = type(value)
        elif kind == "length":
            if not hasattr(value, "__len__"):
                continue
            value = len(value)
        if kind == "value" and not isinstance(
            value, (bool, int, float, str, type(None), torch.dtype, torch.device)
        ):
            continue
        try:
            expr = compile(name, "<guard>", "eval")
        except SyntaxError:
            continue
        label = user_path(name, target, shared)
        recorded.append(Assertion(name, kind, value, kept, expr, label, code=guard_code(entry)))
    return recorded


def _on_the_module(name: str, prefix: str) -> bool:
    """Whether a guard source reads from the target's module: ``prefix`` and what
    follows it, or a class attribute read through it (:data:`_CLASS_ATTRIBUTE`)."""
    if name.startswith(prefix):
        return len(name) == len(prefix) or name[len(prefix)] in ".["
    found = _CLASS_ATTRIBUTE.fullmatch(name)
    return found is not None and _on_the_module(found.group("obj"), prefix)


def polled_objects(
    entries: list[tuple[Assertion, ...]], scope: dict[str, Any]
) -> tuple[list[dict[Any, Any]], list[list[Any]]]:
    """What a steady call polls (:class:`~guardtrain.compile.polled.Polled`) for the
    assertions of a target's entries: the namespaces and plain objects' ``__dict__``
    that hold what they read (a global, a config object's field), the real dictionaries
    of the classes a class attribute resolves through, and the lists they read
    (``self.active``, ``self.scales[0]``). Modules are not among them
    (:mod:`guardtrain.compile.watch` tracks those by events)."""
    dicts: list[dict[Any, Any]] = []
    lists: list[list[Any]] = []
    for entry in entries:
        for a in entry:
            found = _CLASS_ATTRIBUTE.fullmatch(a.name)
            if found is not None:
                dicts.extend(_class_dicts(found, scope))
                continue
            if a.kind == "length":
                obj = _evaluate(a.expr, scope)
                if type(obj) is list:
                    lists.append(obj)
            owner = _owner_expr(a.name)
            if owner is None:
                continue
            obj = _evaluate(owner, scope)
            if type(obj) is list:
                lists.append(obj)
                continue
            d = owner_dict(obj)
            # Not the trampolines' globals: only Dynamo writes them (its `__import_*`
            # aliases, at compile time); what users change lives in their modules.
            if d is not None and d is not scope and d is not TRAMPOLINE_GLOBALS:
                dicts.append(d)
    # Nor a module's own `__dict__` (`m.__dict__['_modules']`): events tell its writes (H46).
    modules = module_dicts(scope.get(SHARED_NAME, scope.get(CLOSURE_NAME)))
    return [d for d in dicts if id(d) not in modules], lists


_MISSING = object()


def _evaluate(expr: types.CodeType, scope: dict[str, Any]) -> Any:
    try:
        return eval(expr, {}, scope)
    except Exception:
        return _MISSING


def _class_dicts(found: re.Match[str], scope: dict[str, Any]) -> list[dict[Any, Any]]:
    """The real dictionaries of the classes a class attribute resolves through: the
    object's type and each base up to the one that defines the name (a write to any of
    them can change what the attribute reads)."""
    obj = _evaluate(_compiled(found.group("obj")), scope)
    if obj is _MISSING:
        return []
    mro = type(obj).__mro__
    last = int(found.group("k") or 0)
    return [d for cls in mro[: last + 1] if (d := class_dict(cls)) is not None]


@functools.cache
def _compiled(source: str) -> types.CodeType:
    return compile(source, "<guard owner>", "eval")


def check(
    entries: list[tuple[Assertion, ...]], scope: dict[str, Any], target: str, globals_too: bool
) -> tuple[str | None, str | None, Assertion | None]:
    """Re-check what the guards of each compiled entry asserted.

    Returns ``(stale, unmatched, failed)``: ``stale`` names a *dropped* (or stance-
    skipped) assertion that changed under an entry whose kept guards still pass, so
    Dynamo would silently reuse it: the target must be rebuilt. ``unmatched`` is set
    when no entry's kept guards pass: Dynamo will recompile by itself, with full
    guards. ``failed`` is the assertion named, if any. ``globals_too=False`` leaves out
    the dropped identity guards on globals (H31), which hold for every member alike.
    """
    if not entries or _all_hold(entries, scope, globals_too):
        return None, None, None
    return _one_by_one(entries, scope, target, globals_too)


def _one_by_one(
    entries: list[tuple[Assertion, ...]], scope: dict[str, Any], target: str, globals_too: bool
) -> tuple[str | None, str | None, Assertion | None]:
    """:func:`check`, each assertion on its own: what changed is named."""
    if globals_too:
        # A dropped identity guard on a global holds for every entry alike (H31):
        # checked first, so that a kept assertion failing on the same swap (a value
        # read through the swapped module) cannot hide it.
        failed = _dropped_global_changed(entries, scope)
        if failed is not None:
            return failed.describe(scope, target), None, failed
    any_kept = False
    for entry in entries:
        if not all(a.holds(scope) for a in entry if a.kept):
            continue
        any_kept = True
        for a in entry:
            if not a.kept and (globals_too or not a.glob) and not a.holds(scope):
                return a.describe(scope, target), None, a
    if any_kept:
        return None, None, None
    best = _closest_entry_failures(entries, scope)
    if best:
        return None, best[0].describe(scope, target), best[0]
    return None, "no compiled entry matches the module's state", None


def _all_hold(
    entries: list[tuple[Assertion, ...]], scope: dict[str, Any], globals_too: bool
) -> bool:
    """Whether :func:`check` finds nothing, asked of each entry's grouped checks
    (:mod:`~guardtrain.compile.fastcheck`): some entry's kept assertions hold, and so do
    the dropped ones of each such entry and the dropped ones on globals of every entry.
    False sends :func:`check` to the assertions one by one, to name what changed."""
    any_kept = False
    for entry in entries:
        checks = entry_checks(entry)
        if checks.kept(scope):
            any_kept = True
            dropped = checks.dropped if globals_too else checks.dropped_locals
            if not dropped(scope):
                return False
        elif globals_too and not checks.dropped_globals(scope):
            return False
    return any_kept


def _dropped_global_changed(
    entries: list[tuple[Assertion, ...]], scope: dict[str, Any]
) -> Assertion | None:
    """The first dropped identity guard on a global that no longer holds, if any."""
    for entry in entries:
        for a in entry:
            if a.glob and not a.kept and not a.holds(scope):
                return a
    return None


def _closest_entry_failures(
    entries: list[tuple[Assertion, ...]], scope: dict[str, Any]
) -> list[Assertion] | None:
    """The failing assertions of the entry closest to matching (the fewest failing; the
    newest of those): what to name when no entry matches, not another mode's
    ``.training``."""
    best: list[Assertion] | None = None
    for entry in reversed(entries):
        failing = [a for a in entry if not a.holds(scope)]
        if failing and (best is None or len(failing) < len(best)):
            best = failing
    return best


# -- what a compiled optimizer step's guards read of the per-parameter state (H49) -----------

_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})


def reads_state_values(guards: Sequence[Any]) -> bool:
    """Whether a compiled optimizer step's guards (as its guard filter gets them) read a
    plain value of the per-parameter state (a custom optimizer's Python counter, pinned or
    symbolic): the direct step polls the state's dictionaries, not what they hold, so such
    an entry never runs directly."""
    for guard in guards:
        if ".state[" in guard.name and guard.guard_type in _VALUE_GUARDS:
            return True
        if guard.guard_type == "SHAPE_ENV" and any(
            ".state[" in text for text in getattr(guard.orig_guard, "code_list", None) or ()
        ):
            return True
    return False


# -- the symbolic sizes in Dynamo's tensor checks (H53) -----------------------------------------

_SIZES = re.compile(r"size=\[([^\]]*)\], stride=\[([^\]]*)\]")


def symbolic_sizes(tensor_check: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The dimensions a ``TENSOR_MATCH`` guard's text holds symbolic (printed ``None``):
    ``(sizes, strides)``; None for a text without sizes."""
    found = _SIZES.search(tensor_check)
    if found is None:
        return None
    return _nones(found.group(1)), _nones(found.group(2))


def _nones(items: str) -> tuple[int, ...]:
    """The positions of ``None`` in a printed list of sizes or strides."""
    return tuple(i for i, item in enumerate(items.split(",")) if item.strip() == "None")
