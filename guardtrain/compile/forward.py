"""The installed ``forward``: a steady path (under the stance) and a warm path (full guards).

:func:`wrapper_for` makes the function installed as a target's ``forward``. Before a
call it runs the rare checks (the shared code compiled since this member's last
check, saved-tensor hooks, a change seen by an event or a moved namespace); then a
call under the stance takes :func:`steady`, any other :func:`guarded`. Both are
module functions of the target's state (:class:`~guardtrain.compile.target_state.TargetState`),
so the per-call path does one global lookup where a method lookup was.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

import guardtrain.compile.call_mode as _call_mode
from guardtrain._torch import STANCE, dynamo_config, eval_frame_state
from guardtrain.compile import known_states as _states
from guardtrain.compile.accept import (
    ADMITTED,
    FULL_GUARDS,
    MISSED,
    accepts,
    admit,
    remember_full_guards,
    stance_choice,
)
from guardtrain.compile.caches import carries_cache, in_key
from guardtrain.compile.call_mode import (
    CallMode,
    any_autocast,
    callback_handler,
    describe_call_mode,
    inlined_hooks_active,
    is_grad_enabled,
    is_inference,
    mode_of,
    top_saved_hooks,
)
from guardtrain.compile.code import TargetCode
from guardtrain.compile.grads import pattern as grad_pattern
from guardtrain.compile.grads import use_variant
from guardtrain.compile.harvest import direct_entry
from guardtrain.compile.miss import Miss, MissReason
from guardtrain.compile.options import is_stance_miss
from guardtrain.compile.repeat import promoting
from guardtrain.compile.stances import NO_STANCE
from guardtrain.compile.target_state import TargetState
from guardtrain.compile.trampoline import compiling_frame

__all__ = [
    "attend",
    "autocast_switched",
    "check_changed",
    "first_call_of_batch",
    "fit",
    "guarded",
    "plain_forward_for",
    "steady",
    "with_full_guards",
    "wrapper_for",
]

_frame_state = eval_frame_state
_is_compiling: Callable[[], bool] = torch.compiler.is_compiling
_FREEVAR_ERROR = "Freevar has no source"
_NOT_RUN = object()
"""What a steady call returns when it left the stance instead of running."""
_NOT_DIRECT = object()
"""What turbo's direct path returns for a call that takes the stance's path instead."""
_UNACCEPTED = Miss.of(MissReason.UNACCEPTED)
_UNSEEN_ARGUMENTS = Miss.of(MissReason.UNSEEN_ARGUMENTS)
_STANCE_MISS = Miss.of(MissReason.STANCE_MISS)
_SAVED_HOOKS = Miss.of(MissReason.SAVED_HOOKS)


def wrapper_for(target: TargetState, func: Callable[..., Any]) -> Callable[..., Any]:
    """The ``forward`` to install for ``target`` (``func``: the module's own function)."""

    @functools.wraps(func)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if target.dirty:
            attend(target, args, kwargs)  # a trigger marked it: what changed?
        elif top_saved_hooks(True) is not None:
            saved_hooks_seen(target)  # saved-tensor hooks at this call (H31)
        if target.under_stance:
            if target.versions.moved():
                check_changed(target, args, kwargs, written=True)
            if target.under_stance:
                out = steady(target, args, kwargs)
                if out is not _NOT_RUN:
                    return out
        elif target.code.drops_guards and target.versions.moved():
            check_changed(target, args, kwargs, written=True)
        return guarded(target, args, kwargs)

    forward.__wrapped__ = target.bound  # type: ignore[attr-defined]
    forward._guardtrain_target = target  # type: ignore[attr-defined]
    return forward


def attend(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before a call of a target that a trigger marked (:attr:`TargetState.dirty`), in this
    order: the code compiled since this member's last fit, saved-tensor hooks at this
    call (H31, checked on every call), the batch's first call (H42), a change an event
    saw (H33, H34). The flag is cleared first: a trigger during these marks it again; if
    one of them raises, it stays marked, and the next call attends to what is left."""
    target.dirty = False
    try:
        if target.checked_generation != target.code.generation:
            fit(target)  # the code compiled since: does it still fit this instance?
        if top_saved_hooks(True) is not None:
            saved_hooks_seen(target)  # saved-tensor hooks at this call (H31)
        if target.first_call:
            first_call_of_batch(target)  # requires_grad flips that no event saw (H42)
        if target.changed:
            check_changed(target, args, kwargs)  # an event: a module changed (H33, H34)
    except BaseException:
        target.dirty = True
        raise


def plain_forward_for(target: TargetState, func: Callable[..., Any]) -> Callable[..., Any]:
    """The ``forward`` of a target handed over to full guards (H51): its compiled code, as
    ``torch.compile`` would run it, with none of the per-call checks (a call under a
    dispatch mode runs eagerly, as :func:`guarded` runs it, H18), and with Dynamo's guards
    on modules' hooks: guardtrain no longer watches them, and torch skips them by default
    (``skip_nnmodule_hook_guards``, H34), so a compile during the call keeps them."""

    @functools.wraps(func)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if _call_mode.dispatch_mode_active():
            return target.bound(*args, **kwargs)
        target.calls += 1
        target.code.current = target
        cfg = dynamo_config
        previous = cfg.skip_nnmodule_hook_guards
        cfg.skip_nnmodule_hook_guards = False
        try:
            return target.compiled(*args, **kwargs)
        finally:
            cfg.skip_nnmodule_hook_guards = previous

    forward.__wrapped__ = target.bound  # type: ignore[attr-defined]
    forward._guardtrain_target = target  # type: ignore[attr-defined]
    return forward


# Complexity 16: the per-call path; split, it would add a Python call to every call.
def steady(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call in the steady state: under the stance, set for this call alone (H41), or
    directly (turbo); ``_NOT_RUN`` when it left the stance instead (the caller then runs
    it with full guards)."""
    module = target.module
    mode = (module.training, is_grad_enabled(), is_inference(), any_autocast())
    found = target.key_of(args, kwargs)  # call_key until a key repeats, then its own
    if found is None:
        return with_full_guards(target, args, kwargs)  # no key describes the arguments
    key, tensors = found
    if key == target.last_key and mode == target.last_mode:
        # The last admitted call's arguments and mode (most calls). Only a mode the stance
        # may serve is ever admitted, and a compile, a rebuild or another code forgets it.
        verdict = ADMITTED
        decode = target.last_decode
    else:
        verdict, decode = _verdict(target, mode, key, args, kwargs)
        if verdict is MISSED:
            return _NOT_RUN
    if target.direct:
        out = _directly(target, mode, key, tensors, args, kwargs)
        if out is not _NOT_DIRECT:
            return out
    if verdict is FULL_GUARDS:
        # An entry accepts the call, but not the one the stance would run, or one that
        # breaks the graph (its mode is in `code.broken_modes`, or its key's entry is not
        # whole): under the stance a miss in a resumed frame would come after part of the
        # call ran (H4).
        return with_full_guards(target, args, kwargs)
    if target.checking and not accepts(target, args, kwargs):
        # Unseen inputs (H26): no entry's guards accept them, so the stance would
        # run an entry compiled for other shapes.
        target.on_miss(target, _UNACCEPTED)
        return _NOT_RUN
    # The stance for this call alone (H41): torch's stance is one value for the whole
    # process, so it is set around the target's own compiled call and put back after
    # it, also when the call raises. Never written while Dynamo traces this wrapper,
    # nor over a stance the user set.
    previous = _frame_state[STANCE]
    unsafe = target.unsafe_stance
    if previous is not target.plain_stance or _is_compiling():
        unsafe = _other_stance(target, previous)
        if unsafe is None:
            return _not_our_stance(target, args, kwargs)
    _frame_state[STANCE] = unsafe
    if decode:  # a transformers cache: a generate() call (H53)
        target.counts.decode_calls += 1
    try:
        return target.compiled(*args, **kwargs)
    except RuntimeError as err:
        failed = err
    finally:
        _frame_state[STANCE] = previous
    if decode:  # it did not run
        target.counts.decode_calls -= 1
    return _after_stance_miss(target, failed, mode, key, args, kwargs)


def _verdict(
    target: TargetState,
    mode: CallMode,
    key: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[str, bool]:
    """How a steady call with another key or mode than the last admitted call runs
    (:func:`~guardtrain.compile.accept.admit`'s verdicts; on :data:`MISSED` the call has
    left the stance), and whether its key describes a transformers cache (H53), which an
    admitted key keeps for its repeats (``last_decode``)."""
    verdict = _admission(target, mode, key, args, kwargs)
    decode = in_key(key)
    if target.last_key is key:
        target.last_decode = decode
    return verdict, decode


def _admission(
    target: TargetState,
    mode: CallMode,
    key: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> str:
    """:func:`_verdict`'s verdict."""
    if mode[3] is not target.code.autocast and not target.retry_eagerly:
        # Autocast flipped: the code of the other state, kept or checked (H44, H46).
        autocast_switched(target, args, kwargs)
        if target.under_stance and target.versions.moved():
            check_changed(target, args, kwargs, written=True)
        if not target.under_stance:
            return MISSED
    code = target.code
    target.key_of = promoting(target)  # another key: no fast recognition until it repeats
    if mode in code.stance_modes:
        if target.retry_eagerly:
            # With guard collectives a check on this rank alone would break the pairing
            # of collectives: Dynamo's shared misses decide there.
            return ADMITTED
        verdict = admit(target, mode, key, args, kwargs)
        if verdict is MISSED:
            target.on_miss(target, _unadmitted(target, key))
        return verdict
    if mode in code.modes and not target.retry_eagerly:
        # Entries exist for this mode, but the stance cannot tell them apart (another
        # `training` value under the same grad mode and autocast, H1): this call alone
        # runs with full guards, or directly, and the loop stays steady (H44).
        return FULL_GUARDS
    # The stance could pick an entry compiled for another mode.
    target.on_miss(target, Miss(MissReason.MODE, describe_call_mode(mode, mode in code.modes)))
    return MISSED


def _directly(
    target: TargetState,
    mode: CallMode,
    key: tuple[Any, ...],
    tensors: list[torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Turbo (H30): the entry Dynamo chose for a call like this one, run below Dynamo's
    entry path once guardtrain's own checks pass (it needs no stance); ``_NOT_DIRECT``
    when the call takes the stance's path, ``_NOT_RUN`` when it left the stance."""
    direct = direct_entry(target, mode, key, tensors, args, kwargs)
    if direct is not None:
        if target.code.shared:
            return direct.fn(target.module, *args, **kwargs)
        return direct.fn(*args, **kwargs)
    return _NOT_DIRECT if target.under_stance else _NOT_RUN


def _other_stance(target: TargetState, previous: Any) -> Any:
    """The stance to set for a steady call that finds another stance object than the one
    the run started under: one equal to the run's (``with set_stance("default")`` makes a
    new object) is treated as it; None when nothing may be written (:func:`_not_our_stance`)."""
    plain = target.plain_stance
    if _is_compiling() or plain is NO_STANCE or previous != plain:
        return None
    return dataclasses.replace(previous, skip_guard_eval_unsafe=True)


def _not_our_stance(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A steady call where the stance may not be written. While Dynamo traces the wrapper
    (the target called from the user's own compiled code) the call is traced as it is. Any
    other stance is the user's (``force_eager``, ``fail_on_recompile``): it is left as it
    is, and the call runs under it with full guards."""
    if _is_compiling():
        return target.compiled(*args, **kwargs)
    return with_full_guards(target, args, kwargs)


def _unadmitted(target: TargetState, key: tuple[Any, ...]) -> Miss:
    """Why a call whose arguments no entry accepts leaves the stance."""
    if (target.last_key is not None and key != target.last_key) or any(
        type(e) is tuple for e in key
    ):
        return _UNSEEN_ARGUMENTS  # plain values, None, keywords or structure
    # Only tensors: new inputs, as H26's check (an unseen batch) or turbo's harvest
    # would find, else as the stance's own miss would say.
    return _UNACCEPTED if target.direct or target.checking else _STANCE_MISS


def _after_stance_miss(
    target: TargetState,
    err: RuntimeError,
    mode: CallMode,
    key: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Dynamo's own miss under the stance (H4), raised before the frame ran (a target
    under the stance has no graph breaks); any other error is raised.

    When an entry accepts the call with full guards, the stance only failed to pick
    it (H44): this call runs with full guards, and so do later calls with its key, while
    the loop stays steady. Otherwise the call leaves the stance and is retried (eagerly
    with guard collectives)."""
    if not is_stance_miss(err):
        raise err
    if not target.retry_eagerly and remember_full_guards(target, mode, key, args, kwargs):
        return with_full_guards(target, args, kwargs)
    if not target.on_miss(target, _STANCE_MISS):
        raise err
    if target.retry_eagerly:
        return target.bound(*args, **kwargs)
    return _NOT_RUN


def with_full_guards(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one steady call with Dynamo's full guards (its arguments hold something no key
    describes, or the stance cannot pick its entry): the stance is not set for it."""
    target.counts.full_guard_calls += 1
    return guarded(target, args, kwargs)


def guarded(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call with Dynamo's guards (outside the stance): may trace, so
    ``install_free_tensors`` is set around it where this target uses it."""
    if _call_mode.dispatch_mode_active() or target.uncompiled:
        # Dynamo would skip the frame and mark our code skipped for good (ModelSummary's
        # FLOP count, H18), or the target is about to be split (H51): run it eagerly.
        return target.bound(*args, **kwargs)
    if any_autocast() is not target.code.autocast and not target.retry_eagerly:
        autocast_switched(target, args, kwargs)  # the code of this autocast state (H44)
    target.calls += 1
    target.counts.decode_full_guards += carries_cache(args, kwargs)  # generate()'s calls
    code = target.code
    code.current = target
    own = code.own_compiles
    try:
        return _traced(target, code, args, kwargs)
    finally:
        if code.own_compiles != own:
            code.note_entry()  # does the new entry break the graph? (H4)


def _traced(
    target: TargetState, code: TargetCode, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """:func:`guarded`'s compiled call: ``install_free_tensors`` set around it where the
    target uses it, for the trampoline's own frame only (H12, H23)."""
    if not code.install_free_tensors:
        return target.compiled(*args, **kwargs)
    cfg = dynamo_config
    previous = cfg.install_free_tensors
    cfg.install_free_tensors = True
    compiles = code.compiles
    callbacks = callback_handler()

    def only_the_trampoline(_: Any) -> None:
        # Only the trampoline's own frame may trace with free tensors: a frame Dynamo
        # compiles after a graph break in the same call is code that other instances
        # share (the class's `forward` or its resume functions, H12).
        dynamo_config.install_free_tensors = compiling_frame()[0] is target.code.trampoline

    if callbacks is not None:
        callbacks.register_start_callback(only_the_trampoline)
    try:
        return target.compiled(*args, **kwargs)
    except AssertionError as err:
        now = target.code
        if _FREEVAR_ERROR not in str(err) or now.graph_breaks or now.compiles != compiles:
            raise
        # A nested compile region the static scan did not see (H23). No frame
        # compiled in this call, so the error came from tracing the first
        # frame, before any of the forward ran: compile again without it.
        target.free_tensors_off(
            "Dynamo cannot trace a nested compile region with install_free_tensors "
            f"(H23: {_FREEVAR_ERROR})"
        )
        target.rebuild()
    finally:
        if callbacks is not None:
            callbacks.remove_start_callback(only_the_trampoline)
        cfg.install_free_tensors = previous
    return target.compiled(*args, **kwargs)


def check_changed(
    target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any], written: bool = False
) -> None:
    """Before a call: something this target reads may have changed (an event, or with
    ``written`` a namespace whose version moved), or the call's autocast is not its code's.

    Only flips seen (``requires_grad``, ``training``, plain attributes, autocast) and a
    state this target ran in before: what it learnt there is put back, and nothing else
    is checked (:mod:`guardtrain.compile.known_states`, H46). Otherwise the engine checks and
    acts (rebuilds the target or leaves the stance); then, still under the stance, the
    entry the stance would run must accept this call with its full guards, or the call
    leaves the stance: the recorded assertions do not say which entry serves the call's
    grad mode or autocast (an eval entry compiled under ``no_grad`` matches a submodule
    switched to ``eval()`` in training). Then the versions and the watched modules restart."""
    autocast = any_autocast()
    flips = target.flips.only and not written
    if written:
        reason, note = MissReason.WRITTEN, MissReason.WRITTEN.value
    else:
        reason, note = MissReason.CHANGED, target.change_note or MissReason.CHANGED.value
    target.changed = False
    target.change_note = None
    if not flips:
        target.kept.stale()  # the check below sees this code only: what was kept may be stale
    elif not target.retry_eagerly and target.unverified is None:
        if _states.swap(target, _states.state_key(target, autocast)):
            return
        _states.leave(target)  # a state not known (yet): known once checked
    target.general_checks += 1  # what checks cost against what they save (H51)
    _check(target, args, kwargs, Miss(reason, note), autocast)
    target.versions.reset()
    if target.installed:
        target.watch_modules()
    target.kept.state = _states.state_key(target, autocast)


def _check(
    target: TargetState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    changed: Miss,
    autocast: bool,
) -> None:
    """The general check of :func:`check_changed`: the code of the call's autocast state,
    the engine's check, and under the stance the entry the stance would run."""
    code = target.code
    if autocast is not code.autocast and not target.retry_eagerly:
        use_variant(target, autocast)  # each autocast state has code of its own (H44)
    if target.on_change is not None:
        target.on_change(target, changed.text)
    if (
        target.under_stance
        and not target.retry_eagerly
        and stance_choice(target, args, kwargs) is None
    ):
        if target.code is not code:  # the code of a new requires_grad pattern (H42)
            text = f"{changed.text}: {MissReason.NEW_PATTERN.value}"
            miss = Miss(MissReason.NEW_PATTERN, text)
        else:  # in a batch with an unseen signature (H26) that is what the call is new in
            miss = _UNACCEPTED if target.checking else changed
        target.on_miss(target, miss)


def autocast_switched(target: TargetState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The call's autocast is not the one its code compiled for: a flip, checked as one
    (each autocast state has code of its own, H44)."""
    if not target.changed:
        target.changed = True
        target.flips.only = True
        target.change_note = f"autocast switched {'on' if any_autocast() else 'off'}"
    check_changed(target, args, kwargs)


def first_call_of_batch(target: TargetState) -> None:
    """The first call of a batch: parameters whose ``requires_grad`` moved where no event
    saw it (``torch.Tensor.requires_grad_(p)``, FSDP2's ``DTensor`` parameters) mark the
    target, which then switches to the code of the new pattern as after an event (H42);
    the bits the events keep take the flags as they are (H46). One pass in C over the
    parameters, once per batch."""
    target.first_call = False
    now = grad_pattern(target.params)
    bits = bytes(now)
    if bits != target.flips.grad_bits:  # a flip that no event saw
        target.flips.grad_bits = bytearray(bits)
    elif now == target.code.pattern:
        return
    if not target.changed:
        target.changed = True
        target.flips.only = True
        target.change_note = "requires_grad of a parameter changed (seen at the batch's first call)"


def fit(target: TargetState) -> None:
    """Before a call through shared code that compiled since this target's last check:
    leave it for code of its own if an entry that Dynamo could pick for this instance
    asserted something a dropped guard no longer checks, or if no entry's kept
    assertions hold for it (a scalar or flag that differs between instances: each
    distinct value would add an entry, up to the recompile limit, after which the
    instances would run eagerly) (H24)."""
    code = target.code
    target.checked_generation = code.generation
    if len(code.members) < 2:
        return
    stale, unmatched = target.check_assertions(globals_too=False)
    why = None
    if target.drifted():
        why = "its structure changed (parameters, submodules or attributes)"
    elif stale is not None:
        why = f"{stale}: a dropped guard; the shared code does not fit it"
    elif unmatched is not None and mode_of(target.module) in code.modes:
        # Not for a mode no entry was compiled for yet: Dynamo compiles that one.
        why = f"{unmatched}: no shared entry fits it"
    if why is None:
        return
    target.leave_shared_code(why)
    if target.under_stance:  # under the stance: leave it, the new code has no entry yet
        target.on_miss(
            target, Miss(MissReason.SHARED_CODE, f"left its class's shared code ({why})")
        )


def saved_hooks_seen(target: TargetState) -> None:
    """Saved-tensor hooks are active at this call (H31).

    The filter may drop Dynamo's saved-tensor-hooks guard; this per-call check
    replaces it (a once-per-batch check would miss ``save_on_cpu()`` entered
    inside the step). Hooks that Dynamo does not inline (``save_on_cpu``, any
    Python pair) are read by that guard as no hooks, so every entry serves
    them and they run at run time: nothing to do. Hooks that Dynamo inlines
    (``fx.GraphModule`` pack and unpack) need the guard: the code keeps it
    from now on and, when an entry was compiled without it, is rebuilt, so
    this call compiles with the guard (after leaving the stance).
    """
    code = target.code
    if code.keep_hooks_guard and not code.dropped_hooks_guard:
        return  # every entry has the guard: Dynamo tells them apart
    if not inlined_hooks_active():
        return
    code.keep_hooks_guard = True
    if not code.dropped_hooks_guard:
        return
    # An entry without the guard would accept a call under these hooks.
    target.rebuild()
    if target.under_stance:
        target.on_miss(target, _SAVED_HOOKS)
