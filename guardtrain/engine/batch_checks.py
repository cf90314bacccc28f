"""The checks around a batch, and entry: what the engine runs at a batch's start and end.

:class:`BatchChecks` gives a training batch its turn (a lookup window's batch, an audit,
a verify batch), runs the boundary re-check, ends a batch's checks, and decides entry
into the stance at decision points (:meth:`BatchChecks.decide`, the only place an entry
is decided; the resume after a probe is the phase machine's own,
:meth:`~guardtrain.engine.phases.PhaseMachine.resume`). Whether a batch's signature and
mode let it run steady is the phase machine's question
(:meth:`~guardtrain.engine.phases.PhaseMachine.steady_batch`). What the checks find is
acted on through :class:`~guardtrain.engine.repairs.Repairs`.
"""

from __future__ import annotations

from guardtrain.compile import CompiledTarget
from guardtrain.engine import decisions, findings
from guardtrain.engine.changes import Action, Change, Found, revalidate
from guardtrain.engine.phases import LoopState, Phase
from guardtrain.engine.repairs import Repairs
from guardtrain.engine.run import TRAIN, Run

__all__ = ["BatchChecks"]

STEADY: str = Phase.STEADY.value


class BatchChecks:
    """One engine's checks around each batch, and its entry decisions.

    Args:
        run: the run's parts (each new run replaces them in place).
        repairs: what acts on the findings.
    """

    def __init__(self, run: Run, repairs: Repairs) -> None:
        self.run = run
        self.repairs = repairs

    # -- a batch's start -----------------------------------------------------------------------

    def training_turn(self, loop_state: LoopState, steady: bool, check: str | None) -> bool:
        """A training batch's turn, after its signature and mode (``steady``; ``check``: the
        unseen signature its calls check): a lookup window's batch, an audit, a verify
        batch, or neither; returns whether it runs steady. Sets the guard collectives."""
        r = self.run
        if r.lookup.measure is not None and steady:
            steady = self.lookup_batch(check is not None)
        elif loop_state.batches >= r.checks.next_check:
            steady = self.audit_or_verify(steady, check is not None)
        # The compiled optimizer steps too run with full guards in such a batch (H49).
        r.optimizers.full_guards(r.checks.audit_batch or r.lookup.measure == "full")
        if r.config.guard_collectives:
            r.dynamo.set_guard_collectives(r.paired() and r.state.entered_together)
        return steady

    def lookup_batch(self, unseen: bool) -> bool:
        """A lookup window's batch; False for one with full guards (a compile re-arms, as
        in an audit; ``unseen``: the batch's signature is new, H26)."""
        steady = self.run.lookup.batch()
        if not steady:
            self.run.checks.start_audit(unseen)
        return steady

    def audit_or_verify(self, steady: bool, unseen: bool) -> bool:
        """Start an audit or a verify batch when one is due, or the audit's batch again
        (``unseen``: this batch's signature is new, H26); return whether to use the stance."""
        r = self.run
        ch = r.checks
        batches = r.machine.loops[TRAIN].batches
        due = ch.due(batches, r.config)
        if due == decisions.CHECK_AUDIT:
            self.boundary(TRAIN)
            if steady and r.machine.steady(TRAIN):
                ch.start_audit(unseen)
            steady = False
        elif ch.audit_again and due is None and steady and not unseen:
            # An audit batch with an unseen signature compiled for its inputs (H26): this
            # steady batch with a seen signature runs with full guards as the audit.
            ch.start_audit(False)
            steady = False
        elif due == decisions.CHECK_VERIFY:
            self._start_verify(steady)
        if ch.audit_again and not ch.audit_batch:
            ch.next_check = batches + 1  # the audit's batch waits for a seen signature (H26)
        return steady

    def _start_verify(self, steady: bool) -> None:
        """A verify batch: a steady one runs each target's eager ``forward`` beside it."""
        r = self.run
        r.checks.verify_batch = True
        if steady:
            for target in r.targets.installed:
                target.start_verify(r.config.verify_rtol, r.config.verify_atol)

    def boundary(self, loop: str) -> None:
        """Re-check every target: rebuild those whose entries no longer fit; a steady
        ``loop`` leaves the stance when no entry's kept guards hold."""
        r, repairs = self.run, self.repairs
        rebuild: list[tuple[CompiledTarget, Found]] = []
        steady, swaps = r.machine.steady(loop), r.state.swaps_parameters
        for target in r.targets.installed:
            if target.handed_over is not None:
                continue  # full guards, as plain compile (H51)
            repairs.switch_grads(target)  # every rank at once, also with paired calls (H42)
            label = repairs.label(target)
            found = r.checks.skipped_code(target, label) or revalidate(target, steady, swaps)
            if found is None:
                continue
            if found.action is Action.LEAVE:
                repairs.rearm(loop, f"{label}: {found.detail}")
            else:
                rebuild.append((target, found))
        self._rebuild_all(rebuild)

    def _rebuild_all(self, rebuild: list[tuple[CompiledTarget, Found]]) -> None:
        """Rebuild what the boundary found, on every rank together when calls are paired."""
        r, repairs = self.run, self.repairs
        # A rebuilt target has no entries, so its first call issues no guard
        # collective: with paired calls every rank rebuilds together.
        if r.any_rank(bool(rebuild)) and not rebuild:
            other = Found(Action.REBUILD, Change.MODULE_STATE, "another rank rebuilt its targets")
            rebuild = [(t, other) for t in r.targets.installed]
        rebuilt: set[int] = set()
        for target, change in rebuild:
            drifted = target.code.shared and len(target.code.members) > 1 and target.drifted()
            if drifted or id(target.code) not in rebuilt:  # shared code is rebuilt once
                if not drifted:
                    rebuilt.add(id(target.code))
                repairs.rebuild_or_leave_shared(target, change)

    # -- a batch's end -------------------------------------------------------------------------

    def end_checks(self, loop: str, compiled: bool) -> None:
        """End this batch's input checks, audit, verify batch and lookup window batch (the
        engine calls it when one of them runs)."""
        r = self.run
        ch = r.checks
        if ch.checking is not None:
            if not compiled and r.machine.loops[loop].phase == STEADY:
                ch.checked_batches += 1
            self.repairs.stop_checking()
        if ch.audit_batch:
            self._end_audit(compiled)
        if ch.verify_batch:
            self._end_verify()
        if r.lookup.window is not None and loop == TRAIN:
            r.lookup.end_batch(r.config.lookup_window)

    def _end_verify(self) -> None:
        """A verify batch rebuilds each target whose compiled result differed from eager."""
        r = self.run
        r.checks.verify_batch = False
        installed = r.targets.installed
        found = [(t, t.stop_verify()) for t in installed]
        differed = [(t, mismatch) for t, mismatch in found if mismatch is not None]
        for target, mismatch in differed:
            r.host.warn(
                f"guardtrain: verify: compiled {self.repairs.label(target)!r} differs from "
                f"eager: {mismatch}. Rebuilding it; please report this with the re-arm history."
            )
        if r.any_rank(bool(differed)) and not differed:
            differed = [(t, "on another rank") for t in installed]
        for target, mismatch in differed:
            self.repairs.rebuild(target, f"verify found a difference from eager ({mismatch})")

    def _end_audit(self, compiled: bool) -> None:
        """An audit batch ended (:func:`decisions.audit_verdict`). A compile there re-arms:
        the stance was running code whose guards no longer held. In a batch with an unseen
        signature the compile is for its new inputs (H26): it ran with full guards, so the
        new entry is Dynamo's own, and the entries the stance runs are unchanged, so the
        loop stays steady and the audit's batch runs again at the next seen signature;
        unless that compile left a target unfit for the stance (graph breaks, H20; the
        recompile limit, H5: :func:`decisions.blocker`), which re-arms as before."""
        r = self.run
        ch = r.checks
        unseen = ch.audit_unseen
        blocked = self.blocked() if compiled and unseen else None
        verdict = decisions.audit_verdict(compiled, unseen, blocked)
        ch.end_audit(verdict, r.machine.loops[TRAIN].batches)
        if verdict == decisions.AUDIT_REARM:
            self.repairs.rearm(TRAIN, findings.audit_reason(r.monitor.events))

    # -- entry ---------------------------------------------------------------------------------

    def decision_point(self) -> None:
        """A training batch ended where entry may be decided (every rank at the same one)."""
        m = self.run.machine
        if m.use_stance and m.is_decision_point(TRAIN):
            self.decide(TRAIN)

    def decide(self, loop: str) -> None:
        """Enter the stance for ``loop`` if this process (or, with several, every one) is ready.

        The only place entry is decided. With several processes it runs at the
        same batches on every rank and costs one collective.
        """
        r = self.run
        m = r.machine
        ready = m.ready(loop)
        if not ready and not m.collective:
            return
        blocked = self.blocked() if ready else None
        vote = (ready and blocked is None) or m.steady(loop)
        if m.collective:
            vote = r.host.agreement.all(vote)
            if vote and loop == TRAIN:
                r.state.entered_together = True
        if ready and blocked is None and vote:
            self._enter(loop)
        elif blocked is not None and m.block(blocked):
            r.host.warn(f"guardtrain: the stance stays off: {blocked}.")

    def _enter(self, loop: str) -> None:
        """Enter the stance for ``loop``; the training loop's first entry measures lookups."""
        self.run.machine.enter(loop)
        if loop == TRAIN and self._measures_lookup():
            self.run.lookup.start(self.run.config.lookup_window)

    def blocked(self) -> str | None:
        """Why the ready targets may not use the stance (:func:`decisions.blocker`), or None."""
        installed = self.run.targets.installed
        kept = [t for t in installed if t.handed_over is None]  # full guards, never the stance
        if installed and not kept:
            return "every target runs with full guards for the rest of the run (H51)"
        return decisions.blocker(kept, self.run.host.root_label)

    def _measures_lookup(self) -> bool:
        """Whether entering the training loop's stance starts the lookup windows."""
        r = self.run
        # Not with paired calls: the window's batches would shift this rank's audits.
        # Under turbo the steady window profiles what Dynamo's entry path still costs (the
        # calls that did not run directly); the direct calls' own checks, a few µs a call,
        # are not profiled (summary()["step"]["note"]).
        return r.config.measure_lookup and not r.paired() and "steady" not in r.lookup.lookup
