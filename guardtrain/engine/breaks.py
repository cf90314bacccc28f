"""Where the graph breaks are: Dynamo's reason with the user's file and line (H20).

Dynamo keeps a ``GraphCompileReason`` for every graph break it makes, with the
reason and the user stack it was tracing (:func:`guardtrain._torch.graph_break_records`).
It fills that list whether or not logging is on, and Dynamo's ``reset()`` empties it.
Reading it needs no log handler and no config change: nothing is printed and no global
state changes.

A :class:`BreakLog` remembers how far it has read; :meth:`BreakLog.new` returns
the breaks recorded since, one per reason and place.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch

from guardtrain._torch import graph_break_records, skipped_by_dynamo
from guardtrain.compile import trampoline as _trampoline

__all__ = [
    "BreakLog",
    "GraphBreak",
    "describe",
    "entered",
    "innermost",
    "short_path",
    "skipped_at_top",
]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRAMPOLINE_FILE = os.path.normcase(os.path.abspath(_trampoline.__file__))
_PACKAGE_DIRS = ("site-packages", "dist-packages")


@dataclass(frozen=True, slots=True)
class GraphBreak:
    """One graph break: Dynamo's reason (first line) and where it happened."""

    reason: str
    where: str
    """``path:line in function`` of the innermost user frame; when that frame is
    in torch's own files, ``, called from path:line`` names the innermost frame
    outside them. Empty when this torch does not record the place."""
    entered: tuple[tuple[str, str, int], ...] = ()
    """``(file, function, line)`` of each frame a guardtrain trampoline called when
    the break was traced from one (a target's ``forward``)."""
    frames: tuple[tuple[str, str, int], ...] = ()
    """``(file, function, line)`` of every user frame Dynamo was tracing, outermost first:
    which modules' ``forward`` the break is in (:func:`innermost`)."""

    def describe(self) -> str:
        return f"{self.reason} at {self.where}" if self.where else self.reason


def describe(breaks: list[GraphBreak]) -> str:
    """The breaks as one line, ``"; "``-separated (empty for none)."""
    return "; ".join(b.describe() for b in breaks)


def entered(breaks: list[GraphBreak], func: Any) -> list[GraphBreak]:
    """The breaks traced from a trampoline into ``func`` (a target's ``forward``)."""
    code = getattr(func, "__code__", None)
    if code is None:
        return []
    return [
        b
        for b in breaks
        if any(
            file == code.co_filename and name == code.co_name and line >= code.co_firstlineno
            for file, name, line in b.entered
        )
    ]


def skipped_at_top(func: Any) -> bool:
    """Whether Dynamo skips ``func``'s frame when it runs as a top-level frame (torch's
    own modules, ``nn.Transformer``): after a graph break at the call into it, it runs
    uncompiled, with no resume frame that would show the break."""
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    skipped = skipped_by_dynamo(code)
    if skipped is None:  # a torch that lays its rules out otherwise: judge by the file
        return code.co_filename.startswith(_TORCH_DIR)
    return skipped


def short_path(filename: str) -> str:
    """A file as users recognise it: inside an installed package, from the package down
    (``transformers/modeling_utils.py``); below the working directory, relative to it."""
    parts = filename.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in _PACKAGE_DIRS:
            return "/".join(parts[i + 1 :])
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if rel.startswith("..") else rel


def _first_line(reason: str) -> str:
    lines = reason.strip().splitlines()
    line = lines[0].strip() if lines else "unknown"
    if line.startswith("generic_jump"):  # Dynamo's name for a branch on a tensor's value
        line = f"data-dependent branching ({line})"
    return line


def _is_trampoline(frame: Any) -> bool:
    return (
        frame.name in (_trampoline.TRAMPOLINE_NAME, _trampoline.SHARED_TRAMPOLINE_NAME)
        and os.path.normcase(os.path.abspath(frame.filename)) == _TRAMPOLINE_FILE
    )


def _where(stack: list[Any]) -> str:
    frames = [f for f in stack if not _is_trampoline(f)]
    if not frames:
        return ""
    inner = frames[-1]
    where = f"{short_path(inner.filename)}:{inner.lineno} in {inner.name}"
    if inner.filename.startswith(_TORCH_DIR):
        outside = [f for f in frames if not f.filename.startswith(_TORCH_DIR)]
        if outside:
            where += f", called from {short_path(outside[-1].filename)}:{outside[-1].lineno}"
    return where


def _from_record(record: Any) -> GraphBreak:
    stack = list(getattr(record, "user_stack", None) or [])
    entered: tuple[tuple[str, str, int], ...] = ()
    if len(stack) > 1 and _is_trampoline(stack[0]):
        entered = ((stack[1].filename, stack[1].name, stack[1].lineno or 0),)
    frames = tuple((f.filename, f.name, f.lineno or 0) for f in stack if not _is_trampoline(f))
    return GraphBreak(_first_line(str(record.reason)), _where(stack), entered, frames)


def _in(code: Any, frame: tuple[str, str, int]) -> bool:
    """Whether ``frame`` (file, function, line) is a frame of ``code``."""
    file, name, line = frame
    if code.co_filename != file or code.co_name != name:
        return False
    return any(line == start for _, _, start in code.co_lines())


def innermost(breaks: list[GraphBreak], modules: list[tuple[str, Any]]) -> str | None:
    """The name of the deepest of ``modules`` (``(name, module)``, below a target) whose own
    ``forward`` (unwrapped from its decorators) was being traced when one of ``breaks``
    happened; None when none was."""
    frames = [f for b in breaks for f in b.frames]
    best: tuple[int, str] | None = None
    for name, module in modules:
        forward = getattr(type(module), "forward", None)
        code = getattr(inspect.unwrap(forward), "__code__", None) if forward else None
        if code is None or not any(_in(code, f) for f in frames):
            continue
        depth = name.count(".")
        if best is None or depth > best[0]:
            best = (depth, name)
    return None if best is None else best[1]


class BreakLog:
    """The graph breaks Dynamo recorded since this log was made or last read."""

    __slots__ = ("_count", "_last")

    def __init__(self) -> None:
        self._count = 0
        self._last: Any = None
        self.mark()

    def mark(self) -> None:
        """Forget the breaks recorded so far."""
        records = graph_break_records()
        self._count = len(records)
        self._last = records[-1] if records else None

    def new(self) -> list[GraphBreak]:
        """The breaks recorded since the last read, one per (reason, place), in order.

        Dynamo records a break again for every frame that traces the same code
        (the target's entry frame, then the frame of the ``forward`` that broke):
        those repeats, and its ``step_unsupported`` records that only follow a
        break, are dropped.
        """
        records = graph_break_records()
        start = self._count
        if len(records) < start or (start and records[start - 1] is not self._last):
            start = 0  # Dynamo's reset() emptied the list since the last read
        batch = records[start:]
        self._count = len(records)
        self._last = records[-1] if records else None
        found = _one_per_place(batch)
        real = [b for b in found if b.reason != "step_unsupported"]
        return real or found


def _one_per_place(records: list[Any]) -> list[GraphBreak]:
    """One break per (reason, place) of Dynamo's graph-break records, in order; the
    entered frames of a repeat are added to the first."""
    found: list[GraphBreak] = []
    places: dict[tuple[str, str], int] = {}
    for record in records:
        if not getattr(record, "graph_break", True):
            continue
        found_break = _from_record(record)
        key = (found_break.reason, found_break.where)
        if key in places:
            known = found[places[key]]
            more = tuple(e for e in found_break.entered if e not in known.entered)
            if more:
                found[places[key]] = GraphBreak(
                    known.reason, known.where, known.entered + more, known.frames
                )
            continue
        places[key] = len(found)
        found.append(found_break)
    return found
