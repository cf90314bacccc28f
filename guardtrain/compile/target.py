"""CompiledTarget: one module compiled in place, installed, undone, and what the engine asks of it.

Each target module gets a *private* copy of a trampoline code object
(:mod:`guardtrain.compile.trampoline`), bound to that one instance, compiled with
``torch.compile`` and installed as the instance attribute ``forward``:

* ``module(x)`` and ``module.forward(x)`` both run the compiled code (H13);
* ``state_dict`` keys do not change (no ``_orig_mod.`` prefix, H8);
* Dynamo keeps one cache per code object, so every instance has a cache of
  its own: ``install_free_tensors`` cannot hand one instance's weights to
  another instance of the same class (H12), also across two ``fit`` calls;
* forgetting the private code (:meth:`CompiledTarget.rebuild`) invalidates
  every entry compiled for the target, resume functions of graph breaks
  included, without touching other compiled code in the process.

Identical blocks share one code object instead (:mod:`guardtrain.compile.code`, H24).
``install_free_tensors`` is read by Dynamo while it traces. It is set only around
calls that may trace (outside the stance, :func:`guardtrain.compile.forward.guarded`),
so other compiled code in the process never sees it.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn

import guardtrain.compile.grads as _grads
import guardtrain.compile.known_states as _states
import guardtrain.compile.verify as _verify
import guardtrain.compile.watch as _watch
from guardtrain.compile.assertions import Assertion, check, polled_objects
from guardtrain.compile.call_mode import CallMode
from guardtrain.compile.code import TargetCode, structure_key
from guardtrain.compile.forward import plain_forward_for, wrapper_for
from guardtrain.compile.miss import Miss
from guardtrain.compile.polled import Polled
from guardtrain.compile.repeat import promoting
from guardtrain.compile.resolve import forward_function, nested_compile_region
from guardtrain.compile.stances import NO_STANCE, Stances
from guardtrain.compile.target_state import CallCounts
from guardtrain.errors import GuardTrainValueError
from guardtrain.filters import GuardFilter
from guardtrain.fingerprints import module_fingerprint

__all__ = [
    "ChangeHook",
    "CompileHook",
    "CompiledTarget",
    "hand_over",
    "MissHook",
    "SwitchOffHook",
    "steady_now",
]

CompileHook = Callable[["CompiledTarget", str | None], None]
MissHook = Callable[["CompiledTarget", Miss], bool]
SwitchOffHook = Callable[["CompiledTarget", str], None]
ChangeHook = Callable[["CompiledTarget", str], None]
"""Called with what changed before a call of a target whose state may have changed:
the engine checks the target and rebuilds it or leaves the stance (H33)."""
_INSTALLED = ("forward", "__getstate__")
_MISSING = object()


class CompiledTarget:
    """One module whose ``forward`` runs through a compiled trampoline.

    Its per-call state is documented on :class:`~guardtrain.compile.target_state.TargetState`;
    what it shares with other members of its code is on :attr:`code`.

    Args:
        name: the module's dotted name in the LightningModule (``""`` for itself).
        module: the module to compile in place.
        compile_kwargs: validated ``compile_kwargs`` (see :func:`check_compile_kwargs`).
        guard_filter: the filter to install (floor already added), or ``None``.
        install_free_tensors: compile with ``install_free_tensors`` (not for shared code).
        on_compile: called after each frame compilation of this target.
        on_miss: called with a :class:`~guardtrain.compile.miss.Miss` when a call must
            leave the stance; True when the call may be retried with full guards.
        on_switch_off: called with why ``install_free_tensors`` is switched off here.
        share_with: a target of the same class and structure whose code this one
            shares (see :func:`share_groups`); None: code of its own.
        shared: with ``share_with=None``, make code that later targets may share.
        on_change: called with what changed before a call (:data:`ChangeHook`).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        compile_kwargs: dict[str, Any],
        guard_filter: GuardFilter | None,
        install_free_tensors: bool,
        on_compile: CompileHook,
        on_miss: MissHook,
        on_switch_off: SwitchOffHook | None = None,
        share_with: CompiledTarget | None = None,
        shared: bool = False,
        on_change: ChangeHook | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.requested_free_tensors = install_free_tensors
        self.on_miss = on_miss
        self.on_change = on_change
        self._on_compile = on_compile
        self._on_switch_off = on_switch_off
        # The per-call state (TargetState says what each holds).
        self.under_stance = False
        self.plain_stance: Any = NO_STANCE
        self.unsafe_stance: Any = None
        self.direct_allowed = False  # direct dispatch wanted (`direct_dispatch`, not refused)
        self.direct = False
        self.counts = CallCounts()  # its run's, once a run holds it
        self.mixed = False  # graph breaks, kept whole: broken entries with full guards (H4)
        self.graph_breaks_reported = False  # its graph breaks were warned about
        self.uncompiled = False  # calls run the module's own forward until a split (H51)
        self.forget_dispatch()  # the dispatch table, the verdicts
        self.checking, self.checks = False, 0
        self.retry_eagerly = False
        self.changed = False
        self.change_note: str | None = None
        self.tensor_attribute: str | None = None  # a plain tensor attribute replaced
        self.flips, self.kept = _states.Flips(), _states.Kept()  # flips, known states (H46)
        self.first_call = False
        self.dirty = True  # the first call attends
        self.versions = Polled()
        self.checked_generation, self.calls = 0, 0
        self.guard_ns: list[int] = []  # full guard checks timed in check windows (reported)
        self.step_calls, self.calls_at_step = 0, 0  # calls in the last warm-up training step
        self.unverified: Callable[..., Any] | None = None
        self.mismatch: str | None = None
        self.handed_over: str | None = None  # why it has full guards for the run (H51)
        self.general_checks = 0  # checks before calls after a change that was no swap
        # What the engine's checks read.
        self.last_failed: Assertion | None = None  # named by the last check_assertions
        self.reference: Any = None  # the module's fingerprint when its entries compiled
        self.own_code: str | None = None  # why this target left the code it shared
        self._previous: dict[str, Any] = {}
        self._func = forward_function(name, module)
        self.bound: Callable[..., Any] = types.MethodType(self._func, module)
        self.params: list[torch.Tensor] = list(module.parameters())
        self.compiled: Callable[..., Any]
        self.code: TargetCode
        if share_with is not None:
            self.code = share_with.code
            self.code.members.append(self)
            self.compiled = self.code.caller(module)
            _grads.use_variant(self)  # its parameters' requires_grad may differ (H42)
        else:
            self._own_code(compile_kwargs, guard_filter, install_free_tensors, shared=shared)
        self._wrapper = wrapper_for(self, self._func)
        self.install()

    def _own_code(
        self,
        compile_kwargs: dict[str, Any],
        guard_filter: GuardFilter | None,
        install_free_tensors: bool,
        shared: bool,
    ) -> None:
        code = TargetCode(self._func, compile_kwargs, guard_filter, install_free_tensors, shared)
        self.code = code
        self.dirty = True
        code.set_pattern(_grads.pattern(self.params))
        code.members.append(self)
        code.group_key = structure_key(self.module, self._func) if shared else None
        region = nested_compile_region(self.module) if code.install_free_tensors else None
        if region is not None:
            self.free_tensors_off(
                f"it contains a nested compile region ({region}); Dynamo cannot trace "
                "one with install_free_tensors (H23)"
            )
        code.rebuild()  # sets `compiled`

    def detach(self) -> bool:
        """Stop sharing code with other targets (this target is being replaced).

        Returns False when no other target shares its code."""
        if self in self.code.members and len(self.code.members) > 1:
            self.code.members.remove(self)
            self.code.current = None
            return True
        return False

    def drifted(self) -> bool:
        """Whether this member of shared code no longer has the group's structure."""
        key = self.code.group_key
        return key is not None and structure_key(self.module, self._func) != key

    @property
    def graph_breaks(self) -> bool:
        """Whether the code has graph breaks (read-only: the code's flag, for every member)."""
        return self.code.graph_breaks

    def free_tensors_off(self, why: str) -> None:
        """Switch ``install_free_tensors`` off for this target's code, and say why."""
        self.code.free_tensors_off()
        if self._on_switch_off is not None:
            self._on_switch_off(self, why)

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self, known_as: str | None = None) -> None:
        """Install the compiled ``forward`` on the module (again, after :meth:`uninstall`,
        keeping the compiled code and its Dynamo cache), with an instance ``__getstate__``
        that leaves guardtrain's attributes out: ``pickle``, ``torch.save`` and
        ``copy.deepcopy`` give a plain module that runs eagerly (H17, H29).

        Raises:
            GuardTrainValueError: the module's ``forward`` is no longer the one
                compiled (it was replaced between two runs; ``known_as`` names it).
        """
        if self.installed:
            return
        module = self.module
        if forward_function(self.name, module) is not self._func:
            raise GuardTrainValueError(
                f"Target {known_as or repr(self.name)} has another `forward` than the one "
                "compiled before."
            )
        self._previous = {key: module.__dict__.get(key, _MISSING) for key in _INSTALLED}
        module.__dict__["__getstate__"] = _getstate_without(module, dict(self._previous))
        self.changed, self.change_note = False, None
        if self.handed_over is not None:  # full guards, no checks (H51)
            module.__dict__["forward"] = plain_forward_for(self, self._func)
            return
        module.__dict__["forward"] = self._wrapper
        self.watch_modules()

    def watch_modules(self) -> None:
        """Events of every module and parameter in the target mark it
        (:mod:`guardtrain.compile.watch`)."""
        self.params = list(self.module.parameters())
        _watch.watch(self, self.module.modules())

    def uninstall(self) -> None:
        """Restore the module's ``forward`` and ``__getstate__`` as they were.

        The compiled code and its Dynamo cache are kept for :meth:`install`.
        """
        for key, value in self._previous.items():
            if value is _MISSING:
                self.module.__dict__.pop(key, None)
            else:
                self.module.__dict__[key] = value
        self._previous = {}
        _watch.unwatch(self)
        self.set_under_stance(False)

    def rebuild(self) -> None:
        """Compile a fresh code object: every entry of the old one is forgotten, for
        every target that shares it."""
        self.code.rebuild()

    def leave_shared_code(self, why: str) -> None:
        """Give this target private code of its own (it no longer fits the shared one)."""
        old = self.code
        old.members.remove(self)
        old.current = None
        self.own_code = why
        kept_filter = old.guard_filter if old.drops_guards else None
        self._own_code(old.compile_kwargs, kept_filter, self.requested_free_tensors, shared=False)

    def cache_entries(self) -> int:
        """Cache entries Dynamo holds for the root code (-1 when this torch cannot tell)."""
        return self.code.cache_entries()

    # -- what the code tells its members -----------------------------------------------------

    def code_rebuilt(self) -> None:
        """The code was rebuilt: nothing harvested, accepted, called or fingerprinted."""
        self.kept.stale()
        self.forget_dispatch()
        self.calls = 0
        self.reference = None

    def entries_changed(self) -> None:
        """An entry was compiled: forget the dispatch; watch what the guards now read."""
        self.forget_dispatch()
        self.versions.reset(*polled_objects(self.code.assertions, self.scope()))

    def code_compiled(self, reason: str | None) -> None:
        """This member's call compiled an entry: it fits it, and the hook is told."""
        self.checked_generation = self.code.generation
        self._on_compile(self, reason)

    # -- the stance, and what the engine asks ------------------------------------------------

    def set_under_stance(
        self, on: bool, stances: Stances | None = None, keep: bool = False
    ) -> None:
        """The steady state starts or ends: calls set the stance around their own compiled
        call (``stances``: what they write, H41), and with direct dispatch allowed run
        harvested entries. Off empties the dispatch table (harvested again when the
        steady state is next on). Known states go stale, but with ``keep`` (a loop pass
        starts or ends, H46): then what the calls learnt (the dispatch table, the keys
        admitted) is kept as the current state's, and put back when the stance is next on
        if the state is still the same."""
        if stances is not None:
            self.plain_stance, self.unsafe_stance = stances.plain, stances.unsafe
        self.under_stance = on = on and self.handed_over is None  # full guards: never (H51)
        if not keep:
            self.kept.stale()  # after a time outside the stance, what was kept may be stale
        elif on:
            _states.resume(self)  # what the calls learnt before the loop pass ended (H46)
        else:
            _states.leave(self)  # a loop pass starts or ends: kept for the next (H46)
        if (on or not keep) and not self.changed and self.kept.state is None:
            self.kept.state = _states.state_key(self, self.code.autocast)  # learnt from now on
        # With graph breaks too: an entry that breaks runs with full guards (H4), the
        # others directly; such a target never runs under the stance (forward.steady).
        self.direct = on and self.direct_allowed and self.unverified is None
        if not on:
            self.forget_dispatch()

    def forget_dispatch(self) -> None:
        """Empty the dispatch table and the accepted argument keys (entries may change)."""
        self.learnt = _states.Learnt()
        self.last_key: tuple[Any, ...] | None = None
        self.last_mode: CallMode | None = None
        self.last_decode = False
        self.key_of: Callable[..., Any] = promoting(self)

    def allow_direct_dispatch(self, allowed: bool) -> None:
        """Whether calls under the stance may run harvested entries (turbo, H30)."""
        self.direct_allowed = allowed

    def pair_calls_across_ranks(self, paired: bool) -> None:
        """With guard collectives every compiled call is paired across ranks: a stance
        miss is retried with the plain ``forward``, and no check runs on this rank alone."""
        self.retry_eagerly = paired

    def start_checking(self) -> None:
        """A batch with an unseen signature: each call under the stance is checked (H26)."""
        self.checking = True

    def stop_checking(self) -> int:
        """End :meth:`start_checking`; returns the calls checked and accepted since."""
        checked, self.checks, self.checking = self.checks, 0, False
        return checked

    def check_rows(self) -> tuple[int, int]:
        """What one general check before a call walks: the fingerprint's rows (parameters,
        buffers, hook lists, each walked in Python) and the recorded assertions (evaluated
        together per entry, :mod:`~guardtrain.compile.fastcheck`)."""
        rows = len(self.reference) if self.reference is not None else 0
        return rows, sum(len(recorded) for recorded in self.code.assertions)

    def take_reference(self) -> None:
        """Fingerprint the module now: later changes are measured against it."""
        self.reference = module_fingerprint(self.module)

    def forget_reference(self) -> None:
        """No fingerprint until :meth:`take_reference` (taken after the next compile)."""
        self.reference = None

    def call_scope(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The trampoline frame's locals for a call: what its guard managers read."""
        return self.code.call_scope(self, args, kwargs)

    def scope(self) -> dict[str, Any]:
        """What the recorded assertions evaluate in: the frame's module and ``G``."""
        return self.code.scope(self)

    def check_assertions(self, globals_too: bool = True) -> tuple[str | None, str | None]:
        """``(stale, unmatched)`` of :func:`guardtrain.compile.assertions.check` for this
        target's assertions; :attr:`last_failed` is the assertion named."""
        stale, unmatched, self.last_failed = check(
            self.code.assertions, self.scope(), self.name, globals_too
        )
        return stale, unmatched

    def start_verify(self, rtol: float, atol: float) -> None:
        """Run the eager ``forward`` beside each compiled call (:mod:`~guardtrain.compile.verify`)."""
        _verify.start_verify(self, rtol, atol)

    def stop_verify(self) -> str | None:
        """End verification; describe the first mismatch seen, or return None."""
        return _verify.stop_verify(self)


def steady_now() -> bool:
    """Whether some installed target is in the steady state now: its calls set the stance
    around their own compiled calls (H41). Torch's stance itself is set only during such
    a call, so this is what a test or script reads between calls."""
    return any(getattr(t, "under_stance", False) for t in _watch.watched())


def _getstate_without(module: nn.Module, previous: dict[str, Any]) -> Callable[[], Any]:
    """An instance ``__getstate__`` for ``module`` whose state has ``previous`` (what the
    installed attributes replaced) instead of guardtrain's attributes."""
    class_getstate = type(module).__getstate__

    def __getstate__() -> Any:
        state = class_getstate(module)
        if isinstance(state, dict):
            state = dict(state)
            for key, value in previous.items():
                if value is _MISSING:
                    state.pop(key, None)
                else:
                    state[key] = value
        return state

    return __getstate__


def hand_over(target: CompiledTarget, why: str) -> None:
    """Full guards for ``target`` from now on, as ``torch.compile`` has them: every guard
    kept and no ``install_free_tensors`` from the next rebuild on, never the stance, no
    change tracking, and a ``forward`` that calls the compiled code with none of
    guardtrain's per-call checks; Dynamo's recompile limit applies (H51). ``why`` says
    what made it so. The caller rebuilds it where its entries dropped guards."""
    target.handed_over = why
    target.code.keep_every_guard()
    target.set_under_stance(False)
    target.kept.known.clear()
    _watch.unwatch(target)
    if target.installed:
        target.module.__dict__["forward"] = plain_forward_for(target, target._func)
