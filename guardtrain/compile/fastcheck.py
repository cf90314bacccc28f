"""The assertions of one compiled entry, re-checked together, group by group.

:func:`guardtrain.compile.assertions.check` evaluates each :class:`Assertion` on its
own, to name the one that failed. Audits re-check every entry of every target, and
a large model records hundreds of assertions per entry, so the common answer
("everything still holds") is first asked of :class:`EntryChecks`: per group of an
entry's assertions (kept, dropped, dropped on globals), one walk of a tree of their
sources, each object on the way read once (as Dynamo's guard manager shares its
accessors), by ``operator`` getters rather than by evaluating each source. A group
that does not hold, or raises, sends the caller back to the per-assertion check,
which finds and names the change; so this only ever answers "all hold" when every
assertion's :meth:`Assertion.holds` would.
"""

from __future__ import annotations

import contextlib
import operator
import re
from typing import Any, Callable, Iterable

from guardtrain.compile.trampoline import CLOSURE_NAME, SHARED_NAME

__all__ = ["EntryChecks", "entry_checks"]

#: The names a target's scope binds (:meth:`CompiledTarget.scope`).
_SCOPE_NAMES = (CLOSURE_NAME, SHARED_NAME, "G")


class EntryChecks:
    """One entry's assertions, grouped, each group checked by one function of the
    target's scope (``checks.kept(target.scope())``)."""

    __slots__ = ("dropped", "dropped_globals", "dropped_locals", "kept")

    def __init__(self, entry: Iterable[Any]) -> None:
        entry = tuple(entry)
        self.kept = _all_hold([a for a in entry if a.kept])
        """Every kept assertion holds."""
        self.dropped = _all_hold([a for a in entry if not a.kept])
        """Every dropped (or stance-skipped) assertion holds."""
        self.dropped_locals = _all_hold([a for a in entry if not a.kept and not a.glob])
        """Every dropped assertion that is not an identity guard on a global holds."""
        self.dropped_globals = _all_hold([a for a in entry if not a.kept and a.glob])
        """Every dropped identity guard on a global holds (H31)."""


def entry_checks(entry: Any) -> EntryChecks:
    """The :class:`EntryChecks` of a recorded entry, made once and kept on it."""
    found = getattr(entry, "checks", None)
    if found is None:
        found = EntryChecks(entry)
        with contextlib.suppress(AttributeError):  # a plain tuple: made afresh each time
            entry.checks = found
    return found


def _all_hold(assertions: list[Any]) -> Callable[[dict[str, Any]], bool]:
    """A function of the scope (what the sources read) that is True when every assertion holds.

    Each comparison is the one :meth:`Assertion.holds` makes. The sources form a tree
    from the scope's names through attribute and constant-item steps; each object on the
    way is read once, a level of the tree at a time, and each kind of comparison is made
    for all its assertions at once, by C functions (``map``, ``operator``). A source of
    another form is evaluated as it is. An exception anywhere makes the whole function
    False (the caller then checks one by one).
    """
    if not assertions:
        return _true
    plan = _Plan()
    others = tuple(a for a in assertions if not plan.add(a))
    return (
        plan.holds
        if not others
        else lambda scope: plan.holds(scope) and all(a.holds(scope) for a in others)
    )


class _Plan:
    """The objects an entry's assertions read (``roots``, then a level of the tree at a
    time: each object's getter and its parent's index) and, per kind, which objects are
    compared with what."""

    def __init__(self) -> None:
        self.roots: list[str] = []
        self.nodes: dict[tuple[str, ...], tuple[int, int]] = {}
        """A source's steps -> (its object's index among the level's, its level)."""
        self.levels: list[list[tuple[Callable[[Any], Any], tuple[str, ...]]]] = []
        self.compare: dict[str, list[tuple[tuple[str, ...], Any]]] = {}
        self.ready: tuple[Any, ...] | None = None

    def add(self, a: Any) -> bool:
        """Plan ``a``'s comparison; False when its source is not a chain from the scope."""
        steps = _steps(a.name)
        if steps is None or steps[0] not in _SCOPE_NAMES:
            return False
        for depth in range(1, len(steps) + 1):
            self._node(tuple(steps[:depth]))
        self.compare.setdefault(a.kind, []).append((tuple(steps), a.value))
        return True

    def _node(self, path: tuple[str, ...]) -> None:
        if path in self.nodes:
            return
        if len(path) == 1:
            self.roots.append(path[0])
            self.nodes[path] = (len(self.roots) - 1, 0)
            return
        while len(self.levels) < len(path) - 1:
            self.levels.append([])
        level = self.levels[len(path) - 2]
        step = path[-1]
        get = (
            operator.attrgetter(step[1:])
            if step.startswith(".")
            else operator.itemgetter(_key(step[1:-1]))
        )
        level.append((get, path[:-1]))
        self.nodes[path] = (len(level) - 1, len(path) - 1)

    def _freeze(self) -> tuple[Any, ...]:
        """Indices into the flat list of objects: roots, then each level in order."""
        starts = [0, len(self.roots)]
        for level in self.levels:
            starts.append(starts[-1] + len(level))

        def at(path: tuple[str, ...]) -> int:
            index, depth = self.nodes[path]
            return starts[depth] + index

        levels = tuple(
            (tuple(get for get, _ in level), tuple(at(parent) for _, parent in level))
            for level in self.levels
        )
        checks = tuple(
            (kind, tuple(at(p) for p, _ in pairs), tuple(v for _, v in pairs))
            for kind, pairs in self.compare.items()
        )
        checks += tuple(
            ("value type", at, tuple(map(type, values)))
            for kind, at, values in checks
            if kind == "value"
        )
        return tuple(self.roots), levels, checks

    def holds(self, scope: dict[str, Any]) -> bool:
        if self.ready is None:
            self.ready = self._freeze()
        roots, levels, checks = self.ready
        try:
            objs = list(map(scope.__getitem__, roots))
            for getters, parents in levels:
                objs += list(map(_call, getters, map(objs.__getitem__, parents)))
            for kind, at, values in checks[::-1]:  # a value's type before the value
                found = tuple(map(objs.__getitem__, at))
                if kind == "type" or kind == "value type":
                    ok = tuple(map(type, found)) == values
                elif kind == "value":
                    ok = all(map(operator.eq, found, values))  # as `==`, even for NaN
                elif kind == "identity":
                    ok = all(map(operator.is_, found, values))
                elif kind == "length":
                    ok = tuple(map(len, found)) == values
                else:
                    ok = not any(map(len, found))
                if not ok:
                    return False
        except Exception:
            return False
        return True


_call = operator.call


def _key(text: str) -> Any:
    """A constant item's key as written: a quoted string or an integer."""
    return text[1:-1] if text[0] in "'\"" else int(text)


#: The first name of a source, and each step after it: an attribute, a constant item.
_HEAD = re.compile(r"[A-Za-z_]\w*")
_STEP = re.compile(r"\.[A-Za-z_]\w*|\[(?:'[^'\\]*'|\"[^\"\\]*\"|-?\d+)\]")


def _steps(name: str) -> list[str] | None:
    """The head of ``name`` and each step after it (``.attr``, ``['key']``, ``[0]``); None
    when ``name`` is not such a chain."""
    head = _HEAD.match(name)
    if head is None:
        return None
    steps = [head.group()]
    end = head.end()
    while end < len(name):
        step = _STEP.match(name, end)
        if step is None:
            return None
        steps.append(step.group())
        end = step.end()
    return steps


def _true(scope: dict[str, Any]) -> bool:
    return True
