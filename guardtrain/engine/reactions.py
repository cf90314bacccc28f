"""The engine's acts and reactions: what it does with what checks find and targets report.

Two parts of :class:`~guardtrain.engine.engine.GuardEngine`, which inherits them:

* :class:`Acts`: the only code that re-arms, rebuilds, switches the stance or
  enters it (the entry decision), and the answers to what the targets report
  (a compile, a miss, a change seen before a call);
* :class:`Reactions`: the checks run around a batch (an unseen signature, a
  lookup window, an audit, a verify batch, the boundary re-check, graph breaks
  after a compile); :mod:`~guardtrain.engine.checks` returns their findings.

:class:`RunState` is what the engine itself remembers of one run; its rooms
(levers, targets, checks, lookup windows) keep the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from guardtrain.compile import CompiledTarget, Miss, grad_change, grad_moved, use_grad_variant
from guardtrain.engine import breaks as _breaks
from guardtrain.engine import checks, decisions
from guardtrain.engine.changes import Action, Change, ChangeLog
from guardtrain.engine.checks import Checks
from guardtrain.engine.config import GuardConfig
from guardtrain.engine.host import Host
from guardtrain.engine.levers import Levers
from guardtrain.engine.lookup import LookupWindows
from guardtrain.engine.phases import Loop, LoopState, Phase, PhaseMachine
from guardtrain.engine.session import StanceSession
from guardtrain.engine.targets import TargetSet, breaks_of, label, regions
from guardtrain.profiling import CompileMonitor
from guardtrain.signatures import SameSignature

__all__ = ["Acts", "Reactions", "RunState"]

# Plain strings on the per-batch path: an Enum member lookup costs more than the check.
TRAIN: str = Loop.TRAIN.value
STEADY: str = Phase.STEADY.value


@dataclass(slots=True)
class RunState:
    """What the engine itself remembers of one run (its rooms keep the rest)."""

    active: bool = False
    loop: str | None = None
    pending: set[str] = field(default_factory=set)
    """Loops whose next batch starts with the boundary re-check."""
    rank: int | None = None
    swaps_parameters: str | None = None
    """The strategy (or ``fully_shard``) that swaps parameter objects around every forward."""
    all_rearms: list[dict[str, Any]] | None = None
    entered_together: bool = False
    stance_blocked: str | None = None
    uncompiled: list[str] = field(default_factory=list)
    compiles_at_batch: int = 0
    same_signature: dict[str, SameSignature | None] = field(default_factory=dict)
    """Per loop: recognises a batch with the previous batch's signature (the steady path)."""
    probe: str | None = None
    """The loop whose current batch probes an unseen signature with full guards."""
    stance_on: bool = False
    """The current batch is steady: each target call runs under the stance, set for that
    call alone (H41), or directly (turbo)."""
    stance_at_start: bool = False
    """The stance was on when the current training batch started."""
    changes: int = 0
    """Counts compiles, re-arms and entries: the logger is called only when it moved."""
    logged_changes: int = -1
    caught: ChangeLog = field(default_factory=ChangeLog)
    """Changes caught before a call (H32-H35), by kind."""
    summary_logged: bool = False


class Acts:
    """The engine's acts, its entry decisions, and its answers to its targets' reports.

    :class:`~guardtrain.engine.engine.GuardEngine` sets up every attribute.
    """

    config: GuardConfig
    host: Host
    machine: PhaseMachine
    monitor: CompileMonitor
    session: StanceSession
    levers: Levers
    targets: TargetSet
    checks: Checks
    lookup: LookupWindows
    run: RunState
    restored: dict[str, Any]

    def train_batches(self) -> int:
        """Training batches of this run and the earlier ones (a checkpoint's included)."""
        return self.machine.loops[TRAIN].batches + self.restored.get("train_batches", 0)

    def gather_rearms(self) -> None:
        """With several processes, collect every rank's re-arms for rank zero's summary."""
        if not self.machine.collective or self.config.disabled:
            return
        gathered = self.host.agreement.gather(list(self.machine.rearms))
        merged = [r for rearms in gathered for r in (rearms or [])]
        self.run.all_rearms = sorted(merged, key=lambda r: (r["step"], r.get("rank", 0)))

    def _begin_session(self, values: dict[str, Any]) -> None:
        """Start the run's stance session and set the Dynamo ``values`` that differ."""
        self.session.begin()
        cfg = torch._dynamo.config
        for key, value in values.items():
            if getattr(cfg, key, value) != value:
                self.session.set_config(key, value)

    # -- what targets report -----------------------------------------------------------------

    def _on_compile(self, target: CompiledTarget, reason: str | None) -> None:
        self.run.changes += 1
        self.monitor.record(self.train_batches(), target.name, reason)

    def _on_switch_off(self, target: CompiledTarget, why: str) -> None:
        self.levers.switch_off(self.host, f"install_free_tensors for {self._label(target)!r}", why)

    def _on_change(self, target: CompiledTarget, note: str) -> None:
        """Before a call of ``target``: ``note`` says something it reads may have changed."""
        run = self.run
        if not run.active or self._paired():
            # With paired calls, a rebuild or a miss on one rank alone would break the
            # pairing of guard collectives, and so would a boundary check that only this
            # rank runs: the change waits for the next boundary or audit, which every
            # rank runs together.
            return
        found = checks.caught_change(target, run.swaps_parameters)
        if found is not None and found[0] is Action.SWITCH:
            # Frozen or unfrozen (H42): the code of the new pattern, kept from its last
            # use, is checked like any other before it runs.
            self._caught(found[1], f"{self._label(target)}: {found[2]} ({note})")
            use_grad_variant(target)
            found = checks.caught_change(target, run.swaps_parameters)
        if found is None:
            return
        action, kind, reason = found
        self._caught(kind, f"{self._label(target)}: {reason} ({note})")
        if action is Action.LEAVE:
            self._stop_checking()
            self._rearm(run.loop, f"{self._label(target)}: {reason}")
        else:
            self._rebuild_or_leave_shared(target, reason)

    def _on_miss(self, target: CompiledTarget, miss: Miss) -> bool:
        """A call of ``target`` missed: leave the stance; True to run it with full guards."""
        kind, reason = checks.miss(self._label(target), miss, self.checks.checking, self._paired())
        if kind is not None:
            self._caught(kind, reason)
        self._stop_checking()
        self._rearm(self.run.loop, reason)
        return not target.graph_breaks  # never in the stance with graph breaks (blocker)

    def _caught(self, kind: Change, reason: str) -> None:
        """Count a change caught before a call; log the first of each kind."""
        if self.run.caught.add(kind, reason):
            self.host.info(f"guardtrain: caught a change of {kind.value} before a call: {reason}")

    def _start_checking(self, described: str) -> None:
        self.checks.start_inputs(described, self.targets.installed)

    def _stop_checking(self) -> None:
        self.checks.stop_inputs(self.targets.installed)

    # -- the stance, re-arms and rebuilds ----------------------------------------------------

    def _label(self, target: CompiledTarget) -> str:
        return label(target, self.host.root_label)

    def _paired(self) -> bool:
        """Ranks must act together: guard collectives pair every compiled call across ranks."""
        return self.config.guard_collectives and self.machine.collective

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` on any rank (one collective when calls are paired), else this rank's."""
        if self._paired():
            return self.host.agreement.any(flag)
        return flag

    def _set_stance(self, on: bool) -> None:
        """The steady state starts or ends for the targets' calls. Torch's stance itself
        is set by each steady call around its own compiled call, never here (H41)."""
        run = self.run
        if on == run.stance_on or (on and not self.session.active):
            return
        run.stance_on = on
        stances = self.session.stances
        for target in self.targets.installed:
            target.set_under_stance(on, stances)

    def _rearm(self, loop: str | None, reason: str) -> None:
        run = self.run
        run.changes += 1
        if self.lookup.measure is not None and loop in (None, TRAIN):
            self.lookup.stop()  # measured again at the next entry
        self._set_stance(False)
        self.machine.rearm(loop, step=self.train_batches(), reason=reason, rank=run.rank)

    def _rebuild(self, target: CompiledTarget, reason: str) -> None:
        """Forget every compiled entry of ``target`` and send every loop back to warm-up."""
        target.forget_reference()
        target.rebuild()
        self._rearm(None, f"{self._label(target)}: {reason}; recompiling")

    def _rebuild_or_leave_shared(self, target: CompiledTarget, change: str) -> None:
        if target.code.shared and len(target.code.members) > 1 and target.drifted():
            # Only this member changed its structure: it leaves the shared code,
            # whose entries stay right for the others (H24).
            target.leave_shared_code(f"{change}: it no longer has its group's structure")
            self._rearm(None, f"{self._label(target)}: {change}; compiling it alone")
        else:
            self._rebuild(target, change)

    # -- entry ----------------------------------------------------------------------------------

    def _decision_point(self) -> None:
        """A training batch ended where entry may be decided (every rank at the same one)."""
        m = self.machine
        if m.use_stance and m.is_decision_point(TRAIN):
            self._decide(TRAIN)

    def _decide(self, loop: str) -> None:
        """Enter the stance for ``loop`` if this process (or, with several, every one) is ready.

        The only place entry is decided. With several processes it runs at the
        same batches on every rank and costs one collective.
        """
        m, run = self.machine, self.run
        ready = m.ready(loop)
        if not ready and not m.collective:
            return
        blocked = self._blocked() if ready else None
        vote = (ready and blocked is None) or m.steady(loop)
        if m.collective:
            vote = self.host.agreement.all(vote)
            if vote and loop == TRAIN:
                run.entered_together = True
        if ready and blocked is None and vote:
            self._enter(loop)
        elif blocked is not None and run.stance_blocked is None:
            run.changes += 1
            run.stance_blocked = blocked
            self.host.warn(f"guardtrain: the stance stays off: {blocked}.")

    def _enter(self, loop: str) -> None:
        """Enter the stance for ``loop``; the training loop's first entry measures lookups."""
        self.run.changes += 1
        self.machine.enter(loop)
        if loop == TRAIN and self._measures_lookup():
            self.lookup.start(self.config.lookup_window)

    def _blocked(self) -> str | None:
        """Why the ready targets may not use the stance (:func:`decisions.blocker`), or None."""
        limit = getattr(torch._dynamo.config, "recompile_limit", 8)
        return decisions.blocker(self.targets.installed, limit, self.host.root_label)

    def _measures_lookup(self) -> bool:
        """Whether entering the training loop's stance starts the lookup windows."""
        cfg = self.config
        measure = (
            cfg.measure_lookup if cfg.measure_lookup is not None else not self.machine.collective
        )
        # Not with paired calls: the window's batches would shift this rank's audits.
        # Not under turbo: steady calls skip Dynamo's entry path, which the window profiles.
        return (
            measure
            and not self._paired()
            and not self.levers.direct_dispatch
            and "steady" not in self.lookup.lookup
        )


class Reactions(Acts):
    """The checks the engine runs around a batch, and what it does with their findings."""

    def _signature_and_mode(
        self,
        loop: str,
        state: LoopState,
        batch: Any,
        training: bool,
        warmed_training: bool | None,
    ) -> tuple[bool, str | None]:
        """Whether the batch may run under the stance: ``(steady, check)``.

        A steady loop leaves the stance for an unseen signature or another mode,
        or keeps it and checks each call's inputs (``check``: the signature, H26).
        """
        steady = state.phase == STEADY
        same = self.run.same_signature.get(loop)
        if same is not None and same.signature is state.last_signature and same.matches(batch):
            unseen, signature = False, None  # the previous batch's signature (most batches)
        else:
            unseen, signature = checks.unseen(self.machine, loop, batch, self.run.same_signature)
        if not steady or not (
            unseen
            or training is not ((loop == TRAIN) if warmed_training is None else warmed_training)
        ):
            return steady, None
        reason, check, probe = checks.steady_batch(
            loop, unseen, signature, training, warmed_training, self._paired()
        )
        if probe:
            self.run.probe = loop
        if reason is None:
            return True, check
        self._rearm(loop, reason)
        return False, None

    def _lookup_batch(self, unseen: bool) -> bool:
        """A lookup window's batch; False for one with full guards (a compile re-arms, as
        in an audit; ``unseen``: the batch's signature is new, H26)."""
        steady = self.lookup.batch()
        if not steady:  # a compile with full guards here re-arms, as in an audit
            self.checks.start_audit(unseen)
        return steady

    def _end_probe(self, loop: str, compiled: bool) -> None:
        """After a batch that probed an unseen signature with full guards (H26)."""
        run = self.run
        if run.probe == loop and not compiled and self.machine.loops[loop].phase != STEADY:
            # A rank may resume alone: its own cache served the batch.
            run.changes += 1
            self.machine.enter(loop)
        run.probe = None

    def _end_checks(self, loop: str, compiled: bool) -> None:
        """End this batch's input checks, audit, verify batch and lookup window batch."""
        ch, run = self.checks, self.run
        if ch.checking is not None:
            if not compiled and self.machine.loops[loop].phase == STEADY:
                ch.checked_batches += 1
            self._stop_checking()
        if ch.audit_batch or ch.verify_batch:
            self._end_audit_or_verify(compiled)
        if (
            self.lookup.window is not None
            and loop == TRAIN
            and self.lookup.end_batch(self.config.lookup_window)
        ):
            run.changes += 1  # log guard/lookup_us

    def _audit_or_verify(self, steady: bool, unseen: bool) -> bool:
        """Start an audit or a verify batch when one is due, or the audit's batch again
        (``unseen``: this batch's signature is new, H26); return whether to use the stance."""
        ch = self.checks
        batches = self.machine.loops[TRAIN].batches
        due = ch.due(batches, self.config)
        if due == decisions.CHECK_AUDIT:
            self._boundary_check(TRAIN)
            if steady and self.machine.steady(TRAIN):
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
        self.checks.verify_batch = True
        if steady:
            for target in self.targets.installed:
                target.start_verify(self.config.verify_rtol, self.config.verify_atol)

    def _end_audit_or_verify(self, compiled: bool) -> None:
        """An audit that compiled re-arms (:meth:`_end_audit`); a verify batch rebuilds each
        target that differed."""
        ch, installed = self.checks, self.targets.installed
        if ch.audit_batch:
            self._end_audit(compiled)
        if ch.verify_batch:
            ch.verify_batch = False
            found = checks.verify_mismatches(installed)
            for target, mismatch in found:
                self.host.warn(
                    f"guardtrain: verify: compiled {self._label(target)!r} differs from eager: "
                    f"{mismatch}. Rebuilding it; please report this with the re-arm history."
                )
            if self._any_rank(bool(found)) and not found:
                found = [(t, "on another rank") for t in installed]
            for target, mismatch in found:
                self._rebuild(target, f"verify found a difference from eager ({mismatch})")

    def _end_audit(self, compiled: bool) -> None:
        """An audit batch ended (:func:`decisions.audit_verdict`). A compile there re-arms:
        the stance was running code whose guards no longer held. In a batch with an unseen
        signature the compile is for its new inputs (H26): it ran with full guards, so the
        new entry is Dynamo's own, and the entries the stance runs are unchanged, so the
        loop stays steady and the audit's batch runs again at the next seen signature;
        unless that compile left a target unfit for the stance (graph breaks, H20; the
        recompile limit, H5: :func:`decisions.blocker`), which re-arms as before."""
        ch = self.checks
        unseen = ch.audit_unseen
        blocked = self._blocked() if compiled and unseen else None
        verdict = decisions.audit_verdict(compiled, unseen, blocked)
        ch.end_audit(verdict, self.machine.loops[TRAIN].batches)
        if verdict == decisions.AUDIT_REARM:
            self._rearm(TRAIN, checks.audit_reason(self.monitor.events))

    def _boundary_check(self, loop: str) -> None:
        """Re-check every target: rebuild those whose entries no longer fit; a steady
        ``loop`` leaves the stance when no entry's kept guards hold."""
        rebuild: list[tuple[CompiledTarget, str]] = []
        for target in self.targets.installed:
            if grad_moved(target):  # every rank at once, also with paired calls (H42)
                self._caught(Change.REQUIRES_GRAD, f"{self._label(target)}: {grad_change(target)}")
                use_grad_variant(target)
            found = self.checks.boundary(target, self._label(target), self.run.swaps_parameters)
            if found is None:
                continue
            if found[0]:
                rebuild.append((target, found[1]))
            elif self.machine.steady(loop):
                self._rearm(loop, f"{self._label(target)}: {found[1]}")
        # A rebuilt target has no entries, so its first call issues no guard
        # collective: with paired calls every rank rebuilds together.
        if self._any_rank(bool(rebuild)) and not rebuild:
            rebuild = [(t, "another rank rebuilt its targets") for t in self.targets.installed]
        rebuilt: set[int] = set()
        for target, change in rebuild:
            drifted = target.code.shared and len(target.code.members) > 1 and target.drifted()
            if drifted or id(target.code) not in rebuilt:  # shared code is rebuilt once
                if not drifted:
                    rebuilt.add(id(target.code))
                self._rebuild_or_leave_shared(target, change)

    def _after_compile(self) -> None:
        """Once per batch that compiled: fingerprints, and no free tensors across graph breaks.

        A default target (``targets=None``) that breaks the graph is replaced by its
        parts (H20), which may break again and be split further. Warnings and the
        summary name each break by Dynamo's reason, file and line.
        """
        found = self.targets.break_log.new()
        for target in list(self.targets.installed):
            mine = breaks_of(target, found)
            if mine is None:
                continue
            if self.config.targets is None and self._split(target, mine):
                continue
            if target.code.install_free_tensors or target.code.drops_guards:
                self._keep_every_guard(target, mine)
            elif target.reference is None:
                target.take_reference()

    def _keep_every_guard(self, target: CompiledTarget, found: list[_breaks.GraphBreak]) -> None:
        """A target with graph breaks that it cannot be split for: full guards, rebuilt."""
        # The frames after a graph break run the module's own `forward`,
        # whose code other instances share (install_free_tensors there is
        # H12), and their guards name the frame's locals, which the
        # boundary re-check cannot evaluate: keep every guard there.
        target.code.keep_every_guard()
        parts = [name for name, _ in regions(target.name, target.module)]
        hint = f"; to use the stance, compile its parts: targets={parts}" if parts else ""
        self.levers.switch_off(
            self.host,
            f"install_free_tensors and the guard filter for {self._label(target)!r}",
            f"it has graph breaks ({_breaks.describe(found) or 'reason unknown'}): "
            "the frames after a break run code shared by every instance of its class, "
            f"and their dropped guards cannot be re-checked{hint}",
        )
        self._rebuild(target, "graph breaks: full guards, no install_free_tensors")

    def _split(self, target: CompiledTarget, found: list[_breaks.GraphBreak]) -> bool:
        """Compile the parts of a breaking default target instead of it; False if it has none."""
        text = _breaks.describe(found) or "reason unknown"
        label = self._label(target)
        names = self.targets.split(target, found, self._paired(), self.host.root_label)
        if names is None:
            return False
        self.host.warn(
            f"guardtrain: {label!r} breaks the graph ({text}); compiling its parts instead: "
            f"{names}. Pass `targets=` to choose the regions yourself."
        )
        self._rearm(None, f"{label}: graph break ({text}); compiling {names}")
        return True
