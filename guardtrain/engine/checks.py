"""Checks: loop boundaries, audits, verify batches and unseen inputs. They return findings.

Each check reads the targets and says what it found; the engine acts on it
(re-arms, rebuilds, counts a caught change), as Lightning's ``EarlyStopping``
returns ``(should_stop, reason)`` for its hook to act on. :class:`Checks` holds
what the checks of one run remember: which check the current batch is, the
targets skipped once, and the counts of unseen batches kept under the stance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from guardtrain.compile import CompiledTarget, Miss, MissReason
from guardtrain.engine import decisions
from guardtrain.engine.changes import Action, Change, decide
from guardtrain.engine.config import GuardConfig
from guardtrain.engine.phases import PhaseMachine
from guardtrain.fingerprints import fingerprint_change, module_fingerprint
from guardtrain.signatures import SameSignature, batch_signature, describe_signature

__all__ = [
    "Checks",
    "audit_reason",
    "caught_change",
    "miss",
    "steady_batch",
    "unseen",
    "verify_mismatches",
]


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

    def start_inputs(self, described: str, targets: list[CompiledTarget]) -> None:
        """Each call of this batch checks its inputs against an entry's guards (H26)."""
        self.checking = described
        for target in targets:
            target.start_checking()

    def stop_inputs(self, targets: list[CompiledTarget]) -> None:
        """End the input checks, counting the calls that an entry accepted."""
        self.checking = None
        for target in targets:
            self.checked_calls += target.stop_checking()

    def boundary(
        self, target: CompiledTarget, label: str, swaps_parameters: str | None = None
    ) -> tuple[bool, str] | None:
        """What the boundary re-check finds in ``target``: ``(rebuild, why)`` or None.

        ``rebuild`` is True when its entries no longer fit (a changed fingerprint, a
        stale dropped guard, code that Dynamo skipped, H18); False when no entry's
        kept guards hold (``why`` then says what changed: a steady loop leaves the
        stance).

        ``swaps_parameters`` (FSDP): without install_free_tensors a swapped parameter is
        no change, as in :func:`caught_change`. The boundary may see the sharded
        parameters where the reference, taken inside a forward, saw the gathered ones
        (the Trainer's hooks: FSDP2 keeps the root's group gathered until backward), so
        only the hooks are compared and the reference is taken again as it is here.
        """
        if target.calls and target.cache_entries() == 0 and label not in self.skipped:
            # Dynamo marked the code skipped, e.g. after a call under a dispatch
            # mode that guardtrain did not see (H18): a fresh code object compiles.
            self.skipped.append(label)
            return True, "Dynamo skipped its code, it ran uncompiled"
        change = None
        if target.reference is not None:
            now = module_fingerprint(target.module)
            change = fingerprint_change(target.reference, now)
            if change is not None and swaps_parameters and not target.code.install_free_tensors:
                change = fingerprint_change(_hook_rows(target.reference), _hook_rows(now))
                if change is None:
                    target.take_reference()
        stale, unmatched = target.check_assertions()
        if change is None and stale is not None:
            change = f"{stale} (a guard that was dropped or skipped)"
        if change is not None:
            return True, change
        if unmatched is not None:
            return False, unmatched
        return None


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


def verify_mismatches(targets: list[CompiledTarget]) -> list[tuple[CompiledTarget, str]]:
    """End a verify batch: each target whose compiled result differed from eager, and how."""
    found = [(t, t.stop_verify()) for t in targets]
    return [(t, mismatch) for t, mismatch in found if mismatch is not None]


def caught_change(
    target: CompiledTarget, swaps_parameters: str | None
) -> tuple[Action, Change, str] | None:
    """The check before a call (H33): what a change in ``target`` calls for, or None.

    FSDP swaps the parameter objects around every forward by design: without
    install_free_tensors they are graph inputs, read afresh by every call, so a
    swap there is no change (the fingerprint is taken again after the next compile).
    """
    found = decide(target, target.under_stance)
    if found is None:
        return None
    kind = found[1]
    if kind is Change.PARAMETERS and swaps_parameters and not target.code.install_free_tensors:
        target.forget_reference()  # taken again after the next compile
        return None
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


def unseen(
    machine: PhaseMachine,
    loop: str,
    batch: Any,
    same_signature: dict[str, SameSignature | None],
) -> tuple[bool, Any]:
    """Whether ``batch``'s signature is new to ``loop``, and the signature, read in full.

    For a batch that the loop's matcher in ``same_signature`` did not recognise.
    The loop is given a new matcher when the batch repeats the previous one's
    signature, so that the next such batch is recognised fast.
    """
    state = machine.loops[loop]
    signature = batch_signature(batch)
    last = state.last_signature
    found = machine.new_signature(loop, signature)
    if state.last_signature is last:
        # The previous batch's signature again: recognise the next one fast.
        # Not after a change, so that shapes that vary from batch to batch
        # (H26) pay nothing for a matcher they would never use.
        same_signature[loop] = SameSignature.of(batch, last, same_signature.get(loop))
    return found, signature


def steady_batch(
    loop: str,
    new: bool,
    signature: Any,
    training: bool,
    warmed_training: bool | None,
    paired: bool,
) -> tuple[str | None, str | None, bool]:
    """A steady loop's batch with a new signature (``new``) or another mode.

    Returns ``(reason, check, probe)``: why the loop leaves the stance (None: it
    stays); the described signature whose calls each check their inputs under
    the stance (H26); and whether the batch probes the signature with full
    guards (with paired calls: if it compiles nothing, the stance resumes).
    """
    reason = decisions.leave_reason(loop, None, training, warmed_training)
    if reason is not None or not new:
        return reason, None, False
    described = describe_signature(signature)
    if paired:
        # One batch with full guards (H26): if it compiles nothing, the
        # loop's cache serves this signature and the stance resumes.
        return f"unseen batch signature {described}", None, True
    return None, described, False
