"""What a checkpoint and the next run of an engine keep of the summary: its counters.

A run restored from a checkpoint, or the next run of the same engine, goes on from the
counters of :func:`~guardtrain.engine.summary.build`'s dict (compiles, re-arms, steps,
calls with full guards, state swaps), so that ``summary()`` counts the whole training.
"""

from __future__ import annotations

from typing import Any

__all__ = ["carried", "loaded", "state_dict"]

_CARRIED = (
    "compiles",
    "rearms",
    "warmup_steps_taken",
    "steady_steps",
    "full_guard_calls",
    "state_swaps",
)
"""Counters that a later run, or a restored checkpoint, goes on from."""


def state_dict(s: dict[str, Any], train_batches: int) -> dict[str, Any]:
    """What a checkpoint keeps of summary ``s`` (see :func:`loaded`)."""
    return {"preset": s["preset"], **{k: s[k] for k in _CARRIED}, "train_batches": train_batches}


def loaded(state: dict[str, Any]) -> dict[str, Any]:
    """The counters that a run restored from the checkpoint ``state`` goes on from (0 for
    one that a checkpoint written before it was kept lacks)."""
    return {
        "compiles": int(state.get("compiles", 0)),
        "rearms": list(state.get("rearms", [])),
        "warmup_steps_taken": int(state.get("warmup_steps_taken", 0)),
        "steady_steps": int(state.get("steady_steps", 0)),
        "full_guard_calls": int(state.get("full_guard_calls", 0)),
        "state_swaps": int(state.get("state_swaps", 0)),
        "train_batches": int(state.get("train_batches", 0)),
    }


def carried(s: dict[str, Any], train_batches: int) -> dict[str, Any]:
    """What the next run of the same engine goes on from, after summary ``s``."""
    restored = {key: s[key] for key in _CARRIED}
    restored.update(
        train_batches=train_batches,
        lookup_us=s["lookup_us"],
        lookup_calls=s["lookup_calls"],
        compile_events=s["compile_events"],
        checked_batches=s["checked_batches"],
        checked_calls=s["checked_calls"],
        direct_calls=s["direct_dispatch"]["calls"],
        decode_calls=s["decode_calls"],
        compiles_by_target=s["compiles_by_target"],
        compiled_again=s["compiled_again"],
        compile_seconds=s["compile_seconds"],
        graphs=s["graphs"],
    )
    return restored
