"""The warm-up -> steady -> re-armed state machine: the one owner of every loop's phase.

Every transition of a loop goes through :class:`PhaseMachine`, with its inputs passed
in: a finished batch (:meth:`~PhaseMachine.batch_done`, the per-step path too), a pass
(:meth:`~PhaseMachine.pass_started`, :meth:`~PhaseMachine.pass_done`), an entry the
engine decided (:meth:`~PhaseMachine.enter`), the resume after a probe
(:meth:`~PhaseMachine.resume`), a re-arm (:meth:`~PhaseMachine.rearm`) and a stance
blocked for the run (:meth:`~PhaseMachine.block`). It also remembers the batch
signatures each loop has seen (:meth:`~PhaseMachine.unseen`). No torch state is read.

Each loop (``"train"``, ``"validate"``, ``"test"``, ``"predict"``) has its own
phase, because each runs the compiled code in another state (grad mode,
``training`` flags, batch shapes):

* ``"warmup"``: full guards. Training becomes *ready* once at least
  ``warmup_steps`` batches ran and none of the last ``stable_steps`` compiled.
  An evaluation loop becomes ready after one complete pass without a compile.
* ``"steady"``: the caller runs the loop under the unsafe stance.
* a *re-arm* sends a loop back to ``"warmup"`` and records why. After a re-arm
  training needs ``stable_steps`` batches without a compile again.
* ``"off"``: the preset never uses the stance.

Entry is decided by the caller at *decision points* only
(:meth:`PhaseMachine.is_decision_point`), so several processes can agree on
the same batch with one collective each time (H7). A single process decides
on every batch.

Example:
    >>> m = PhaseMachine(warmup_steps=2, stable_steps=1, use_stance=True)
    >>> m.batch_done("train", compiled=True); m.ready("train")
    False
    >>> m.batch_done("train", compiled=False); m.ready("train")
    True
    >>> m.enter("train"); m.phase("train")
    'steady'
    >>> m.rearm("train", step=2, reason="batch signature changed"); m.phase("train")
    'warmup'
    >>> m.changes  # an entry and a re-arm
    2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from guardtrain.engine import decisions
from guardtrain.signatures import SameSignature, batch_signature, describe_signature

__all__ = ["LOOPS", "PHASE_NUMBERS", "Loop", "LoopState", "Phase", "PhaseMachine"]


class _StrEnum(StrEnum):
    """Members compare and hash equal to their plain ``str`` values."""

    __hash__ = str.__hash__  # interchangeable with its value in dicts and sets (Enum
    # hashes the member's name)


class Loop(_StrEnum):
    """The loops a run has."""

    TRAIN = "train"
    VALIDATE = "validate"
    TEST = "test"
    PREDICT = "predict"


class Phase(_StrEnum):
    """A loop's phase."""

    OFF = "off"
    WARMUP = "warmup"
    STEADY = "steady"


LOOPS: tuple[str, ...] = tuple(loop.value for loop in Loop)
PHASE_NUMBERS = {Phase.OFF.value: 0, Phase.WARMUP.value: 1, Phase.STEADY.value: 2}


@dataclass(slots=True)
class LoopState:
    """Counters of one loop."""

    phase: str = "warmup"
    batches: int = 0
    """Batches run by this loop since the start of the run."""
    since_compile: int = 0
    """Batches since the last batch that compiled (or since a re-arm)."""
    warmed_once: bool = False
    """The loop reached ``warmup_steps`` once; after a re-arm only ``stable_steps`` count."""
    clean_pass: bool = False
    """An evaluation loop finished a complete pass without a compile."""
    pass_compiled: bool = False
    signatures: set[Any] = field(default_factory=set)
    """Batch signatures seen with full guards."""
    last_signature: Any = None
    """The previous batch's signature (most batches repeat it: no set lookup then)."""
    same: SameSignature | None = None
    """Recognises a batch with the previous batch's signature fast (the steady path)."""


class PhaseMachine:
    """Decides per loop when the stance may be used; records re-arms.

    Args:
        warmup_steps: training batches before the first entry.
        stable_steps: batches without a compile needed before (re-)entry.
        use_stance: whether the stance is used at all (else every loop is ``"off"``).
        collective: decisions are made by several processes together; then
            training decides every ``stable_steps`` batches, not every batch.
    """

    def __init__(
        self, warmup_steps: int, stable_steps: int, use_stance: bool, collective: bool = False
    ) -> None:
        self.warmup_steps = warmup_steps
        self.stable_steps = stable_steps
        self.use_stance = use_stance
        self.collective = collective
        self.loops = {name: LoopState() for name in LOOPS}
        self.rearms: list[dict[str, Any]] = []
        self.warmup_steps_taken = 0
        self.steady_steps = 0
        self.changes = 0
        """Entries, re-arms and a blocked stance so far (each moves the logged metrics)."""
        self.blocked: str | None = None
        """Why the stance stays off for the rest of the run (:meth:`block`), or None."""
        self.paired = False
        """Guard collectives pair every compiled call across ranks (they act together)."""
        self.probe: str | None = None
        """The loop whose current batch probes an unseen signature with full guards."""

    def phase(self, loop: str) -> str:
        return self.loops[loop].phase if self.use_stance else "off"

    def steady(self, loop: str) -> bool:
        return self.use_stance and self.loops[loop].phase == "steady"

    # -- events ------------------------------------------------------------------------------

    def batch_done(self, loop: str, compiled: bool, under_stance: bool = True) -> None:
        """Count a finished batch; ``under_stance``: it ran under the stance throughout
        (a steady step counts only then: not a lookup window's batch with full guards,
        nor one that left the stance). Runs once per batch: kept short."""
        state = self.loops[loop]
        state.batches += 1
        if compiled:
            state.since_compile = 0
            state.pass_compiled = True
        else:
            state.since_compile += 1
        if loop == "train":
            if state.phase == "steady" and self.use_stance:
                self.steady_steps += under_stance
            else:
                self.warmup_steps_taken += 1
        if self.probe is not None:  # counted as the warm-up step it was
            if self.probe == loop and not compiled and state.phase != "steady":
                self.resume(loop)
            self.probe = None
        if not state.warmed_once and state.batches >= self.warmup_steps:
            state.warmed_once = True

    def pass_started(self, loop: str) -> None:
        self.loops[loop].pass_compiled = False

    def pass_done(self, loop: str, complete: bool) -> None:
        """An evaluation loop ended; ``complete`` is False for the sanity check or a cut-off pass."""
        state = self.loops[loop]
        if complete and not state.pass_compiled:
            state.clean_pass = True
        elif state.pass_compiled:
            state.clean_pass = False

    def is_decision_point(self, loop: str) -> bool:
        """Whether entry may be decided now (always in one process)."""
        if not self.collective or loop != "train":
            return True
        state = self.loops[loop]
        return state.batches >= self.warmup_steps and (
            (state.batches - self.warmup_steps) % self.stable_steps == 0
        )

    def ready(self, loop: str) -> bool:
        """This process's vote: the loop is warm and may enter the stance."""
        if not self.use_stance:
            return False
        state = self.loops[loop]
        if state.phase == "steady":
            return False
        if loop == "train":
            return state.warmed_once and state.since_compile >= self.stable_steps
        return state.clean_pass

    def enter(self, loop: str) -> None:
        """``loop`` enters the stance (the engine decided it: every rank's vote, H7)."""
        self.loops[loop].phase = "steady"
        self.changes += 1

    def resume(self, loop: str) -> None:
        """``loop`` is steady again after a batch that probed an unseen signature with full
        guards and compiled nothing (H26, :meth:`batch_done`): its own cache served the
        batch, so this rank resumes alone, with no vote."""
        self.loops[loop].phase = "steady"
        self.changes += 1

    def block(self, reason: str) -> bool:
        """The stance stays off for the rest of the run, for ``reason``; True the first
        time (to be told once)."""
        if self.blocked is not None:
            return False
        self.blocked = reason
        self.changes += 1
        return True

    def rearm(self, loop: str | None, step: int, reason: str, rank: int | None = None) -> None:
        """Send ``loop`` (or every loop when None) back to warm-up and record why.

        ``loop=None`` is for a rebuilt target: it also forgets the batch signatures.
        """
        self.changes += 1
        names = LOOPS if loop is None else (loop,)
        for name in names:
            state = self.loops[name]
            state.phase = "warmup"
            state.since_compile = 0
            state.clean_pass = False
            if loop is None:  # every compiled entry is gone: signatures must be seen again
                state.signatures.clear()
                state.last_signature = None
        record: dict[str, Any] = {"step": int(step), "reason": reason}
        if loop is not None:
            record["loop"] = str(loop)
        if rank is not None:
            record["rank"] = rank
        self.rearms.append(record)

    def steady_batch(
        self, loop: str, batch: Any, training: bool, warmed_training: bool | None
    ) -> tuple[bool, str | None, str | None]:
        """Whether a batch of ``loop`` may run steady: ``(steady, check, leave)``.

        A steady loop stays steady for a batch whose signature it has seen, in the mode it
        warmed up in. For an unseen signature it stays steady and each call checks its
        inputs (``check``, the described signature, H26); with :attr:`paired` calls the batch
        probes the signature with full guards instead (``leave`` says why), and the loop
        resumes at :meth:`batch_done` if it compiled nothing. Another mode leaves
        (``leave``). The caller re-arms the loop when ``leave`` is set
        (:func:`~guardtrain.engine.decisions.steady_batch` decides).

        Args:
            training: the model's ``training`` flag now.
            warmed_training: the flag the loop warmed up with (None: ``True`` in
                training only, the Trainer's rule).
        """
        state = self.loops[loop]
        steady = state.phase == "steady"
        same = state.same
        if same is not None and same.signature is state.last_signature and same.matches(batch):
            unseen, signature = False, None  # the previous batch's signature (most batches)
        else:
            unseen, signature = self.unseen(loop, batch)
        expected = (loop == "train") if warmed_training is None else warmed_training
        if not steady or not (unseen or training is not expected):
            return steady, None, None
        described = describe_signature(signature) if unseen else None
        leave, check, probe = decisions.steady_batch(
            loop, described, training, warmed_training, self.paired
        )
        if probe:
            self.probe = loop
        return leave is None, check, leave

    def unseen(self, loop: str, batch: Any) -> tuple[bool, Any]:
        """Whether ``batch``'s signature is new to ``loop``, and the signature, read in full.

        For a batch that the loop's matcher (:attr:`LoopState.same`) did not recognise.
        The loop gets a new matcher when the batch repeats the previous one's signature,
        so that the next such batch is recognised fast. Not after a change: shapes that
        vary from batch to batch (H26) pay nothing for a matcher they would never use.
        """
        state = self.loops[loop]
        signature = batch_signature(batch)
        last = state.last_signature
        found = self.new_signature(loop, signature)
        if state.last_signature is last:
            state.same = SameSignature.of(batch, last, state.same)
        return found, signature

    def new_signature(self, loop: str, signature: Any) -> bool:
        """Remember a batch signature; True when it was not seen before."""
        state = self.loops[loop]
        if signature == state.last_signature:
            return False
        state.last_signature = signature
        if signature in state.signatures:
            return False
        state.signatures.add(signature)
        return True
