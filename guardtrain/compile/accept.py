"""Whether the entry the stance would run accepts a call: unseen inputs (H26), new arguments (H32).

The stance evaluates only the guards that tell entries apart (their *diff* guards).
These checks find the entry the stance would run, as the stance does, and evaluate
its full guard manager on the call: what Dynamo checks without the stance.
"""

from __future__ import annotations

from typing import Any

from guardtrain.compile.call_mode import CallMode, key_sources, masked, structure
from guardtrain.compile.state import TargetState
from guardtrain.compile.trampoline import cache_entry_list
from guardtrain.guardcheck import check as _guard_check

__all__ = ["ACCEPT_LIMIT", "accepts", "admit", "stance_choice"]

ACCEPT_LIMIT = 64
"""Argument keys remembered per mode as accepted (:func:`admit`); past it the set starts
again (an argument that takes a new value every call, and that Dynamo's stance does
not check itself, is then checked on every call)."""


def stance_choice(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The guard manager of the entry the stance would run for this call, if its full
    guards accept the call; else None.

    The stance runs the first entry (in cache order) whose *diff* guards pass; when
    that entry's full guards pass too, it is the entry Dynamo would pick with full
    guards (every earlier entry fails a diff guard, which is one of its guards).
    """
    if cache_entry_list is None:
        return None
    scope = target.call_scope(args, kwargs)
    for entry in cache_entry_list(target.code.trampoline):
        manager = getattr(entry, "guard_manager", None)
        if manager is None:
            continue
        diff = getattr(manager, "diff_guard_root", None)
        if diff is None or _guard_check(diff, scope):
            return manager if _guard_check(manager, scope) else None
    return None


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


def admit(
    target: TargetState,
    mode: CallMode,
    key: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bool:
    """Whether a call whose argument key differs from the last call's may run under
    the stance: its key (or its key with the values the stance checks itself masked)
    was accepted before, or the entry the stance would pick accepts it with full
    guards now. The stance evaluates only the guards that tell entries apart, so a
    plain argument (an int, a flag, ``None`` for a tensor, a keyword) that no entry
    was compiled against otherwise runs a stale entry."""
    accepted = target.accepted.setdefault(mode, set())
    if key in accepted:
        target.last_key, target.last_mode = key, mode
        return True
    shape = structure(key)
    delegated = target.delegated.get(shape)
    seen_masked = target.accepted_masked.setdefault(mode, set())
    if delegated and masked(key, delegated) in seen_masked:
        target.last_key, target.last_mode = key, mode
        return True
    manager = stance_choice(target, args, kwargs)
    if manager is None:
        return False
    if len(accepted) >= ACCEPT_LIMIT:
        accepted.clear()
        seen_masked.clear()
    accepted.add(key)
    if delegated is None:
        sources = getattr(manager, "diff_guard_sources", None) or ()
        delegated = frozenset(
            i
            for i, source in enumerate(key_sources(args, kwargs))
            if source is not None and source in sources and i < len(key) and type(key[i]) is tuple
        )
        target.delegated[shape] = delegated
    if delegated:
        seen_masked.add(masked(key, delegated))
    target.last_key, target.last_mode = key, mode
    return True
