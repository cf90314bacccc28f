"""guardtrain's engine: everything a run decides, with no Lightning import.

* :mod:`~guardtrain.engine.engine`: :class:`GuardEngine`, which the adapters drive: a
  run's lifecycle, its loops and batches, and what it shows them.
* :mod:`~guardtrain.engine.run`: the parts of one run that the engine's parts share.
* :mod:`~guardtrain.engine.batch_checks`: the checks around a batch, and entry into the stance.
* :mod:`~guardtrain.engine.repairs`: re-arms, rebuilds, the steady switch, and the
  answers to what the targets report.
* :mod:`~guardtrain.engine.host`: :class:`Host`, how the engine reaches the outside.
* :mod:`~guardtrain.engine.config`: the adapters' arguments, written once and validated (:class:`GuardConfig`).
* :mod:`~guardtrain.engine.levers`: the levers the installed torch and the strategy allow.
* :mod:`~guardtrain.engine.targets`: the compiled targets: activate, reuse, split on
  graph breaks, restore.
* :mod:`~guardtrain.engine.findings`: the boundary re-check, changes caught before a call,
  misses, audits; they return findings, the engine's parts act.
* :mod:`~guardtrain.engine.changes`: changes caught before a call, and what each calls for.
* :mod:`~guardtrain.engine.lookup`: the lookup windows (guard time per step, profiled).
* :mod:`~guardtrain.engine.summary`: ``summary()``, the run's report as a plain dict.
* :mod:`~guardtrain.engine.counters`: the training's one counter set, which a checkpoint
  and the next run keep whole.
* :mod:`~guardtrain.engine.metrics`: the ``guard/*`` metrics.
* :mod:`~guardtrain.engine.table`: the end-of-run table, and what ``auto`` chose.
* :mod:`~guardtrain.engine.phases`: the warm-up -> steady -> re-armed machine per loop.
* :mod:`~guardtrain.engine.decisions`: per-batch, audit and entry decisions, pure.
* :mod:`~guardtrain.engine.process`: everything guardtrain changes in the process, in one
  place (:data:`PROCESS`): Dynamo config, stance values, wrappers, take-overs, live runs.
* :mod:`~guardtrain.engine.holders`: the runs that hold modules (a dead one is released).
* :mod:`~guardtrain.engine.agreement`: how ranks decide together.
* :mod:`~guardtrain.engine.breaks`: where Dynamo's graph breaks are (reason, file, line).
* :mod:`~guardtrain.engine.warmstart`: the compile cache saved and loaded (``compile_cache``).
* :mod:`~guardtrain.engine.optimizers`: the run's compiled optimizer steps
  (``compile_optimizer=True``).
* :mod:`~guardtrain.engine.steps`: the bottom line, the steady training steps' time and
  the saving.
* :mod:`~guardtrain.engine.handover`: the compile margin, and when a target is handed
  over to full guards (H51); pure decisions on plain values.
"""

from guardtrain.engine.agreement import (
    RankAgreement,
    ReduceAgreement,
    SingleProcess,
    TorchDistributed,
)
from guardtrain.engine.config import DISABLE_ENV, GuardConfig, make_config
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import LOOPS, Loop, Phase, PhaseMachine
from guardtrain.engine.process import PROCESS, DynamoSettings, ProcessState

__all__ = [
    "DISABLE_ENV",
    "LOOPS",
    "GuardConfig",
    "GuardEngine",
    "Host",
    "Loop",
    "Phase",
    "PhaseMachine",
    "RankAgreement",
    "ReduceAgreement",
    "SingleProcess",
    "DynamoSettings",
    "PROCESS",
    "ProcessState",
    "TorchDistributed",
    "make_config",
]
