"""The training's one counter set, :class:`Counters`: what ``summary()`` counts over every run.

The engine holds the earlier runs' set whole (:attr:`Run.earlier
<guardtrain.engine.run.Run.earlier>`: a checkpoint's, or the engine's earlier trainer
calls'). :func:`~guardtrain.engine.summary.totals` reads this run's parts into a set once
and adds it to that one: ``summary()`` reports the sum, the next run of the same engine
goes on from it, and ``state_dict()`` saves its :data:`SAVED` counters with the preset
(plain ``int`` and lists of ``str`` and ``int`` dicts, so the checkpoint loads with
``torch.load(weights_only=True)``). A checkpoint written before a counter was kept loads it
as 0.

>>> earlier = Counters.load({"preset": "auto", "compiles": 3, "train_batches": 40})
>>> now = Counters(compiles=1, compiles_by_target={"net": 1}, lookup_us={"steady": 2.0})
>>> total = earlier + now
>>> total.compiles, total.train_batches, total.compiles_by_target, total.lookup_us
(4, 40, {'net': 1}, {'steady': 2.0})
>>> list(total.saved("auto"))[:3], total.saved("auto")["compiles"]
(['preset', 'compiles', 'rearms'], 4)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from guardtrain.profiling import EVENTS_KEPT

__all__ = ["EVENTS_KEPT", "SAVED", "Counters"]

SAVED = (
    "compiles",
    "rearms",
    "warmup_steps_taken",
    "steady_steps",
    "full_guard_calls",
    "state_swaps",
    "train_batches",
)
"""The counters a checkpoint keeps (``state_dict()``'s keys after ``preset``)."""

_LATEST = ("lookup_us", "lookup_calls")
"""Measured, not counted: the latest run's that measured them."""


@dataclass(slots=True)
class Counters:
    """Counters of the runs so far, each named as its ``summary()`` key where it has one."""

    compiles: int = 0
    rearms: list[dict[str, Any]] = field(default_factory=list)
    warmup_steps_taken: int = 0
    steady_steps: int = 0
    full_guard_calls: int = 0
    state_swaps: int = 0
    train_batches: int = 0
    direct_calls: int = 0
    """``summary()["direct_dispatch"]["calls"]``."""
    decode_served: int = 0
    """``summary()["decode_calls"]["served"]``."""
    decode_full_guards: int = 0
    """``summary()["decode_calls"]["full_guards"]``."""
    checked_batches: int = 0
    checked_calls: int = 0
    graphs: int = 0
    compile_seconds: float = 0.0
    compiles_by_target: dict[str, int] = field(default_factory=dict)
    compiled_again: dict[str, int] = field(default_factory=dict)
    compile_events: list[dict[str, Any]] = field(default_factory=list)
    lookup_us: dict[str, float] = field(default_factory=dict)
    lookup_calls: dict[str, dict[str, int]] = field(default_factory=dict)

    def __add__(self, now: Counters) -> Counters:
        """These counters, then ``now``'s: numbers and per-name counts add, lists go on
        (the first :data:`EVENTS_KEPT` compile events kept); the lookup windows are the
        latest that were measured."""
        total: dict[str, Any] = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(now, f.name)
            if f.name in _LATEST:
                total[f.name] = dict(b or a)
            elif isinstance(a, dict):
                total[f.name] = {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}
            else:
                total[f.name] = a + b
        total["compile_events"] = total["compile_events"][:EVENTS_KEPT]
        return Counters(**total)

    def saved(self, preset: str) -> dict[str, Any]:
        """``state_dict()``: the preset and the :data:`SAVED` counters."""
        return {"preset": preset, **{k: getattr(self, k) for k in SAVED}}

    @classmethod
    def load(cls, state: dict[str, Any]) -> Counters:
        """What a run restored from the checkpoint ``state`` goes on from (0, or no
        re-arms, for a counter an older checkpoint lacks)."""
        kept: dict[str, Any] = {k: int(state[k]) for k in SAVED if k in state and k != "rearms"}
        return cls(rearms=list(state.get("rearms", [])), **kept)
