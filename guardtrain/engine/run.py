"""One run's parts, as the engine's parts share them: :class:`Run` and :class:`RunState`.

The engine (:class:`~guardtrain.engine.engine.GuardEngine`) makes one :class:`Run` and
hands it to each of its parts (:class:`~guardtrain.engine.repairs.Repairs`,
:class:`~guardtrain.engine.batch_checks.BatchChecks`, the summary). A new run replaces its
per-run fields (:meth:`GuardEngine.setup`), so every part sees the new ones. A part's
unit test makes a :class:`Run` of fakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from guardtrain.engine import levers as _levers
from guardtrain.engine.changes import ChangeLog
from guardtrain.engine.config import GuardConfig
from guardtrain.engine.counters import Counters
from guardtrain.engine.findings import Checks
from guardtrain.engine.handover import Ledger
from guardtrain.engine.host import Host
from guardtrain.engine.levers import Levers
from guardtrain.engine.lookup import LookupMeter
from guardtrain.engine.optimizers import OptimizerSteps
from guardtrain.engine.phases import Loop, PhaseMachine
from guardtrain.engine.process import PROCESS, DynamoSettings
from guardtrain.engine.steps import StepClock
from guardtrain.engine.targets import Hooks, TargetSet
from guardtrain.profiling import CompileMonitor

__all__ = ["TRAIN", "Run", "RunState"]

# A plain string on the per-batch path: an Enum member lookup costs more than the check.
TRAIN: str = Loop.TRAIN.value


@dataclass(slots=True)
class RunState:
    """What the engine itself remembers of one run (its parts keep the rest)."""

    active: bool = False
    loop: str | None = None
    pending: set[str] = field(default_factory=set)
    """Loops whose next batch starts with the boundary re-check."""
    rank: int | None = None
    swaps_parameters: str | None = None
    """The strategy (or ``fully_shard``) that swaps parameter objects around every forward."""
    all_rearms: list[dict[str, Any]] | None = None
    entered_together: bool = False
    uncompiled: list[str] = field(default_factory=list)
    compiles_at_batch: int = 0
    repairs_due: bool = False
    """A batch compiled and a backward of it comes after its end (the HF ``Trainer``: a
    batch is one model call): the repairs that change what a target runs wait for
    :meth:`~guardtrain.engine.engine.GuardEngine.backward_done`, since a checkpointed
    block runs its forward again in the backward and must run the same graph (H52)."""
    weigh_due: bool | None = None
    """A training batch whose backward comes after its end weighs the checks (H51) once
    that backward ran (H52): whether the batch was steady; None when nothing waits."""
    breaks_due: list[tuple[Any, list[Any]]] = field(default_factory=list)
    """``(target, its graph breaks)`` found after a compile, acted on when the repairs
    run (at once, or after the backward when they wait, H52)."""
    splits_due: list[tuple[Any, str, Any]] = field(default_factory=list)
    """``(target, why, the change that recurred)``: a default target rebuilt too often, split
    into its parts when the repairs run (H51), not inside its own call where it was caught."""
    unheard_compiles: int = 0
    """Compiles that no phase hears of, left out of the batch's compiles: those of targets
    handed over to full guards (H51, Dynamo's own recompiles) and of compiled optimizer
    steps (H49), which say nothing of the model's entries."""
    stance_on: bool = False
    """The current batch is steady: each target call runs under the stance, set for that
    call alone (H41), or directly (turbo)."""
    states_kept: bool = False
    """The stance is off only for a loop pass's start or end: the targets' known states
    stay (:meth:`~guardtrain.engine.repairs.Repairs.set_steady`, H46)."""
    stance_at_start: bool = False
    """The stance was on when the current training batch started."""
    logged_changes: int = -1
    """:meth:`Run.changes` when the metrics were last logged."""
    caught: ChangeLog = field(default_factory=ChangeLog)
    """Changes caught before a call (H32-H35), by kind."""
    summary_logged: bool = False


@dataclass(slots=True, kw_only=True)
class Run:
    """The parts of one run that the engine's parts read and change."""

    config: GuardConfig
    """This run's arguments: the adapter's, with ``setup``'s ``compile_kwargs``."""
    host: Host
    """Messages, metrics and rank agreement (the adapter's)."""
    levers: Levers
    """The levers this torch and strategy allow."""
    targets: TargetSet
    """The compiled targets (kept for the next run on the same modules, H28)."""
    machine: PhaseMachine
    """Each loop's phase: every transition goes through it."""
    monitor: CompileMonitor
    """The compiles, counted and recorded."""
    dynamo: DynamoSettings
    """The run's Dynamo config, guard collectives and stance values
    (:data:`~guardtrain.engine.process.PROCESS` made it)."""
    checks: Checks = field(default_factory=Checks)
    """What the checks remember."""
    lookup: LookupMeter = field(default_factory=LookupMeter)
    """The lookup windows."""
    state: RunState = field(default_factory=RunState)
    """What the engine remembers of the run."""
    earlier: Counters = field(default_factory=Counters)
    """The earlier runs' counters (a checkpoint's, or earlier trainer calls'), held whole."""
    ledger: Ledger = field(default_factory=Ledger)
    """What the hand-over decisions read: rebuilds, the checks' cost (H51)."""
    optimizers: OptimizerSteps = field(default_factory=OptimizerSteps)
    """The compiled optimizer steps (``compile_optimizer=True``, H49)."""
    steps: StepClock = field(default_factory=StepClock)
    """The steady training steps' wall time (``summary()["step"]``)."""

    @classmethod
    def first(cls, config: GuardConfig, host: Host, hooks: Hooks) -> Run:
        """An engine's first run: its targets report to ``hooks``."""
        levers = _levers.requested(config)
        return cls(
            config=config,
            host=host,
            levers=levers,
            targets=TargetSet(config, levers, hooks),
            machine=_machine(config),
            monitor=CompileMonitor(),
            dynamo=PROCESS.start_run(host.owner),
        )

    def renew(self) -> None:
        """A new run, of :attr:`config`: fresh parts, the compiled targets kept (H28)."""
        self.machine = _machine(self.config)
        self.monitor = CompileMonitor()
        self.dynamo = PROCESS.start_run(self.host.owner)
        self.levers = _levers.requested(self.config)
        self.targets = self.targets.next_run(self.config, self.levers)
        self.checks, self.lookup, self.state = Checks(), LookupMeter(), RunState()
        self.ledger = Ledger()
        self.steps = StepClock()

    def train_batches(self) -> int:
        """Training batches of this run and the earlier ones (a checkpoint's included)."""
        return self.machine.loops[TRAIN].batches + self.earlier.train_batches

    def changes(self) -> int:
        """Counts what moves the logged metrics: compiles, entries, re-arms, a blocked
        stance, a lookup window's result. Counted here alone: the logger is called only
        when it moved."""
        return self.machine.changes + self.monitor.compiles + self.lookup.results

    def paired(self) -> bool:
        """Ranks must act together: guard collectives pair every compiled call across ranks
        (the phase machine's ``paired``, set with the run's world size)."""
        return self.machine.paired

    def any_rank(self, flag: bool) -> bool:
        """``flag`` on any rank (one collective when calls are paired), else this rank's."""
        if self.paired():
            return self.host.agreement.any(flag)
        return flag


def _machine(config: GuardConfig) -> PhaseMachine:
    lv = config.levers
    return PhaseMachine(lv.warmup_steps, lv.stable_steps, lv.use_stance)
