"""Handing a target over to full guards: bounded rebuilds (H51) and checks that cost more
than they save (never slower than plain compile).

A change that makes a target's entries stale rebuilds it, and Dynamo then compiles it
afresh: a new code object, so Dynamo's ``recompile_limit`` (8 per frame) never applies.
A model that changes on every step (TRL switching gradient checkpointing, which adds a
hook each time, H47) then compiles on every step for the whole run, where plain compile
stops at the limit and runs that frame without compiling. And the check before a call
after a change the engine has not seen before (a fingerprint walk, the assertions, a
poll reset and a re-watch) can cost more than the guards the stance skips.

Either way the target is *handed over*: for the rest of the run it keeps every guard, no
``install_free_tensors``, never the stance and none of guardtrain's per-call checks: it
runs as ``torch.compile`` runs it, and Dynamo's own limit applies
(:meth:`~guardtrain.compile.CompiledTarget.hand_over`). :class:`Ledger` keeps what the
decisions read; :func:`rebuilds_capped` and :func:`checks_over` decide, on plain values.

>>> rebuilds_capped([2, 4, 6], 6)  # three within the last eight batches
'rebuilt 3 times within the last 8 training batches'
>>> rebuilds_capped([1, 40, 90], 90) is None
True
>>> checks_over({"a": 900.0, "b": 10.0}, saving_us=200.0)
['a']
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHECK_WINDOW",
    "REBUILD_LIMIT",
    "RECENT_BATCHES",
    "RECENT_REBUILDS",
    "Ledger",
    "checks_over",
    "rebuilds_capped",
]

REBUILD_LIMIT = 8
"""Rebuilds of one target in one run after which it is handed over: Dynamo's own
``recompile_limit`` default, so a target never compiles afresh more often than plain
compile would recompile one frame."""
RECENT_BATCHES = 8
RECENT_REBUILDS = 3
"""A target rebuilt this many times within the last :data:`RECENT_BATCHES` training
batches is handed over at once: a change made on every step (or every other step, when
Dynamo's kept guards recompile in between) would otherwise compile on every step until
:data:`REBUILD_LIMIT`."""
CHECK_WINDOW = 32
"""Steady training batches over which the checks' cost is compared with the saving."""


def rebuilds_capped(batches: list[int], batch: int) -> str | None:
    """Why a target rebuilt at the training batches ``batches`` (the last one ``batch``) is
    handed over now, or None."""
    if len(batches) >= REBUILD_LIMIT:
        return f"rebuilt {len(batches)} times in this run"
    recent = sum(1 for b in batches if b > batch - RECENT_BATCHES)
    if recent >= RECENT_REBUILDS:
        return f"rebuilt {recent} times within the last {RECENT_BATCHES} training batches"
    return None


def checks_over(check_us: dict[str, float], saving_us: float) -> list[str]:
    """The targets to hand over so that the checks left cost no more per step than the
    guards the steady state skips (``saving_us`` per step): the costliest first.

    ``check_us`` is each target's time per step in the checks before its calls."""
    total = sum(check_us.values())
    over: list[str] = []
    for name, us in sorted(check_us.items(), key=lambda item: -item[1]):
        if total <= saving_us or us <= 0.0:
            break
        over.append(name)
        total -= us
    return over


@dataclass(slots=True)
class Ledger:
    """One run's record of what the hand-over decisions read."""

    rebuilds: dict[int, list[int]] = field(default_factory=dict)
    """``id(target)`` -> the training batch of each change-driven rebuild."""
    changes: dict[int, Counter[str]] = field(default_factory=dict)
    """``id(target)`` -> what made it rebuild, counted."""
    handed_over: list[dict[str, Any]] = field(default_factory=list)
    """The targets handed over: ``target``, ``why``, ``change`` (the most frequent)."""
    check_ns: dict[int, int] = field(default_factory=dict)
    """``id(target)`` -> its check time at the start of the current window."""
    window_start: int | None = None
    """The training batch at which the current cost window started."""
    compiles: int = 0
    """The run's compiles when the windows started: a compile starts them again."""
    over: set[str] = field(default_factory=set)
    """The targets whose checks cost more than the saving in the last window."""

    def rebuilt(self, target: Any, batch: int, change: str) -> str | None:
        """Record a rebuild of ``target`` at training batch ``batch`` for ``change``; why to
        hand it over instead (:func:`rebuilds_capped`), or None."""
        batches = self.rebuilds.setdefault(id(target), [])
        batches.append(batch)
        self.changes.setdefault(id(target), Counter())[change] += 1
        return rebuilds_capped(batches, batch)

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

    def repeated(self, target: Any) -> str:
        """The change that rebuilt ``target`` most often."""
        counted = self.changes.get(id(target))
        return counted.most_common(1)[0][0] if counted else "a change"
