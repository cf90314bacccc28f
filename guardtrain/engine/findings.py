"""Checks: loop boundaries, changes caught before a call, misses, audits. They find.

Each check reads the targets and returns what it found; the engine acts on it
(re-arms, rebuilds, takes a reference again, counts a caught change), as Lightning's
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
from guardtrain.engine.changes import Action, Change, Found, decide, found_in, stale_found
from guardtrain.engine.config import GuardConfig
from guardtrain.fingerprints import fingerprint_change, module_fingerprint

__all__ = ["Checks", "Finding", "audit_reason", "caught_change", "miss"]


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

    def boundary(
        self, target: CompiledTarget, label: str, swaps_parameters: str | None = None
    ) -> Finding:
        """What the boundary re-check finds in ``target`` (:class:`Finding`).

        ``rebuild`` says why its entries no longer fit (a changed fingerprint, a stale
        dropped guard, code that Dynamo skipped, H18); else ``leave`` says why no
        entry's kept guards hold (a steady loop leaves the stance).

        ``swaps_parameters`` (FSDP): without install_free_tensors a swapped parameter is
        no change, as in :func:`caught_change`. The boundary may see the sharded
        parameters where the reference, taken inside a forward, saw the gathered ones
        (the Trainer's hooks: FSDP2 keeps the root's group gathered until backward), so
        only the hooks are compared (``retake``: take the reference again as it is here).
        """
        if target.calls and target.cache_entries() == 0 and label not in self.skipped:
            # Dynamo marked the code skipped, e.g. after a call under a dispatch
            # mode that guardtrain did not see (H18): a fresh code object compiles.
            self.skipped.append(label)
            skipped = "Dynamo skipped its code, it ran uncompiled"
            return Finding(rebuild=Found(Action.REBUILD, Change.SKIPPED, skipped))
        change, retake = None, False
        if target.reference is not None:
            now = module_fingerprint(target.module)
            change = fingerprint_change(target.reference, now)
            if change is not None and swaps_parameters and not target.code.install_free_tensors:
                change = fingerprint_change(_hook_rows(target.reference), _hook_rows(now))
                retake = change is None
        stale, unmatched = target.check_assertions()
        if change is not None:
            return Finding(rebuild=found_in(change))
        if stale is not None:
            return Finding(rebuild=stale_found(target, stale))
        return Finding(leave=unmatched, retake=retake)


@dataclass(frozen=True, slots=True)
class Finding:
    """What the boundary re-check found in one target; the engine acts on it."""

    rebuild: Found | None = None
    """Why its entries no longer fit: it is rebuilt."""
    leave: str | None = None
    """Why no entry's kept guards hold: a steady loop leaves the stance."""
    retake: bool = False
    """Under FSDP, only swapped parameters moved: the reference is taken again."""


def _hook_rows(fingerprint: tuple[Any, ...]) -> tuple[Any, ...]:
    """The hook rows of a :func:`module_fingerprint` (no parameter or buffer rows)."""
    return tuple(row for row in fingerprint if row[0] == "hooks")


def audit_reason(events: list[dict[str, Any]]) -> str:
    """Why an audit batch that compiled re-arms (the last compile event names the cause)."""
    event = events[-1] if events else {}
    return (
        f"audit batch compiled with full guards ({event.get('reason', 'unknown')}): "
        "the stance was running code whose guards no longer held"
    )


def caught_change(target: CompiledTarget, swaps_parameters: str | None) -> Found | None:
    """The check before a call (H33): what a change in ``target`` calls for, or None.

    FSDP swaps the parameter objects around every forward by design: without
    install_free_tensors they are graph inputs, read afresh by every call, so a
    swap there is no change: :attr:`~guardtrain.engine.changes.Action.FORGET` (the
    fingerprint is taken again after the next compile).
    """
    found = decide(target, target.under_stance)
    if found is None:
        return None
    if (
        found.kind is Change.PARAMETERS
        and swaps_parameters
        and not target.code.install_free_tensors
    ):
        return found._replace(action=Action.FORGET)  # the reference is taken after the compile
    return found


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
