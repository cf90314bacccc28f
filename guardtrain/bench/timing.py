"""The bench's clocks: each timed call or step by the calling thread's CPU time and by the
wall clock, and which of the two decides.

On a shared machine the wall clock counts other processes' load: a fixed loop reads the
same by either clock when the machine is quiet, and longer by the wall clock than by its
CPU time with busy processes beside it. At one torch thread the whole CPU step (forward,
backward, optimizer) runs on the calling thread, so its CPU time is the step's cost and
decides every ratio and ``--check``; with more threads torch's pool does part of the
work, and the wall clock decides. Every result says which (``clock``).

>>> clock_of(1), clock_of(4), clock_of(None)
('cpu', 'wall', 'wall')
>>> describe("cpu")
"the calling thread's CPU time"
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

__all__ = ["CLOCKS", "clock_of", "describe", "threads"]

CLOCKS: dict[str, Callable[[], int]] = {
    "cpu": time.thread_time_ns,
    "wall": time.perf_counter_ns,
}
"""Each clock's reader, in nanoseconds."""


def clock_of(threads: int | None) -> str:
    """The clock that decides: ``cpu`` at one torch thread, else ``wall``."""
    return "cpu" if threads == 1 else "wall"


def describe(clock: str) -> str:
    """How a report names ``clock``."""
    return "the calling thread's CPU time" if clock == "cpu" else "the wall clock"


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads at ``n`` while the block runs (None or 0: torch's own)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
