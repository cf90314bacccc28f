"""The ``guard/*`` metrics given to the framework's loggers: phase, compiles, re-arms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from guardtrain.engine.host import Host
from guardtrain.engine.phases import PHASE_NUMBERS

__all__ = ["MetricsLog", "metrics"]


def metrics(phase: str, compiles: int, rearms: int) -> dict[str, float]:
    """The ``guard/*`` metrics: phase number (0 off, 1 warm-up, 2 steady), counts."""
    return {
        "guard/phase": float(PHASE_NUMBERS[phase]),
        "guard/compiles": float(compiles),
        "guard/rearms": float(rearms),
    }


@dataclass(slots=True)
class MetricsLog:
    """What one run last gave the loggers: each value is logged when it moves."""

    logged: tuple[int, int, int] | None = None
    lookup_logged: bool = False

    def log(
        self,
        host: Host,
        current: tuple[str, int, int],
        lookup: dict[str, float],
        step: Callable[[], int],
    ) -> None:
        """Log ``(phase, compiles, rearms)`` and the steady lookup time, if either moved.

        Rank zero only; ``step`` gives the training step the values belong to.
        """
        key = (PHASE_NUMBERS[current[0]], current[1], current[2])
        if key == self.logged and ("steady" not in lookup or self.lookup_logged):
            return
        self.logged = key
        if host.agreement.rank != 0:
            return
        values = metrics(*current)
        if "steady" in lookup and not self.lookup_logged:
            self.lookup_logged = True
            values["guard/lookup_us"] = lookup["steady"]
        if host.log_metrics is not None:
            host.log_metrics(values, step())
