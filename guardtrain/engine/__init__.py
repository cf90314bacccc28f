"""guardtrain's engine: everything a run decides, with no Lightning import.

* :mod:`~guardtrain.engine.config`: the adapters' arguments, written once and validated (:class:`GuardConfig`).
* :mod:`~guardtrain.engine.phases`: the warm-up -> steady -> re-armed machine per loop.
* :mod:`~guardtrain.engine.decisions`: per-batch, audit and entry decisions, pure.
* :mod:`~guardtrain.engine.session`: the stance and Dynamo config, saved and restored.
* :mod:`~guardtrain.engine.agreement`: how ranks decide together.
* :mod:`~guardtrain.engine.report`: the summary table and metrics.
* :mod:`~guardtrain.engine.breaks`: where Dynamo's graph breaks are (reason, file, line).
* :mod:`~guardtrain.engine.warmstart`: the compile cache saved and loaded (``compile_cache``).
* :mod:`~guardtrain.engine.core`: :class:`GuardEngine`, which the adapters drive.
"""

from guardtrain.engine.agreement import (
    RankAgreement,
    ReduceAgreement,
    SingleProcess,
    TorchDistributed,
)
from guardtrain.engine.config import DISABLE_ENV, GuardConfig, make_config
from guardtrain.engine.core import GuardEngine, Host
from guardtrain.engine.phases import LOOPS, Loop, Phase, PhaseMachine
from guardtrain.engine.session import StanceSession

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
    "StanceSession",
    "TorchDistributed",
    "make_config",
]
