"""Handing a target over to full guards: compiles bounded by construction (H51) and checks
that cost more than they save (never slower than plain compile).

A change that makes a target's entries stale rebuilds it, and Dynamo then compiles those
entries again: a new code object, so Dynamo's ``recompile_limit`` (8 per frame) never
applies. A model that changes on every step (TRL switching gradient checkpointing, which
adds a hook each time, H47) would then compile on every step for the whole run, where
plain compile stops at the limit and runs that frame without compiling. And the check
before a call after a change the engine has not seen before (a fingerprint walk, the
assertions, a poll reset and a re-watch) can cost more than the guards the stance skips.

So each target has a compile margin: its rebuilds may compile again at most
:data:`COMPILE_MARGIN` entries that it had already compiled, the compiles it makes above
what plain compile makes for the same calls. A rebuild that would leave no room in the
margin for a hand-over after it is not made (:func:`rebuild_over`): the target is
confined instead, split into its parts (a
default target, so that only the part that keeps changing is handed over) or *handed
over*: for the rest of the run it keeps every guard, no ``install_free_tensors``, never
the stance and none of guardtrain's per-call checks: it runs as ``torch.compile`` runs it,
and only Dynamo's own guards and limit decide its compiles
(:func:`~guardtrain.compile.hand_over`). :class:`Ledger` keeps what the
decisions read; :func:`rebuild_over` and :func:`checks_over` decide, on plain values.

>>> rebuild_over(rebuilds=0, spent=0, dropping=2) is None  # 2 again, and 2 more to hand over
True
>>> rebuild_over(rebuilds=1, spent=2, dropping=2)
'rebuilt once for changes, compiling 2 entries again; one more rebuild and a hand-over would compile 4 more, past the margin of 4 compiles above plain compile'
>>> checks_over({"a": (32, 12, 0), "b": (1, 12, 0)}, steady_batches=32, guards={"a": 60, "b": 60})
['a']
>>> checks_over({"a": (1, 15, 2235)}, steady_batches=32, guards={"a": 663})  # one check
[]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHECK_WEIGHT",
    "CHECK_WINDOW",
    "COMPILE_MARGIN",
    "Ledger",
    "checks_over",
    "rebuild_over",
]

COMPILE_MARGIN = 4
"""Entries a target's rebuilds may compile again in one run: the most compiles it makes
above what plain compile makes for the same calls. A graph break compiles nothing again
(the frames after a break keep every guard); a change that makes the entries stale does (a
hook added, a parameter replaced, a dropped guard's value moved)."""
CHECK_WINDOW = 32
"""Steady training batches over which the checks' cost is compared with the saving."""
CHECK_WEIGHT = 20
"""How many of Dynamo's guards weigh as much as one fingerprint row of guardtrain's general
check before a call (a parameter, a buffer or a hook list, walked in Python where Dynamo
evaluates its guards in C++). A recorded assertion, evaluated with the others of its entry
in one walk of their sources, weighs as one guard (docs/bench.md, "The checks' weight")."""


def rebuild_over(rebuilds: int, spent: int, dropping: int) -> str | None:
    """Why a target is confined rather than rebuilt once more, or None to rebuild it: its
    ``rebuilds`` so far compiled ``spent`` entries again, and this one would drop
    ``dropping`` entries, each compiled again when its call comes back. A rebuild is made
    only while the margin holds it and a hand-over after it (which drops as many): the
    hand-over's own compiles stay inside the margin too."""
    if spent + 2 * dropping <= COMPILE_MARGIN:
        return None
    past = f"the margin of {COMPILE_MARGIN} compiles above plain compile"
    if rebuilds == 0:
        return f"a rebuild and a hand-over would compile its {dropping} entries twice, past {past}"
    times = "once" if rebuilds == 1 else f"{rebuilds} times"
    return (
        f"rebuilt {times} for changes, compiling {spent} entries again; one more rebuild and "
        f"a hand-over would compile {2 * dropping} more, past {past}"
    )


def checks_over(
    checks: dict[str, tuple[int, int, int]], steady_batches: int, guards: dict[str, int]
) -> list[str]:
    """The targets whose checks before calls in a window outweigh the guards the steady
    state skipped there: ``checks[name]`` is ``(general checks, fingerprint rows each
    walks, assertions each evaluates)``, ``guards[name]`` the guards plain compile
    evaluates for a call of that target (before any filter: the baseline is plain
    compile), and each of the window's ``steady_batches`` skipped them at least once.
    Counts only: the same run gives the same answer on any machine."""
    return [
        name
        for name, (n, rows, assertions) in checks.items()
        if n * (rows * CHECK_WEIGHT + assertions) > steady_batches * guards.get(name, 0)
    ]


@dataclass(slots=True)
class Ledger:
    """One run's record of what the hand-over decisions read, by target label."""

    rebuilds: Counter[str] = field(default_factory=Counter)
    """Each target's change-driven rebuilds."""
    spent: Counter[str] = field(default_factory=Counter)
    """Each target's entries that its rebuilds, splits and hand-over dropped: what
    guardtrain made it compile again (``summary()["compiles"]["again"]``)."""
    changes: dict[str, Counter[Any]] = field(default_factory=dict)
    """Each target's changes that rebuilt it (:class:`~guardtrain.engine.changes.Found`
    records), counted."""
    handed_over: list[dict[str, Any]] = field(default_factory=list)
    """The targets handed over: ``target``, ``why``, ``change`` (the most frequent)."""
    checks: dict[int, int] = field(default_factory=dict)
    """``id(target)`` -> its general checks at the start of the current window."""
    window_start: int | None = None
    """The training batch at which the current cost window started."""
    compiles: int = 0
    """The run's compiles when the windows started: a compile starts them again."""
    over: set[str] = field(default_factory=set)
    """The targets whose checks cost more than the saving in the last window."""

    def rebuilt(self, name: str, change: Any, dropping: int) -> str | None:
        """A change makes target ``name``'s entries stale, and a rebuild would drop
        ``dropping`` of them: why to confine it instead (:func:`rebuild_over`), or None,
        and the rebuild is counted."""
        self.changes.setdefault(name, Counter())[change] += 1
        over = rebuild_over(self.rebuilds[name], self.spent[name], dropping)
        if over is None:
            self.rebuilds[name] += 1
        return over

    def dropped(self, name: str, entries: int) -> None:
        """A rebuild of target ``name`` (for a change, saved-tensor hooks, a hand-over)
        dropped ``entries``: each is compiled again when its call comes back."""
        self.spent[name] += entries

    def restart(self, compiles: int) -> None:
        """The cost windows start again (a compile, or out of the steady state): a check
        in the last one may have been the first of its state, not a recurring one."""
        self.window_start = None
        self.compiles = compiles
        self.over.clear()

    def over_again(self, over: list[str]) -> list[str]:
        """Of the targets whose checks cost more than the saving in the window that just
        ended (``over``), those that did in the window before too: a recurring cost, where
        the first check of a state falls in one window alone."""
        again = [name for name in over if name in self.over]
        self.over = set(over)
        return again

    def repeated(self, name: str) -> Any:
        """The change that rebuilt target ``name`` most often, or None."""
        counted = self.changes.get(name)
        return counted.most_common(1)[0][0] if counted else None
