"""Checks: audits, verify batches, code Dynamo skipped, misses. They find.

Each check reads the targets and returns what it found; the engine acts on it
(re-arms, rebuilds, counts a caught change), as Lightning's
``EarlyStopping`` returns ``(should_stop, reason)`` for its hook to act on. No check
changes a target, a phase or a cache. :class:`Checks` holds what the checks of one run
remember: which check the current batch is, the targets skipped once, and the counts
of unseen batches kept under the stance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from guardtrain.compile import CompiledTarget, Miss, MissReason
from guardtrain.engine import decisions
from guardtrain.engine.changes import Action, Change, Found
from guardtrain.engine.config import GuardConfig

__all__ = ["Checks", "audit_reason", "miss"]


@dataclass(slots=True)
class Checks:
    """What one run's checks remember; a new run starts with a fresh one."""

    next_check: int = 0
    """The training batch count at which the next audit or verify batch is due."""
    audit_batch: bool = False
    """The current training batch is an audit (a compile in it re-arms)."""
    audit_unseen: bool = False
    """The current audit batch's signature had not been seen (H26)."""
    audit_again: bool = False
    """An audit batch with an unseen signature compiled for its new inputs: the next steady
    training batch whose signature was seen runs with full guards as the audit (H26)."""
    verify_batch: bool = False
    """The current training batch is a verify batch (compiled vs eager)."""
    skipped: list[str] = field(default_factory=list)
    """Targets rebuilt once because Dynamo skipped their code (H18)."""
    checking: str | None = None
    """The unseen signature (described) whose batch checks each call's inputs (H26)."""
    checked_batches: int = 0
    """Batches with an unseen signature that stayed under the stance."""
    checked_calls: int = 0
    """Calls in those batches that an entry's guards accepted."""

    def due(self, batches: int, config: GuardConfig) -> str | None:
        """The check due at training batch ``batches`` (``"audit"``, ``"verify"``, None)."""
        self.next_check = decisions.next_check(batches, config.audit_every, config.verify_every)
        return decisions.due_check(batches, config.audit_every, config.verify_every)

    def start_audit(self, unseen: bool) -> None:
        """The current training batch runs with full guards as an audit; ``unseen``: its
        signature had not been seen, so a compile in it may be for its new inputs (H26)."""
        self.audit_batch, self.audit_unseen = True, unseen

    def end_audit(self, verdict: str, batches: int) -> None:
        """Remember what the audit batch ending at training batch ``batches`` found
        (:func:`~guardtrain.engine.decisions.audit_verdict`).

        :data:`~guardtrain.engine.decisions.AUDIT_AGAIN` makes the next batch check
        again (H26): the audit's batch runs at the first steady batch with a seen
        signature. An audit batch with a seen signature ran the audit.
        """
        if verdict == decisions.AUDIT_AGAIN:
            self.audit_again = True
            self.next_check = min(self.next_check, batches + 1)
        elif not self.audit_unseen:
            self.audit_again = False
        self.audit_batch = self.audit_unseen = False

    def skipped_code(self, target: CompiledTarget, label: str) -> Found | None:
        """At a boundary: a called target without entries, whose code Dynamo marked
        skipped (a call under a dispatch mode that guardtrain did not see, H18), is rebuilt
        once (a fresh code object compiles); None otherwise."""
        if target.calls and target.cache_entries() == 0 and label not in self.skipped:
            self.skipped.append(label)
            skipped = "Dynamo skipped its code, it ran uncompiled"
            return Found(Action.REBUILD, Change.SKIPPED, skipped)
        return None


def audit_reason(events: list[dict[str, Any]]) -> str:
    """Why an audit batch that compiled re-arms (the last compile event names the cause)."""
    event = events[-1] if events else {}
    return (
        f"audit batch compiled with full guards ({event.get('reason', 'unknown')}): "
        "the stance was running code whose guards no longer held"
    )


def miss(label: str, miss: Miss, checking: str | None, paired: bool) -> tuple[Change | None, str]:
    """A call of the target named ``label`` missed: the caught change's kind, and the re-arm's reason.

    The kind is None when the miss is no caught change (a stance miss, a call that
    turbo or an input check found no entry for).
    """
    reason = miss.text
    if miss.reason is MissReason.UNSEEN_ARGUMENTS:
        reason = f"{label}: {reason}"
        return Change.ARGUMENTS, reason
    if miss.reason is MissReason.CHANGED or miss.reason is MissReason.WRITTEN:
        # A change seen before the call (H33): the stance's entry does not accept it.
        reason = f"{label}: {reason}"
        reason += ": no compiled entry that the stance would run accepts the call"
        written = miss.reason is MissReason.WRITTEN
        return (Change.GLOBALS if written else Change.MODULE_STATE), reason
    if miss.reason is MissReason.NEW_PATTERN:
        # Frozen or unfrozen into a pattern without entries (H42): counted as the switch.
        return None, f"{label}: {reason}"
    if miss.reason is MissReason.UNACCEPTED and checking is None:
        # Turbo checks every call it would run directly (H30), not only unseen batches.
        reason = f"direct dispatch: no compiled entry of {label!r} accepts a call with full guards"
    elif miss.reason is MissReason.UNACCEPTED:
        reason = (
            f"unseen batch signature {checking}: no compiled entry of {label!r} accepts its inputs"
        )
    else:
        if paired:
            reason += " (here or on another rank: guard collectives share misses)"
        reason = f"stance miss in {label!r}: {reason}"
    return None, reason
