"""Lookup windows: the guard and pre-graph time per training step, profiled once per run.

At the first entry into the stance a window of ``lookup_window`` training
batches runs with full guards, then one of as many batches under the stance
(H27); ``summary()["lookup_us"]`` reports both and the saving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LookupMeter"]


@dataclass(slots=True)
class LookupMeter:
    """One run's lookup windows: the one being measured, and what the others measured."""

    measure: str | None = None
    """The lookup window being measured: ``"full"``, ``"steady"`` or None."""
    measure_left: int = 0
    """Training batches left in the window."""
    window: Any = None
    """The running profiler window, or None."""
    lookup: dict[str, float] = field(default_factory=dict)
    """µs per step: ``full_guards``, ``steady`` and the ``saving``."""
    lookup_calls: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per window: training steps measured and compiled calls (cache lookups) seen."""
    results: int = 0
    """Windows under the stance recorded so far (each is a change to log)."""

    def start(self, size: int) -> None:
        """Measure, from the next training batch, a window with full guards."""
        self.measure, self.measure_left = "full", size

    def batch(self) -> bool:
        """One batch of a lookup window; returns whether it runs under the stance.

        False for a batch of the window with full guards: a compile there re-arms,
        as in an audit.
        """
        if self.window is None:
            from guardtrain.profiling import LookupWindow

            self.window = LookupWindow()
            if not self.window.start():  # another profiler is running: do not disturb it
                self.window = None
                self.measure = None
                return True
        return self.measure != "full"

    def end_batch(self, size: int) -> None:
        """After a measured training batch: a finished window records its result."""
        self.measure_left -= 1
        if self.measure_left <= 0 and self.window is not None:
            self.close(size, size)

    def close(self, steps: int, size: int) -> None:
        """Stop the window after ``steps`` training batches and record what it measured.

        A recorded window under the stance counts in :attr:`results` (a change to log);
        after the window with full guards, one of ``size`` batches under the stance follows.
        """
        stats = self.window.stop(calls=max(steps, 1))
        self.window = None
        if stats is None or steps < 1:
            self.measure = None
            return
        per_step = (stats.guard_us_per_call or 0.0) + (stats.pregraph_us_per_call or 0.0)
        which = "full_guards" if self.measure == "full" else "steady"
        self.lookup_calls[which] = {"steps": steps, "lookups": stats.lookups}
        if self.measure == "full":
            self.lookup["full_guards"] = per_step
            self.measure, self.measure_left = "steady", size
            return
        self.lookup["steady"] = per_step
        full = self.lookup.get("full_guards")
        if full:
            self.lookup["saving"] = 1.0 - per_step / full
        self.measure = None
        self.results += 1

    def cut(self, size: int) -> None:
        """Another loop starts: a window counts every compiled call, and that loop's must
        not count as training's (H27); close it on the training batches it measured."""
        if self.window is not None:
            self.close(size - self.measure_left, size)

    def stop(self) -> None:
        """Stop measuring (a re-arm or the end of the run); the next entry measures again."""
        if self.window is not None:
            self.window.stop()
            self.window = None
        self.measure = None
