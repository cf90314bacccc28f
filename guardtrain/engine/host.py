"""Host: how the engine reaches the outside world (messages, metrics, rank agreement).

Every adapter fills one in; the engine and its parts (levers, targets, the warm
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
    root_label: str = "<model>"
    """How the summary names a target that is the root module itself."""
    root_as: str = "the model"
    """How messages name the root module, as the user knows it."""
    part_as: str = "`model.{}`"
    """How messages name a module inside the root (``{}``: its name there)."""
    live: Callable[[], bool] = lambda: True
    """Whether the adapter's run is still going. A run that is not, and still holds
    modules, is released by the next run on them (H45)."""
    on_release: Callable[[], None] = lambda: None
    """Called after another run released this one (H45): the adapter removes what it
    put on the model (its hooks) and forgets the run."""

    def known_as(self, name: str) -> str:
        """The module ``name`` of the root (``""``: the root) as messages name it."""
        return self.part_as.format(name) if name else self.root_as
