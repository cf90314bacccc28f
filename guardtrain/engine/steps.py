"""The bottom line: the steady training step's time, and what guardtrain saved in it.

The adapters mark each training step (:meth:`~guardtrain.engine.engine.GuardEngine.step_start`
and ``step_end``: Lightning's and ``GuardTuner``'s batch, the HF ``Trainer``'s optimizer
step). A step counts when the training loop was steady from its start to its end, with
no compile and no re-arm in between; the last :data:`STEPS_KEPT` such steps are kept.
The saving comes from the lookup windows (:mod:`guardtrain.engine.lookup`): guard and
pre-graph time per step with full guards, minus the same under the stance, profiled in
the same run.

What a step's time is. On the CPU, the wall time between the two marks. On CUDA the
kernels run asynchronously: the host's time between the marks is only its own share
(it runs ahead until a full launch queue or the user's own sync stops it). There the
marks record CUDA events on the current stream instead, and a step's time is the time
between them on the device: the whole step in both regimes (a host-bound step leaves the
device waiting between the events, a device-bound one keeps it busy). Nothing
synchronizes: an event pair is read once the device has passed its end
(``Event.query()``), at a later mark or at the summary, and a step still in flight then
is not counted. The saving is host time: on a device-bound step it shortens the host's
share, not the step.

>>> clock = StepClock()
>>> clock.times.extend([900_000, 1_000_000, 3_000_000])  # ns: three steady steps
>>> figures = bottom_line(clock, {"full_guards": 110.0, "steady": 10.0})
>>> figures["median_us"], figures["saved_us"], figures["saved_share"]
(1000.0, 100.0, 0.0909)
>>> figures["guards_share"]
0.01
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STEPS_KEPT", "StepClock", "bottom_line", "cuda_events", "step_metrics"]

STEPS_KEPT = 512
"""Steady steps whose wall time is kept (the median is of these)."""

_DIRECT_NOTE = (
    "direct dispatch: the steady figure is what Dynamo's entry path still costs; the "
    "direct calls' own checks (a few µs a call: docs/bench.md) are not profiled"
)


_ESTIMATE_NOTE = (
    "estimated: the full guard checks timed in the run's check windows, times the calls "
    "of a warm-up step (measure_lookup=True profiles it)"
)


@dataclass(slots=True)
class StepClock:
    """The time of the steady training steps (ns), and the step being timed."""

    times: deque[int] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    started: int | None = None
    mark: tuple[bool, int, int] = (False, 0, 0)
    """At the step's start: (the training loop steady, compiles, re-arms)."""
    events: Callable[[], Any] | None = None
    """On CUDA: makes a timing event (``torch.cuda.Event(enable_timing=True)``); the steps
    are then timed between events on the device (the module docstring); None: the wall
    clock."""
    begun: Any = None
    """The event recorded at the step's start."""
    pending: deque[tuple[Any, Any]] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    """Event pairs of steady steps that the device may not have finished yet."""

    def start(self, mark: tuple[bool, int, int]) -> None:
        self.started, self.mark = time.perf_counter_ns(), mark
        if self.events is not None:
            self.begun = self.events()
            self.begun.record()

    def end(self, mark: tuple[bool, int, int]) -> None:
        """Keep the step's time if it was steady throughout (``mark`` as at its start)."""
        if self.started is not None and mark[0] and mark == self.mark:
            if self.events is None:
                self.times.append(time.perf_counter_ns() - self.started)
            else:
                ended = self.events()
                ended.record()
                self.pending.append((self.begun, ended))
                self.collect()
        self.started, self.begun = None, None

    def collect(self) -> None:
        """Move the steps the device has finished from :attr:`pending` to :attr:`times`
        (in order; never waits)."""
        pending = self.pending
        while pending and pending[0][1].query():
            begun, ended = pending.popleft()
            self.times.append(round(begun.elapsed_time(ended) * 1e6))  # ms -> ns


def cuda_events(modules: Any) -> Callable[[], Any] | None:
    """:attr:`StepClock.events` for a run whose ``modules`` hold a CUDA parameter, else None."""
    import torch

    if not torch.cuda.is_available():
        return None
    for module in modules:
        p = next(module.parameters(), None)
        if p is not None and p.device.type == "cuda":
            return functools.partial(torch.cuda.Event, enable_timing=True)
    return None


def bottom_line(
    clock: StepClock,
    lookup: dict[str, float],
    direct: bool = False,
    counts: dict[str, Any] | None = None,
    estimated: float | None = None,
) -> dict[str, Any]:
    """``summary()["step"]``: the median steady step, the saving per step and its shares.

    ``saved_share`` is the saving as a share of the step it came from (the steady step
    plus the saving: the step with full guards); ``guards_share`` the share of the
    steady step that guards still take. The lookup windows measure both
    (``measure_lookup=True``); without them the saving is ``estimated`` (µs per step that
    full guards would spend, timed in the run: :func:`guardtrain.engine.summary`'s
    estimate), ``note`` says so, and ``guards_share`` is None. ``None`` where neither
    is known, and ``why`` says why. ``direct``: the run dispatches directly (turbo);
    ``note`` says what the steady figure then leaves out.
    ``counts`` (the run's counters: the steady calls with full guards and directly, the
    ``generate()`` calls served, the guards a full-guards call evaluates, the bench's
    figure for the preset) are added as they are, measured or not.
    """
    clock.collect()
    times = list(clock.times)
    median = statistics.median(times) / 1e3 if len(times) >= 2 else None
    saved, note = _saving(lookup, direct, estimated)
    why = None
    if median is None:
        why = "fewer than 2 steady training steps"
    elif saved is None:
        why = "not measured in this run (no full guard check was timed)"
    return {
        "steady_steps": len(times),
        "median_us": None if median is None else round(median, 1),
        "saved_us": None if saved is None else round(saved, 1),
        "saved_share": None
        if median is None or saved is None
        else round(saved / (median + saved), 4),
        "guards_share": None
        if median is None or "steady" not in lookup
        else round(lookup["steady"] / median, 4),
        "why": why,
        "note": note,
        **(counts or {}),
    }


def _saving(
    lookup: dict[str, float], direct: bool, estimated: float | None
) -> tuple[float | None, str | None]:
    """``(saved µs per step, note)``: the lookup windows' profile where there is one, else
    the estimate, else None."""
    if "steady" in lookup:
        return lookup["full_guards"] - lookup["steady"], _DIRECT_NOTE if direct else None
    if estimated is not None:
        return estimated, _ESTIMATE_NOTE
    return None, None


def step_metrics(step: dict[str, Any]) -> dict[str, float]:
    """The metrics logged once per training pass: ``guard/step_ms`` (the median steady
    step) and ``guard/saved_us_per_step``, each where measured."""
    values = {"guard/step_ms": step["median_us"] / 1e3} if step["median_us"] else {}
    if step["saved_us"] is not None:
        values["guard/saved_us_per_step"] = step["saved_us"]
    return values
