"""The engine's decisions as small pure functions: no torch state is read or changed.

Each takes plain values, so each is unit-tested without a Trainer
(``tests/test_decisions.py``): when an audit or verify batch is due, what an audit
found, whether a steady loop's batch stays steady, and what blocks entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

__all__ = [
    "AUDIT_AGAIN",
    "AUDIT_CLEAN",
    "AUDIT_REARM",
    "CHECK_AUDIT",
    "CHECK_VERIFY",
    "TargetView",
    "audit_verdict",
    "blocker",
    "due_check",
    "leave_reason",
    "next_check",
    "steady_batch",
]

CHECK_AUDIT = "audit"
CHECK_VERIFY = "verify"

AUDIT_CLEAN = "clean"
"""An audit batch compiled nothing."""
AUDIT_REARM = "rearm"
"""An audit batch compiled: the stance was running code whose guards no longer held."""
AUDIT_AGAIN = "again"
"""An audit batch with an unseen signature compiled for its new inputs (H26): the loop
stays steady, and the audit's batch with full guards runs again at the next batch whose
signature was seen."""


def next_check(batches: int, audit_every: int | None, verify_every: int | None) -> int:
    """The training batch count at which the next audit or verify batch is due."""
    return min(
        (batches // every + 1) * every
        for every in (audit_every, verify_every, 1 << 62)
        if every is not None
    )


def due_check(batches: int, audit_every: int | None, verify_every: int | None) -> str | None:
    """``"audit"``, ``"verify"`` or None for the training batch numbered ``batches``.

    Counted by training batches, the same on every rank; an audit wins when both are due.
    """
    if batches == 0:
        return None
    if audit_every is not None and batches % audit_every == 0:
        return CHECK_AUDIT
    if verify_every is not None and batches % verify_every == 0:
        return CHECK_VERIFY
    return None


def audit_verdict(compiled: bool, unseen: bool, blocked: str | None = None) -> str:
    """What an audit batch found: a batch run with full guards, scheduled (``audit_every``)
    or in a lookup window.

    Args:
        compiled: a target compiled in the batch.
        unseen: the batch's signature had not been seen (H26).
        blocked: after that compile, why the stance may not be used (:func:`blocker`),
            or None.

    A compile on inputs of a seen signature means the entries the stance ran no longer
    passed their full guards: :data:`AUDIT_REARM`. A batch with an unseen signature
    compiles where no entry accepts its inputs (a padded length that an entry compiled
    for one size refuses; the compile makes the size dynamic), which says nothing about
    the entries the stance ran, so the audit is inconclusive: :data:`AUDIT_AGAIN` (H26).
    A compile that leaves a target unfit for the stance (graph breaks, H4, H20; the
    recompile limit, H5) re-arms as before.
    """
    if not compiled:
        return AUDIT_CLEAN
    if unseen and blocked is None:
        return AUDIT_AGAIN
    return AUDIT_REARM


def leave_reason(
    loop: str, new_signature: str | None, training: bool, warmed_training: bool | None = None
) -> str | None:
    """Why a steady loop must leave the stance before this batch, or None.

    Args:
        loop: the loop's name.
        new_signature: the description of a batch signature not seen with full
            guards, or None.
        training: the module's ``training`` flag now.
        warmed_training: the flag the loop warmed up with; None means the
            Trainer's rule, ``True`` in training and ``False`` elsewhere.
    """
    if new_signature is not None:
        return f"unseen batch signature {new_signature}"
    expected = (loop == "train") if warmed_training is None else warmed_training
    if training is not expected:
        return f"module.training is {training} in the {loop} loop"
    return None


def steady_batch(
    loop: str,
    unseen: str | None,
    training: bool,
    warmed_training: bool | None,
    paired: bool,
) -> tuple[str | None, str | None, bool]:
    """A steady loop's batch: whether it stays steady.

    Args:
        loop: the loop's name.
        unseen: the described signature of a batch not seen with full guards, or None.
        training: the module's ``training`` flag now.
        warmed_training: the flag the loop warmed up with (:func:`leave_reason`).
        paired: guard collectives pair every compiled call across ranks.

    Returns ``(reason, check, probe)``: why the loop leaves the stance (None: it stays);
    the described signature whose calls each check their inputs under the stance (H26);
    and whether the batch probes the signature with full guards (with paired calls a
    check on one rank alone would break the pairing: if the probe compiles nothing, the
    loop's cache serves the signature and the stance resumes).

    >>> steady_batch("train", None, True, None, False)
    (None, None, False)
    >>> steady_batch("train", "(x: 4x8)", True, None, False)
    (None, '(x: 4x8)', False)
    >>> steady_batch("train", "(x: 4x8)", True, None, True)
    ('unseen batch signature (x: 4x8)', None, True)
    >>> steady_batch("train", None, False, None, False)
    ('module.training is False in the train loop', None, False)
    """
    reason = leave_reason(loop, None, training, warmed_training)
    if reason is not None or unseen is None:
        return reason, None, False
    if paired:
        return leave_reason(loop, unseen, training, warmed_training), None, True
    return None, unseen, False


class TargetView(Protocol):
    """What :func:`blocker` reads of a compiled target."""

    name: str
    calls: int
    mixed: bool

    @property
    def graph_breaks(self) -> bool: ...

    def cache_entries(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _Entries:
    name: str
    calls: int
    graph_breaks: bool
    entries: int


def blocker(targets: Sequence[TargetView], root_label: str = "<model>") -> str | None:
    """Why the stance must not be entered now, or None.

    No target has compiled code; a target was called but never compiled (Dynamo
    skipped it, H18); a target has graph breaks in every entry (a miss in a resumed
    frame would come after part of the forward ran, H4). A *mixed* target, with entries
    that run their call as one graph, may enter: calls whose entry breaks run with full
    guards, the others steady. A target at Dynamo's recompile limit may
    enter: a call that no entry accepts runs with full guards, uncompiled, as under
    plain compile (H5).
    """
    views = [
        _Entries(t.name, t.calls, t.graph_breaks and not t.mixed, t.cache_entries())
        for t in targets
    ]
    if views and all(v.entries == 0 for v in views):
        return "no target has compiled code"
    for v in views:
        label = v.name or root_label
        if v.calls and v.entries == 0:
            return f"target {label!r} ran uncompiled: Dynamo skipped its code"
        if v.graph_breaks:
            return (
                f"target {label!r} has graph breaks; under the stance a miss in a resumed "
                "frame would come after part of the forward ran"
            )
    return None
