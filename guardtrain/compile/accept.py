"""Whether the entry the stance would run accepts a call: unseen inputs (H26), new arguments (H32).

The stance evaluates only the guards that tell entries apart (their *diff* guards).
These checks find the entry the stance would run, as the stance does, and evaluate
its full guard manager on the call: what Dynamo checks without the stance. When the
stance's entry refuses a call that another entry accepts (an entry per autocast
state, H44), that call runs with full guards (:data:`FULL_GUARDS`) and the loop stays
steady; only a call that no entry accepts leaves the stance (:data:`MISSED`).
"""

from __future__ import annotations

import time
from typing import Any

from guardtrain.compile.call_mode import CallMode, key_sources, masked, structure
from guardtrain.compile.direct import whole
from guardtrain.compile.target_state import TargetState
from guardtrain.compile.trampoline import cache_entry_list
from guardtrain.guardcheck import check as _guard_check

__all__ = [
    "ACCEPT_LIMIT",
    "ADMITTED",
    "BROKEN",
    "FULL_GUARDS",
    "GUARD_SAMPLES",
    "MISSED",
    "accepting_entry",
    "accepts",
    "admit",
    "first_accepting",
    "remember_full_guards",
    "stance_choice",
    "stance_entry",
    "stance_pick",
]

GUARD_SAMPLES = 32
"""Full guard checks timed per target (:attr:`TargetState.guard_ns`), for the summary's
estimate of the saving; timing is reported, never decided on."""
_clock = time.perf_counter_ns

ACCEPT_LIMIT = 128
"""Verdicts remembered per mode (:func:`admit`; a masked key counts as one); past it the
mode's table starts again (an argument that takes a new value every call, and that Dynamo's stance
does not check itself, is then checked on every call)."""


ADMITTED = "admitted"
"""A verdict of :func:`admit`: the call runs under the stance."""
FULL_GUARDS = "full guards"
"""A verdict of :func:`admit`: an entry accepts the call, but not the one the stance would
pick: the call runs with full guards (turbo: directly), the loop stays steady."""
MISSED = "missed"
"""A verdict of :func:`admit`: no entry accepts the call; it leaves the stance."""
BROKEN = "broken"
"""A remembered verdict: Dynamo's entry for the call breaks the graph, so it runs with full
guards (H4), under the stance's path and never harvested (:func:`admit` answers
:data:`FULL_GUARDS` for it)."""


def stance_pick(code: Any, scope: dict[str, Any]) -> Any:
    """The cache entry of ``code`` that the stance would run for a frame with locals
    ``scope``: the first, in cache order, whose *diff* guards pass (or that has none);
    None when there is none."""
    if cache_entry_list is None:
        return None
    for entry in cache_entry_list(code):
        manager = getattr(entry, "guard_manager", None)
        if manager is None:
            continue
        diff = getattr(manager, "diff_guard_root", None)
        if diff is None or _guard_check(diff, scope):
            return entry
    return None


def stance_entry(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The cache entry the stance would run for this call, if its full guards accept the
    call; else None.

    The stance runs the first entry (in cache order) whose *diff* guards pass; when
    that entry's full guards pass too, it is the entry Dynamo would pick with full
    guards (every earlier entry fails a diff guard, which is one of its guards).
    """
    scope = target.call_scope(args, kwargs)
    entry = stance_pick(target.code.trampoline, scope)
    if entry is None:
        return None
    samples = target.guard_ns
    if len(samples) >= GUARD_SAMPLES:  # timed enough: no clock on the calls after
        return entry if _guard_check(entry.guard_manager, scope) else None
    start = _clock()
    if not _guard_check(entry.guard_manager, scope):
        return None
    samples.append(_clock() - start)  # what a call with full guards spends on them
    return entry


def stance_choice(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The guard manager of :func:`stance_entry`'s entry, or None."""
    entry = stance_entry(target, args, kwargs)
    return None if entry is None else entry.guard_manager


def accepts(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the entry the stance would run accepts a call with these inputs (H26).

    Finds the entry as the stance does (diff guards) and evaluates its guard
    manager, with every guard it kept (the input tensors' sizes, strides and
    dtypes, the shape environment's ranges and 0/1 specialisation, global
    state), on the call's arguments: what Dynamo checks without the stance.
    Counts an accepted call in ``target.checks``.
    """
    if stance_choice(target, args, kwargs) is None:
        return False
    target.checks += 1
    return True


def accepting_entry(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``(entry, number of entries)`` for the first cache entry of the root code whose
    guard manager accepts a call with these arguments (Dynamo's choice with full
    guards, in cache order), or None."""
    return first_accepting(target.code.trampoline, target.call_scope(args, kwargs))


def first_accepting(code: Any, scope: dict[str, Any]) -> Any:
    """``(entry, number of entries)`` for the first cache entry of ``code`` whose guard
    manager accepts a frame with locals ``scope`` (Dynamo's choice with full guards, in
    cache order), or None."""
    if cache_entry_list is None:
        return None
    entries = cache_entry_list(code)
    for entry in entries:
        manager = getattr(entry, "guard_manager", None)
        if manager is not None and _guard_check(manager, scope):
            return entry, len(entries)
    return None


_NONE: dict[Any, str] = {}
"""No verdicts yet for a mode (never written)."""


def remember_full_guards(
    target: TargetState,
    mode: CallMode,
    key: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bool:
    """Whether some entry accepts this call with full guards; if so, calls of this mode
    and key run with full guards from now on (until the entries change), without
    leaving the steady state (H44)."""
    if accepting_entry(target, args, kwargs) is None:
        return False
    remember(target, mode, key, FULL_GUARDS)
    return True


def remember(target: TargetState, mode: CallMode, key: tuple[Any, ...], verdict: str) -> None:
    """Calls of ``mode`` with ``key`` get ``verdict`` (until the entries change); past
    :data:`ACCEPT_LIMIT` verdicts the table starts again."""
    verdicts = target.learnt.verdicts.setdefault(mode, {})
    if len(verdicts) >= ACCEPT_LIMIT:
        verdicts.clear()
    verdicts[key] = verdict


def admit(
    target: TargetState,
    mode: CallMode,
    key: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> str:
    """How a call whose argument key differs from the last call's runs in the steady
    state: :data:`ADMITTED` (under the stance) when its key (or its key with the values
    the stance checks itself masked) was accepted before, or the entry the stance would
    pick accepts it with full guards now; :data:`FULL_GUARDS` when another entry accepts
    it, or its entry breaks the graph (remembered per key); :data:`MISSED` when none
    does. The stance evaluates only the guards that tell entries apart, so a plain
    argument (an int, a flag, ``None`` for a tensor, a keyword) that no entry was
    compiled against otherwise runs a stale entry."""
    learnt = target.learnt
    verdicts = learnt.verdicts.get(mode, _NONE)
    verdict = verdicts.get(key)
    if verdict is None:
        shape = structure(key)
        delegated = learnt.delegated.get(shape)
        # Not on a target with graph breaks: another value could pick an entry that breaks.
        if delegated and not target.code.graph_breaks:
            verdict = verdicts.get(masked(key, delegated))
    if verdict is ADMITTED:
        target.last_key, target.last_mode = key, mode
        return ADMITTED
    if verdict is not None:
        return FULL_GUARDS
    entry = stance_entry(target, args, kwargs)
    if entry is None:
        return FULL_GUARDS if remember_full_guards(target, mode, key, args, kwargs) else MISSED
    if target.code.graph_breaks and not whole(entry.code):
        # The entry breaks the graph: under the stance a miss in a resumed frame would
        # come after part of the call ran (H4). Calls with this key run with full guards.
        remember(target, mode, key, BROKEN)
        return FULL_GUARDS
    remember(target, mode, key, ADMITTED)
    if delegated is None:
        delegated = learnt.delegated[shape] = _delegated(entry.guard_manager, key, args, kwargs)
    if delegated and not target.code.graph_breaks:
        remember(target, mode, masked(key, delegated), ADMITTED)
    target.last_key, target.last_mode = key, mode
    return ADMITTED


def _delegated(
    manager: Any, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> frozenset[int]:
    """The positions of plain values in ``key`` whose guard sources are among the entries'
    diff guards: the stance checks those itself on every call (H32)."""
    sources = getattr(manager, "diff_guard_sources", None) or ()
    return frozenset(
        i
        for i, source in enumerate(key_sources(args, kwargs))
        if source is not None and source in sources and i < len(key) and type(key[i]) is tuple
    )
