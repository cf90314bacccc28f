"""What a run measures about itself: compile counts, and Dynamo's per-call guard time.

:class:`CompileMonitor` counts the frame compilations of the targets and keeps their
reasons (Dynamo's own recompile reasons). The guard filter every target installs counts
them: Dynamo calls it once per frame compilation (graph-break resume frames included),
never for a lazily compiled backward, and it keeps working across Dynamo's ``reset()`` (H6).

:class:`LookupWindow` measures Dynamo's per-call guard and pre-graph time inside a run,
over a short window: PyTorch's profiler, on for a few compiled calls, records two events:

* ``TorchDynamo Cache Lookup``: one per call of a compiled frame; its length is the guard
  evaluation (walking the cache entries until one's guards pass).
* ``Pregraph bytecode``: the bytecode Dynamo runs between the guards and the graph
  (unpacking parameters and inputs into the graph's arguments).

Usage::

    window = LookupWindow()
    if window.start():             # False when another profiler is running
        ...                        # N compiled calls, or M training steps
        stats = window.stop(calls=N)
        stats.guard_us             # guard µs per compiled call (per lookup)
        stats.guard_us_per_call    # guard µs per model call / step (all frames)

Its own cost: starting the profiler costs a fixed amount; stopping it and reading the
events grow with the profiler events in the window (every aten op is recorded), so with
its compiled calls. While it is open each call runs slower, though the two events' own
lengths hardly change (one timestamp pair each). So: a window of a few steps, a few times
per run, never timing whole steps inside it. ``guardtrain bench`` reports the cost of its
own windows (``lookup_window_cost_us`` in the JSON).

Per-call figures are medians (of each frame position's events, :func:`_per_call`), not
means: on a shared machine a preemption inside one lookup stretches it by milliseconds.
The profiler is process-wide, one at a time: :meth:`start` returns ``False`` (and
:meth:`stop` then ``None``) when another is active, so a user's own profiling is never
disturbed.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from guardtrain._torch import compile_seconds, graph_compiles, profiler_enabled

__all__ = [
    "EVENTS_KEPT",
    "GUARD_EVENT",
    "PREGRAPH_EVENT",
    "CompileMonitor",
    "LookupStats",
    "LookupWindow",
    "compile_seconds",
    "profiler_active",
]

EVENTS_KEPT = 100
"""The compile events kept: the first ones of the training (a run's, and over every run)."""

GUARD_EVENT = "TorchDynamo Cache Lookup"
PREGRAPH_EVENT = "Pregraph bytecode"


@dataclass(slots=True)
class CompileMonitor:
    """Counts frame compilations of the callback's targets and keeps their reasons."""

    compiles: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    max_events: int = EVENTS_KEPT
    by_target: Counter[str] = field(default_factory=Counter)
    """Compiles per target, by the name the summary gives it."""
    started: tuple[float, int] | None = None
    """Torch's compile seconds and Dynamo's graph count in the process when the run started
    compiling; None outside :meth:`start` and :meth:`stop`."""
    before: tuple[float, int] = (0.0, 0)
    """The run's compile seconds and graphs up to its last :meth:`stop`."""

    def record(self, step: int, target: str, reason: str | None, label: str = "") -> None:
        self.compiles += 1
        self.by_target[label or target or "<root>"] += 1
        if len(self.events) < self.max_events:
            self.events.append(
                {"step": step, "target": target or "<root>", "reason": reason or "first compile"}
            )

    def start(self) -> None:
        """The run starts: its compile seconds and graphs count from here."""
        if self.started is None:
            self.started = (compile_seconds(), graph_compiles())

    def stop(self) -> None:
        """The run ends: its compile seconds and graphs stay as they are now."""
        self.before, self.started = self.spent(), None

    def spent(self) -> tuple[float, int]:
        """Torch's compile seconds (frames and backward graphs) and Dynamo's graphs (its
        ``unique_graphs``) in the run: every compile in the process while it ran, the
        targets' and any other, where :attr:`compiles` counts the targets' frame compiles
        (cache entries)."""
        if self.started is None:
            return self.before
        (seconds, graphs), (seconds0, graphs0) = self.before, self.started
        return seconds + compile_seconds() - seconds0, graphs + graph_compiles() - graphs0


profiler_active = profiler_enabled
"""Whether a PyTorch profiler (autograd or kineto) is recording in this process."""


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _per_call(durations: Sequence[float], calls: int | None) -> float | None:
    """Robust µs per model call: the sum over frame positions of each position's median.

    When every call ran the same ``k`` compiled frames (``len(durations) ==
    k * calls``), event ``i`` belongs to frame ``i % k``; the median per frame
    drops the few events that a preemption of the process stretched. Otherwise
    the mean per call.
    """
    if not calls:
        return None
    n = len(durations)
    if n == 0:
        return 0.0
    if n % calls:
        return sum(durations) / calls
    k = n // calls
    return sum(_median(durations[j::k]) for j in range(k))


@dataclass(frozen=True, slots=True)
class LookupStats:
    """What one window measured. Times in µs."""

    guard_durations_us: tuple[float, ...]
    """Length of each ``TorchDynamo Cache Lookup`` event, in order."""
    pregraph_durations_us: tuple[float, ...]
    """Length of each ``Pregraph bytecode`` event, in order."""
    calls: int | None
    """Model calls (or steps) in the window, as passed to :meth:`LookupWindow.stop`."""
    start_us: float
    """Cost of starting the profiler."""
    stop_us: float
    """Cost of stopping it (kineto collects the events here)."""
    parse_us: float
    """Cost of reading the two events out of the results."""
    window_s: float
    """Wall time between start and stop."""

    @property
    def lookups(self) -> int:
        """Calls of compiled frames in the window (one cache lookup each)."""
        return len(self.guard_durations_us)

    @property
    def guard_us(self) -> float:
        """Guard µs per compiled call: the median lookup (0.0 when nothing compiled ran)."""
        return _median(self.guard_durations_us)

    @property
    def guard_us_per_call(self) -> float | None:
        """Guard µs per model call or step (all its compiled frames), when ``calls`` is known."""
        return _per_call(self.guard_durations_us, self.calls)

    @property
    def pregraph_us_per_call(self) -> float | None:
        return _per_call(self.pregraph_durations_us, self.calls)

    @property
    def cost_us(self) -> float:
        """The window's own cost outside the measured calls: start + stop + parse."""
        return self.start_us + self.stop_us + self.parse_us


class LookupWindow:
    """A short profiler window that reports guard and pre-graph µs per compiled call.

    One instance can be started and stopped any number of times, never nested. Nothing
    of the process is redirected: what the profiler prints at its start and stop stays
    where it goes.
    """

    def __init__(self) -> None:
        self._prof: Any = None
        self._t0 = 0.0
        self._start_us = 0.0

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> bool:
        """Start recording. Returns ``False`` (and records nothing) if a profiler is running."""
        if self._prof is not None:
            raise RuntimeError("LookupWindow.start() called twice without stop()")
        if profiler_active():
            return False
        t0 = time.perf_counter()
        prof = torch.autograd.profiler.profile(use_cpu=True, record_shapes=False)
        prof.__enter__()
        t1 = time.perf_counter()
        self._prof = prof
        self._start_us = (t1 - t0) * 1e6
        self._t0 = t1
        return True

    def stop(self, calls: int | None = None) -> LookupStats | None:
        """Stop recording and read the events; ``None`` if the window was not started.

        Args:
            calls: model calls (or steps) run in the window, for the per-call figures.
        """
        prof = self._prof
        if prof is None:
            return None
        self._prof = None
        t1 = time.perf_counter()
        prof.__exit__(None, None, None)
        t2 = time.perf_counter()
        guard: list[tuple[int, float]] = []
        pregraph: list[tuple[int, float]] = []
        for event in prof.kineto_results.events():
            name = event.name()
            if name == GUARD_EVENT:
                guard.append((event.start_ns(), event.duration_ns() / 1e3))
            elif name == PREGRAPH_EVENT:
                pregraph.append((event.start_ns(), event.duration_ns() / 1e3))
        guard.sort()
        pregraph.sort()
        t3 = time.perf_counter()
        return LookupStats(
            guard_durations_us=tuple(d for _, d in guard),
            pregraph_durations_us=tuple(d for _, d in pregraph),
            calls=calls,
            start_us=self._start_us,
            stop_us=(t2 - t1) * 1e6,
            parse_us=(t3 - t2) * 1e6,
            window_s=t1 - self._t0,
        )
