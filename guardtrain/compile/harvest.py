"""Harvesting for direct dispatch (turbo, H30): the entry Dynamo would choose, kept per mode.

A call under the stance with direct dispatch looks in its target's dispatch table
for a :class:`~guardtrain.compile.direct.DirectEntry` that matches it
(:func:`direct_entry`); on none, it harvests one from a real call: the first cache
entry whose full guard manager accepts the call.
"""

from __future__ import annotations

from typing import Any

import torch

import guardtrain.compile.call_mode as _call_mode
from guardtrain.compile.accept import BROKEN, first_accepting, remember
from guardtrain.compile.call_mode import CallMode, outside_state_clear
from guardtrain.compile.direct import DIRECT_LIMIT, DirectEntry, whole
from guardtrain.compile.miss import Miss, MissReason
from guardtrain.compile.target_state import TargetState
from guardtrain.compile.trampoline import cache_entry_list

__all__ = ["direct_entry", "harvest", "may_harvest"]

_UNACCEPTED = Miss.of(MissReason.UNACCEPTED)


def direct_entry(
    target: TargetState,
    mode: CallMode,
    key: tuple[Any, ...],
    tensors: list[torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> DirectEntry | None:
    """The harvested entry that runs this call directly, harvesting one if allowed,
    counted in ``target.counts``; None when the call takes the stance's path (the
    world outside the arguments is not as the entries were harvested, or no entry may
    be harvested) or left the stance (no entry accepts it)."""
    if not outside_state_clear(target.plain_stance):
        return None
    for direct in target.learnt.dispatch_table.get(mode, ()):
        if direct.matches(key, tensors, target.call_scope, args, kwargs):
            break
    else:
        if not may_harvest(target, mode) or _call_mode.dispatch_mode_active():
            return None
        verdicts = target.learnt.verdicts
        if verdicts.get(mode, {}).get(key) is BROKEN:
            return None  # Dynamo's entry for it breaks the graph: full guards (H4)
        harvested = harvest(target, mode, key, tensors, args, kwargs)
        if harvested is None:
            if verdicts.get(mode, {}).get(key) is not BROKEN:
                # No entry's guards accept the call: the stance would run one compiled
                # for other inputs (H26).
                target.on_miss(target, _UNACCEPTED)
            return None
        direct = harvested
    counts = target.counts
    counts.direct_calls += 1
    if direct.decode:
        counts.decode_calls += 1
    if target.checking:
        target.checks += 1
    return direct


def may_harvest(target: TargetState, mode: CallMode) -> bool:
    """Whether another harvest is allowed: :data:`DIRECT_LIMIT` per mode, four times
    that in all, until the table is next emptied (inputs that change every call would
    otherwise pay a guard evaluation and a table search each)."""
    return (
        len(target.learnt.dispatch_table.get(mode, ())) < DIRECT_LIMIT
        and target.learnt.harvests < 4 * DIRECT_LIMIT
    )


def harvest(
    target: TargetState,
    mode: CallMode,
    key: tuple[Any, ...],
    tensors: list[torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> DirectEntry | None:
    """The cache entry that Dynamo would choose for this call with full guards (the
    first whose guard manager accepts it, in cache order), as a :class:`DirectEntry`
    for calls like it, added to the table; None when no entry accepts the call, or when
    that entry breaks the graph (:func:`~guardtrain.compile.direct.whole`): then the
    call's kind is remembered as :data:`~guardtrain.compile.accept.BROKEN`, and calls of it
    run with full guards."""
    learnt = target.learnt
    learnt.harvests += 1
    scope = target.call_scope(args, kwargs)
    found = first_accepting(target.code.trampoline, scope)
    if found is None:
        return None
    entry, entries = found
    if not whole(entry.code):
        remember(target, mode, key, BROKEN)
        return None
    code = target.code
    several = entries > 1 and code.mode_compiles.get(mode, 0) != 1
    earlier = []
    if entries > 1 and cache_entry_list is not None:
        for other in cache_entry_list(code.trampoline):
            if other.code is entry.code:
                break
            earlier.append(other.guard_manager)
    direct = DirectEntry(entry, code.closure, key, tensors, several, scope, earlier)
    table = learnt.dispatch_table.setdefault(mode, [])
    if direct.symbolic:
        table.insert(0, direct)  # it serves every size of a decode loop: asked first
    else:
        table.append(direct)
    return direct
