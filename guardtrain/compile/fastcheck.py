"""The assertions of one compiled entry, re-checked by one generated function per group.

:func:`guardtrain.compile.assertions.check` evaluates each :class:`Assertion` on its
own, to name the one that failed. Audits re-check every entry of every target, and
a large model records hundreds of assertions per entry, so the common answer
("everything still holds") is first asked of :class:`EntryChecks`: a function per
group of an entry's assertions (kept, dropped, dropped on globals) that evaluates
them all in one frame, as Dynamo compiles its guards into one function. A group
that does not hold, or raises, sends the caller back to the per-assertion check,
which finds and names the change; so this only ever answers "all hold" when every
assertion's :meth:`Assertion.holds` would.
"""

from __future__ import annotations

import builtins
import contextlib
import re
from typing import Any, Callable, Iterable

from guardtrain.compile.trampoline import CLOSURE_NAME, SHARED_NAME

__all__ = ["EntryChecks", "entry_checks"]

#: The names a target's scope binds (:meth:`CompiledTarget.scope`).
_SCOPE_NAMES = (CLOSURE_NAME, SHARED_NAME, "G")


class EntryChecks:
    """One entry's assertions, grouped, each group checked by one generated function of the
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

    Each term is the comparison :meth:`Assertion.holds` makes. The objects that the
    sources read on the way (``bound.__self__._modules['h']``) are read once each,
    before the terms, as Dynamo's guard manager shares its accessors. An exception
    anywhere makes the whole function False (the caller then checks one by one).
    """
    if not assertions:
        return _true
    namespace: dict[str, Any] = {"__builtins__": builtins}
    reads = _Reads()
    terms = []
    for i, a in enumerate(assertions):
        namespace[f"_v{i}"] = a.value
        expr = f"({reads.source(a.name)})"
        if a.kind == "value":
            namespace[f"_t{i}"] = type(a.value)
            terms.append(f"(type(_c := {expr}) is _t{i} and _c == _v{i})")
        elif a.kind == "identity":
            terms.append(f"{expr} is _v{i}")
        elif a.kind == "type":
            terms.append(f"type({expr}) is _v{i}")
        elif a.kind == "length":
            terms.append(f"len({expr}) == _v{i}")
        else:
            terms.append(f"len({expr}) == 0")
    # The scope's names that the sources read, taken from the scope: a missing one
    # raises (as evaluating the source would), so the whole function is False.
    used = sorted({n for a in assertions for n in a.expr.co_names if n in _SCOPE_NAMES})
    body = "".join(f"        {name} = _scope[{name!r}]\n" for name in used)
    body += "".join(f"        {line}\n" for line in reads.lines)
    source = (
        "def _holds(_scope):\n"
        "    try:\n"
        f"{body}"
        f"        return bool({' and '.join(terms)})\n"
        "    except Exception:\n"
        "        return False\n"
    )
    exec(compile(source, "<guardtrain assertions>", "exec"), namespace)
    return namespace["_holds"]  # type: ignore[no-any-return]


class _Reads:
    """The objects that the sources read on the way, each bound to a local once."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        """A read's source (a prefix of some assertion's source) -> its local."""
        self.lines: list[str] = []
        """The assignments, each after those it reads."""

    def source(self, name: str) -> str:
        """``name`` with the object it reads its last step from replaced by a local.

        A source that is not a name followed by attribute and constant-item steps
        (``a.b['c'][0]``) is left as it is.
        """
        ends = _step_ends(name)
        if ends is None:
            return name
        local = name[: ends[0]]  # the head: one of the scope's names
        for i in range(1, len(ends) - 1):
            prefix = name[: ends[i]]
            found = self.names.get(prefix)
            if found is None:
                found = self.names[prefix] = f"_r{len(self.names)}"
                self.lines.append(f"{found} = {local}{name[ends[i - 1] : ends[i]]}")
            local = found
        return f"{local}{name[ends[-2] :]}" if len(ends) > 1 else name


#: The first name of a source, and each step after it: an attribute, a constant item.
_HEAD = re.compile(r"[A-Za-z_]\w*")
_STEP = re.compile(r"\.[A-Za-z_]\w*|\[(?:'[^'\\]*'|\"[^\"\\]*\"|-?\d+)\]")


def _step_ends(name: str) -> list[int] | None:
    """Where the head and each step of ``name`` end; None when ``name`` is not such a chain."""
    head = _HEAD.match(name)
    if head is None:
        return None
    ends = [head.end()]
    while ends[-1] < len(name):
        step = _STEP.match(name, ends[-1])
        if step is None:
            return None
        ends.append(step.end())
    return ends


def _true(scope: dict[str, Any]) -> bool:
    return True
