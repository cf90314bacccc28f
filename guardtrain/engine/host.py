"""Host: how the engine reaches the outside world (messages, metrics, rank agreement).

Every adapter fills one in; the engine and its rooms (levers, targets, the warm
start) only talk through it, so none of them imports Lightning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

from guardtrain.engine.agreement import RankAgreement, SingleProcess

__all__ = ["Host"]


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


@dataclass(slots=True)
class Host:
    """How the engine reaches the outside world. Adapters fill it in."""

    info: Callable[[str], None] = print
    """One informational line (rank zero only)."""
    warn: Callable[[str], None] = _warn
    """One warning (rank zero only)."""
    log_metrics: Callable[[dict[str, float], int], None] | None = None
    """``(metrics, step)`` to the run's loggers, called on rank zero only; None: none."""
    agreement: RankAgreement = field(default_factory=SingleProcess)
    """Collective decisions (H7)."""
    sanity_checking: Callable[[], bool] = lambda: False
    """Whether the current evaluation pass is Lightning's sanity check."""
    owner: str = "guardtrain"
    """Named in messages: ``"GuardTuneCallback"``, ``"GuardTuner"``."""
    root_label: str = "<LightningModule>"
    """How the summary names a target that is the root module itself."""
