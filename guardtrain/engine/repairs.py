"""Repairs: what the engine does when something changed, and its answers to its targets.

:class:`Repairs` is the only code that re-arms a loop, rebuilds a target, compiles a
breaking target's parts, or switches the targets' steady calls on and off. It also
answers what a target reports from inside a call (:class:`~guardtrain.engine.targets.Hooks`):
a compile, a miss, a change seen before a call, ``install_free_tensors`` switched off.
The checks (:mod:`~guardtrain.engine.findings`) say what they found; this acts on it.
"""

from __future__ import annotations

from guardtrain._torch import dynamo_config
from guardtrain.compile import (
    CompiledTarget,
    Miss,
    MissReason,
    grad_change,
    grad_moved,
    hand_over,
    use_grad_variant,
)
from guardtrain.compile.direct import whole
from guardtrain.compile.trampoline import cache_entry_list
from guardtrain.engine import breaks as _breaks
from guardtrain.engine import findings
from guardtrain.engine.changes import Action, Change, Found, revalidate
from guardtrain.engine.handover import CHECK_WINDOW, checks_over
from guardtrain.engine.run import TRAIN, Run
from guardtrain.engine.targets import breaks_of, label, regions
from guardtrain.fingerprints import ROOT

__all__ = ["Repairs", "at_recompile_limit"]

_INPUT_MISSES = frozenset(
    (MissReason.UNSEEN_ARGUMENTS, MissReason.UNACCEPTED, MissReason.STANCE_MISS, MissReason.MODE)
)
"""Misses of a call's inputs (arguments, shapes, mode), not of a change to the model."""


def at_recompile_limit(target: CompiledTarget) -> bool:
    """Whether ``target``'s code holds as many entries as Dynamo compiles for one frame."""
    return target.cache_entries() >= getattr(dynamo_config, "recompile_limit", 8)


class Repairs:
    """Re-arms, rebuilds and the steady switch of one engine's runs.

    Args:
        run: the run's parts (each new run replaces them in place).
    """

    def __init__(self, run: Run) -> None:
        self.run = run

    def label(self, target: CompiledTarget) -> str:
        return label(target, self.run.host.root_label)

    # -- what targets report -----------------------------------------------------------------

    def on_compile(self, target: CompiledTarget, reason: str | None) -> None:
        self.run.monitor.record(self.run.train_batches(), target.name, reason, self.label(target))
        if target.handed_over is not None:
            # Dynamo's own recompile, as under plain compile: no phase hears of it (H51).
            self.run.state.unheard_compiles += 1

    def on_step_compile(self, name: str, reason: str | None) -> None:
        """A compiled optimizer step compiled (H49): counted in the summary as the targets'
        compiles are, but not as the batch's. The batch's compiles say whether the model's
        entries still held (an audit's compile re-arms its loop, a warm-up's restarts the
        stable count); the step never runs under the stance and checks its own state before
        it runs directly, so its compile says nothing of the model's entries."""
        self.run.monitor.record(self.run.train_batches(), name, reason)
        # The engine subtracts these from the batch's compiles, as it does the compiles of
        # targets handed over to full guards: no phase hears of either.
        self.run.state.unheard_compiles += 1

    def on_switch_off(self, target: CompiledTarget, why: str) -> None:
        r = self.run
        r.levers.switch_off(r.host, f"install_free_tensors for {self.label(target)!r}", why)

    def on_change(self, target: CompiledTarget, note: str) -> None:
        """Before a call of ``target``: ``note`` says something it reads may have changed."""
        r = self.run
        if not r.state.active or r.paired():
            # With paired calls, a rebuild or a miss on one rank alone would break the
            # pairing of guard collectives, and so would a boundary check that only this
            # rank runs: the change waits for the next boundary or audit, which every
            # rank runs together.
            return
        # Frozen or unfrozen (H42): the code of the new pattern, kept from its last use, is
        # checked like any other before it runs.
        self.switch_grads(target, f" ({note})")
        found = revalidate(target, target.under_stance, r.state.swaps_parameters)
        if found is None:
            return
        self.caught(found.kind, f"{self.label(target)}: {found.detail} ({note})")
        if found.action is Action.LEAVE:
            self.stop_checking()
            self.rearm(r.state.loop, f"{self.label(target)}: {found.detail}")
        else:
            self.rebuild_or_leave_shared(target, found)

    def switch_grads(self, target: CompiledTarget, note: str = "") -> None:
        """Where the parameters' ``requires_grad`` moved (frozen or unfrozen, H42): the
        code of the new pattern, a caught change."""
        if grad_moved(target):
            self.caught(Change.REQUIRES_GRAD, f"{self.label(target)}: {grad_change(target)}{note}")
            use_grad_variant(target)

    def on_miss(self, target: CompiledTarget, miss: Miss) -> bool:
        """A call of ``target`` missed: leave the stance; True to run it with full guards.

        Not at Dynamo's recompile limit, for a call whose inputs no entry accepts (H5): no
        entry can be compiled for it, and Dynamo runs it uncompiled, as under plain compile.
        That call runs with full guards and the loop stays steady (a re-arm would only
        repeat the miss)."""
        r = self.run
        if miss.reason in _INPUT_MISSES and not r.paired() and at_recompile_limit(target):
            target.counts.full_guard_calls += 1
            return True
        kind, reason = findings.miss(self.label(target), miss, r.checks.checking, r.paired())
        if kind is not None:
            self.caught(kind, reason)
        self.stop_checking()
        self.rearm(r.state.loop, reason)
        # A retry is safe where the miss came before any of the call ran: always, but for
        # a target whose every entry breaks (blocker keeps it out of the stance).
        return not target.graph_breaks or target.mixed

    def caught(self, kind: Change, reason: str) -> None:
        """Count a change caught before a call; log the first of each kind."""
        if self.run.state.caught.add(kind, reason):
            self.run.host.info(
                f"guardtrain: caught a change of {kind.value} before a call: {reason}"
            )

    # -- the steady switch -------------------------------------------------------------------

    def set_steady(self, on: bool, boundary: bool = False) -> None:
        """The steady state starts or ends for the targets' calls. Torch's stance itself
        is set by each steady call around its own compiled call, never here (H41).

        ``boundary``: off only because a loop pass starts or ends. The targets' known
        states then stay, and stay when the stance is next on, unless it went off for
        another reason in between (a re-arm): a Lightning run that validates every
        epoch swaps ``train()`` and ``eval()`` as a flip, not with a check (H46)."""
        r = self.run
        state = r.state
        if not on:
            state.states_kept = boundary and (state.states_kept or state.stance_on)
        if on == state.stance_on or (on and not r.dynamo.active):
            return
        keep = state.states_kept if on else boundary
        state.stance_on = on
        stances = r.dynamo.stances
        for target in r.targets.installed:
            target.set_under_stance(on, stances, keep=keep)

    def steady_for_batch(self, steady: bool, check: str | None) -> None:
        """The batch's calls run steady or not; a steady batch with an unseen signature
        (``check``) keeps the stance, and each call first shows that an entry's guards
        accept its inputs, or leaves the stance before it runs (H26)."""
        if steady is not self.run.state.stance_on:
            self.set_steady(steady)
        if check is not None and steady:
            self.start_checking(check)

    def start_checking(self, described: str) -> None:
        """Each call of this batch checks its inputs against an entry's guards (H26)."""
        self.run.checks.checking = described
        for target in self.run.targets.installed:
            target.start_checking()

    def stop_checking(self) -> None:
        """End the input checks, counting the calls that an entry accepted."""
        ch = self.run.checks
        ch.checking = None
        for target in self.run.targets.installed:
            ch.checked_calls += target.stop_checking()

    # -- re-arms and rebuilds ----------------------------------------------------------------

    def rearm(self, loop: str | None, reason: str) -> None:
        """Send ``loop`` (every loop when None) back to warm-up, out of the stance."""
        r = self.run
        if r.lookup.measure is not None and loop in (None, TRAIN):
            r.lookup.stop()  # measured again at the next entry
        self.set_steady(False)
        r.machine.rearm(loop, step=r.train_batches(), reason=reason, rank=r.state.rank)

    def rebuild(self, target: CompiledTarget, reason: str) -> None:
        """Forget every compiled entry of ``target`` and send every loop back to warm-up;
        the entries dropped count against its compile margin (H51)."""
        self.run.ledger.dropped(self.label(target), target.code.live_entries())
        target.forget_reference()
        target.uncompiled = False
        target.rebuild()
        self.rearm(None, f"{self.label(target)}: {reason}; recompiling")

    def run_uncompiled(self, target: CompiledTarget, change: str) -> None:
        """Until the repairs split it, ``target``'s calls run its own ``forward`` uncompiled
        (its entries are stale), and every loop goes back to warm-up."""
        target.forget_reference()
        target.uncompiled = True
        self.rearm(None, f"{self.label(target)}: {change}; uncompiled until it is split")

    def rebuild_or_leave_shared(self, target: CompiledTarget, found: Found) -> None:
        """A change made ``target``'s entries stale: rebuild it (or let it leave its shared
        code), unless the rebuild would go past its compile margin: then it is split, or
        handed over (H51, :func:`~guardtrain.engine.handover.rebuild_over`)."""
        r = self.run
        name = self.label(target)
        change = found.detail
        # The change as the user knows it: a fingerprint names the target's own module `<root>`.
        named = found.named(repr(ROOT), repr(name))
        capped = r.ledger.rebuilt(name, named, target.code.live_entries())
        if capped is not None:
            repeated = r.ledger.repeated(name) or named
            why = f"{capped}; most often because {repeated.detail}"
            due = any(t is target for t, _, _ in r.state.splits_due)
            if due or self._may_split(target):
                # H51 confined: split when the repairs run (this may be inside its own call),
                # so that the part that keeps changing is handed over alone. Its entries are
                # stale: until then it runs uncompiled, rather than compile entries that the
                # split drops again.
                if not due:
                    r.state.splits_due.append((target, why, repeated))
                self.run_uncompiled(target, change)
                return
            self.hand_over(target, why, repeated)
            return
        if target.code.shared and len(target.code.members) > 1 and target.drifted():
            # Only this member changed its structure: it leaves the shared code,
            # whose entries stay right for the others (H24).
            target.leave_shared_code(f"{change}: it no longer has its group's structure")
            self.rearm(None, f"{self.label(target)}: {change}; compiling it alone")
        else:
            self.rebuild(target, change)

    def hand_over(self, target: CompiledTarget, why: str, change: Found | None = None) -> None:
        """Full guards for ``target`` for the rest of the run, as ``torch.compile`` runs it;
        Dynamo's recompile limit applies (H51). One warning names it and why (``change``:
        the change that rebuilt it most often)."""
        r = self.run
        name = self.label(target)
        hand_over(target, why)
        detail = None if change is None else change.detail
        r.ledger.handed_over.append({"target": name, "why": why, "change": detail})
        r.host.warn(
            f"guardtrain: {name!r} runs with full guards for the rest of the run, as "
            f"torch.compile runs it ({why}); Dynamo's recompile limit applies to it (H51)."
        )
        # Afresh: every entry with every guard, the hooks' among them, no free tensors.
        self.rebuild(target, f"handed over to full guards ({why})")

    def weigh_checks(self, steady: bool) -> None:
        """After a training batch: in windows of :data:`~guardtrain.engine.handover.CHECK_WINDOW`
        steady batches without a compile, hand over the targets whose general checks
        before calls outweigh the guards that the steady state skipped
        (:func:`~guardtrain.engine.handover.checks_over`: counts, never clocks) in two
        windows in a row: never slower than plain compile. Not with paired calls (a
        hand-over on one rank alone would break the pairing of guard collectives)."""
        r = self.run
        ledger = r.ledger
        if not steady or r.paired() or ledger.compiles != r.monitor.compiles:
            # A compile makes the states known so far stale, and the stance's entry starts
            # them afresh: the first check of each after it is a cost of that compile or
            # entry, not a recurring one (H46).
            ledger.restart(r.monitor.compiles)
            if not steady or r.paired():
                return
        batch = r.train_batches()
        start = ledger.window_start
        if start is not None and batch - start < CHECK_WINDOW:
            return  # inside a window: nothing to read (most batches)
        installed = [t for t in r.targets.installed if t.handed_over is None]
        if start is None:
            ledger.window_start = batch
            ledger.checks = {id(t): t.general_checks for t in installed}
            return
        ledger.window_start = None
        self._hand_over_costly(installed, batch - start)

    def _hand_over_costly(self, installed: list[CompiledTarget], steps: int) -> None:
        """At a window's end (``steps`` steady batches): hand over the targets whose checks
        outweighed the guards skipped, in this window and the one before."""
        ledger = self.run.ledger
        by_name = {self.label(t): t for t in installed}
        checks = {
            name: (t.general_checks - ledger.checks.get(id(t), t.general_checks), *t.check_rows())
            for name, t in by_name.items()
        }
        guards = {name: t.code.plain_guard_count for name, t in by_name.items()}
        for name in ledger.over_again(checks_over(checks, steps, guards)):
            n, fingerprint, assertions = checks[name]
            rows = fingerprint + assertions
            self.hand_over(
                by_name[name],
                f"its checks before calls ({n} in {steps} steady batches, {rows} rows each) "
                f"outweigh the {guards[name]} guards a call skips in the steady state, in "
                f"{CHECK_WINDOW} steady batches twice in a row",
            )

    # -- graph breaks --------------------------------------------------------------------------

    def after_compile(self, wait: bool = False) -> None:
        """Once per batch that compiled (or ran a target uncompiled until its split):
        fingerprints, graph breaks, and the splits that are due.

        A default target (``targets=None``) that breaks the graph is replaced by its
        parts (H20), which may break again and be split further. Warnings and the
        summary name each break by Dynamo's reason, file and line. With ``wait`` (a
        backward follows the batch), or while repairs already wait, they wait for
        :meth:`~guardtrain.engine.engine.GuardEngine.backward_done`: a checkpointed block
        runs its forward again in the backward and must run the same graph (H52).
        """
        state, targets = self.run.state, self.run.targets
        found = targets.break_log.new()  # read now: a rebuild before the wait ends forgets them
        for target in list(targets.installed):
            if target.handed_over is not None:
                continue  # full guards, as plain compile: its breaks are Dynamo's (H51)
            mine = breaks_of(target, found)
            if mine is not None:
                state.breaks_due.append((target, mine))
        if wait or state.repairs_due:
            # The targets run as they compiled until the backward: a checkpointed block
            # runs its forward again there and must run what the forward ran (H52).
            state.repairs_due = True
            return
        self._splits_due()
        due, state.breaks_due = state.breaks_due, []
        done: set[int] = set()
        for target, mine in due:
            if id(target) in done or target.handed_over is not None:
                continue
            if any(t is target for t in targets.installed):  # else split already
                done.add(id(target))
                self._answer_breaks(target, mine)

    def _splits_due(self) -> None:
        """The default targets rebuilt too often, each split, or handed over whole when it
        has no parts any more."""
        state, installed = self.run.state, self.run.targets.installed
        splits, state.splits_due = state.splits_due, []
        for target, why, repeated in splits:
            live = target.handed_over is None and any(t is target for t in installed)
            if live and not self._split_rebuilt(target, why, repeated):
                self.hand_over(target, why, repeated)

    def _answer_breaks(self, target: CompiledTarget, mine: list[_breaks.GraphBreak]) -> None:
        """A target with graph breaks: split (a default target whose every entry breaks),
        or kept whole, with nothing compiled again.

        The frames after a break keep every guard (:meth:`TargetCode._track`), so the
        entries compiled so far stay right and are never recompiled for the break. A
        target that also has entries without a break (``generate()``'s decode calls, where
        only the training forward breaks) is *mixed*: calls whose entry breaks run with
        full guards, the others under the stance or directly (H4). A target whose every
        entry breaks keeps the stance off (:func:`~guardtrain.engine.decisions.blocker`)."""
        mixed = target.mixed or _has_unbroken_entry(target)
        if self._splits_at_break(target, mixed) and self._split(target, mine):
            return
        if not target.graph_breaks_reported:
            target.graph_breaks_reported = True
            self._report_kept_whole(target, mine, mixed)
        target.mixed = mixed  # kept whole from now on, also when the next compile breaks
        if target.reference is None:
            target.take_reference()

    def _splits_at_break(self, target: CompiledTarget, mixed: bool) -> bool:
        """Whether ``target``'s graph breaks split it: a default target with parts whose
        every entry breaks (not ``mixed``)."""
        return (
            self.run.config.targets is None
            and not mixed
            and bool(regions(target.name, target.module))
        )

    def _report_kept_whole(
        self, target: CompiledTarget, found: list[_breaks.GraphBreak], mixed: bool
    ) -> None:
        """One warning, and a row of ``summary()["mixed_targets"]``, for a target with graph
        breaks that is kept whole."""
        name = self.label(target)
        text = _breaks.describe(found) or "reason unknown"
        parts = [part for part, _ in regions(target.name, target.module)]
        if mixed:
            answer = "its calls whose entry breaks run with full guards, the others steady"
        else:
            answer = "every call breaks, so the stance stays off" + (
                f"; to use it, compile its parts: targets={parts}" if parts else ""
            )
        self.run.targets.mixed.append(
            {"target": name, "reason": text, "answer": answer, "mixed": mixed}
        )
        self.run.host.warn(f"guardtrain: {name!r} breaks the graph ({text}); {answer} (H4).")

    def _split(self, target: CompiledTarget, found: list[_breaks.GraphBreak]) -> bool:
        """Compile the parts of a breaking default target instead of it; False if it has none."""
        r = self.run
        text = _breaks.describe(found) or "reason unknown"
        name = self.label(target)
        names = r.targets.split(target, found, r.paired(), r.host.root_label)
        if names is None:
            return False
        r.host.warn(
            f"guardtrain: {name!r} breaks the graph ({text}); compiling its parts instead: "
            f"{names}. Pass `targets=` to choose the regions yourself."
        )
        self.rearm(None, f"{name}: graph break ({text}); compiling {names}")
        return True

    def _may_split(self, target: CompiledTarget) -> bool:
        """Whether a target rebuilt too often is split instead of handed over whole: a
        default target with parts, whose code it does not share with others (their entries
        would stay), in a run whose ranks are not paired (each rank counts its own
        rebuilds: a split on one rank alone would break the pairing)."""
        r = self.run
        return (
            r.config.targets is None
            and not r.paired()
            and not (target.code.shared and len(target.code.members) > 1)
            and bool(regions(target.name, target.module))
        )

    def _split_rebuilt(self, target: CompiledTarget, why: str, repeated: Found) -> bool:
        """Compile the parts of a default target rebuilt too often instead of handing it
        over whole (H51). When the change that recurred names a submodule's hooks (a hook
        added to the input embeddings in every step), the part that holds it is handed
        over at once; any other recurring change rebuilds, and may hand over, only the
        part it is in. False if ``target`` has no parts."""
        r = self.run
        name = self.label(target)
        sub = repeated.hooks_of
        names = r.targets.split(target, [], r.paired(), r.host.root_label, record=False)
        if names is None:
            return False
        r.host.warn(
            f"guardtrain: {name!r} was {why}; compiling its parts instead: {names}, so that "
            "only the part that keeps changing runs with full guards. Pass `targets=` to "
            "choose the regions yourself."
        )
        self.rearm(None, f"{name}: {why}; compiling {names}")
        if sub is not None:
            path = f"{target.name}.{sub}" if target.name else sub
            for part in list(r.targets.installed):
                if part.name in names and (path == part.name or path.startswith(part.name + ".")):
                    self.hand_over(part, why, repeated)
        return True


def _has_unbroken_entry(target: CompiledTarget) -> bool:
    """Whether some entry of ``target``'s code (of any of its variants: a ``requires_grad``
    pattern, an autocast state) runs its whole call as one graph."""
    if cache_entry_list is None:
        return False
    return any(
        whole(e.code)
        for code in target.code.variants.values()
        for e in cache_entry_list(code.trampoline)
    )
