"""Measure Dynamo's per-call guard and pre-graph time inside a run, over a short window.

:class:`LookupWindow` turns PyTorch's profiler on for a few compiled calls and
reads two of its events:

* ``TorchDynamo Cache Lookup``: one per call of a compiled frame; its length is
  the guard evaluation (walking the cache entries until one's guards pass).
* ``Pregraph bytecode``: the bytecode Dynamo runs between the guards and the
  graph (unpacking parameters and inputs into the graph's arguments).

Usage::

    window = LookupWindow()
    if window.start():             # False when another profiler is running
        ...                        # N compiled calls, or M training steps
        stats = window.stop(calls=N)
        stats.guard_us             # guard µs per compiled call (per lookup)
        stats.guard_us_per_call    # guard µs per model call / step (all frames)

Its own cost (torch 2.13 CPU, 2 shared cores, medians; ``python -m
guardtrain.bench --window-cost`` measures it again): starting the profiler
about 0.1-0.3 ms, stopping it and reading the events about 1-3 ms for a window
of 20 inductor calls of the 12-block transformer (stopping grows with the
number of events: every aten op in the window is recorded too). While the
window is open, every recorded op costs about 1 µs more, so do not time whole
steps inside it; the two events' own lengths are barely affected (one
timestamp pair each). Measure for a window of a few steps, not every step.

The profiler is process-wide and only one can run at a time: :meth:`start`
returns ``False`` (and :meth:`stop` then returns ``None``) when another
profiler is active, so a user's own profiling is never disturbed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["GUARD_EVENT", "PREGRAPH_EVENT", "LookupStats", "LookupWindow", "profiler_active"]

GUARD_EVENT = "TorchDynamo Cache Lookup"
PREGRAPH_EVENT = "Pregraph bytecode"


def profiler_active() -> bool:
    """Whether a PyTorch profiler (autograd or kineto) is recording in this process."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return True
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else False


@dataclass(frozen=True, slots=True)
class LookupStats:
    """What one window measured. Times in µs."""

    lookups: int
    """``TorchDynamo Cache Lookup`` events: calls of compiled frames in the window."""
    pregraph_events: int
    """``Pregraph bytecode`` events."""
    guard_us_total: float
    pregraph_us_total: float
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
    def guard_us(self) -> float:
        """Guard µs per compiled call (per lookup); 0.0 when nothing compiled ran."""
        return self.guard_us_total / self.lookups if self.lookups else 0.0

    @property
    def pregraph_us(self) -> float:
        """Pre-graph µs per compiled call (per ``Pregraph bytecode`` event)."""
        return self.pregraph_us_total / self.pregraph_events if self.pregraph_events else 0.0

    @property
    def guard_us_per_call(self) -> float | None:
        """Guard µs per model call or step (all compiled frames it ran), when ``calls`` is known."""
        return self.guard_us_total / self.calls if self.calls else None

    @property
    def pregraph_us_per_call(self) -> float | None:
        return self.pregraph_us_total / self.calls if self.calls else None

    @property
    def cost_us(self) -> float:
        """The window's own cost outside the measured calls: start + stop + parse."""
        return self.start_us + self.stop_us + self.parse_us

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            guard_us=self.guard_us,
            pregraph_us=self.pregraph_us,
            guard_us_per_call=self.guard_us_per_call,
            pregraph_us_per_call=self.pregraph_us_per_call,
            cost_us=self.cost_us,
        )
        return d


@contextlib.contextmanager
def _silent_stderr(enabled: bool) -> Iterator[None]:
    """Send file descriptor 2 to /dev/null (kineto prints two lines per start/stop)."""
    if not enabled:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class LookupWindow:
    """A short profiler window that reports guard and pre-graph µs per compiled call.

    Args:
        quiet: hide the two lines kineto prints on stderr at each start and
            stop (file descriptor 2 is redirected during those two calls only).

    One instance can be started and stopped any number of times, never nested.
    """

    def __init__(self, quiet: bool = True) -> None:
        self.quiet = quiet
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
        with _silent_stderr(self.quiet):
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
        with _silent_stderr(self.quiet):
            prof.__exit__(None, None, None)
        t2 = time.perf_counter()
        lookups = pregraph = 0
        guard_ns = pregraph_ns = 0
        for event in prof.kineto_results.events():
            name = event.name()
            if name == GUARD_EVENT:
                lookups += 1
                guard_ns += event.duration_ns()
            elif name == PREGRAPH_EVENT:
                pregraph += 1
                pregraph_ns += event.duration_ns()
        t3 = time.perf_counter()
        return LookupStats(
            lookups=lookups,
            pregraph_events=pregraph,
            guard_us_total=guard_ns / 1e3,
            pregraph_us_total=pregraph_ns / 1e3,
            calls=calls,
            start_us=self._start_us,
            stop_us=(t2 - t1) * 1e6,
            parse_us=(t3 - t2) * 1e6,
            window_s=t1 - self._t0,
        )

    def __enter__(self) -> LookupWindow:
        self.result: LookupStats | None = None
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.result = self.stop()
