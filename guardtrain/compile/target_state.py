"""What the per-call path reads and writes on a target: :class:`TargetState`.

The wrapper (:mod:`guardtrain.compile.forward`), the stance's acceptance checks
(:mod:`guardtrain.compile.accept`), harvesting (:mod:`guardtrain.compile.harvest`) and
verify batches (:mod:`guardtrain.compile.verify`) work on a target through this
protocol; :class:`~guardtrain.compile.target.CompiledTarget` implements it. The state
lives on the target itself: on the per-call path each read is one attribute lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torch import nn

from guardtrain.compile.call_mode import CallMode
from guardtrain.compile.code import TargetCode
from guardtrain.compile.known_states import Flips, Kept, Learnt
from guardtrain.compile.miss import Miss
from guardtrain.compile.polled import Polled

__all__ = ["CallCounts", "TargetState"]


@dataclass(slots=True)
class CallCounts:
    """The calls of one run's targets, counted together: one set per run, which each of its
    targets counts into (``summary()`` reads it whole)."""

    direct_calls: int = 0
    """Steady calls run directly (turbo, H30)."""
    full_guard_calls: int = 0
    """Steady calls run with full guards: arguments no key describes (a module, an
    object), or no entry that the stance may run accepts them."""
    decode_calls: int = 0
    """Calls carrying a transformers cache served under the stance or directly (H53)."""
    decode_full_guards: int = 0
    """Calls carrying a transformers cache run with full guards (warm-up, audits, or no
    entry's check let them through)."""
    swaps: int = 0
    """Flips back to a known state, served without a check (H46)."""
    grad_swaps: int = 0
    """Of those, the ones whose ``requires_grad`` pattern differed."""


class TargetState(Protocol):
    """One target as its per-call path sees it."""

    name: str
    """The module's dotted name in the root module (``""`` for the root itself)."""
    module: nn.Module
    bound: Callable[..., Any]
    """The module's own ``forward``, bound to it: what an eager call runs."""
    code: TargetCode
    """The compiled code this target runs; shared by every member of a group (H24)."""
    compiled: Callable[..., Any]
    """What a call with Dynamo's guards runs: the code's compiled trampoline (the
    verifying wrapper during a verify batch)."""
    on_miss: Callable[[Any, Miss], bool]
    """Called when a call leaves the stance; True when it may be retried with full guards."""
    on_change: Callable[[Any, str], None] | None
    """Called with what changed before a call of a target whose state may have changed:
    the engine checks the target and rebuilds it or leaves the stance (H33)."""

    under_stance: bool
    """True in the steady state: each call runs under the stance, set for that call alone
    (H41), or directly (turbo)."""
    plain_stance: Any
    """Torch's stance as the run found it: what a steady call expects to find, and puts
    back after its compiled call (:class:`~guardtrain.compile.stances.Stances`)."""
    unsafe_stance: Any
    """``plain_stance`` with ``skip_guard_eval_unsafe``: set around a steady compiled call."""
    direct: bool
    """True while calls under the stance may run a harvested entry directly (turbo)."""
    learnt: Learnt
    """What its calls learnt about the entries in its current state: the dispatch table,
    the keys admitted or sent to full guards (:class:`~guardtrain.compile.known_states.
    Learnt`); emptied whenever the stance goes off, on a compile and on every rebuild."""
    checking: bool
    """While True (a batch with an unseen signature under the stance), each call under
    the stance first evaluates the cache entries' guards itself (H26)."""
    checks: int
    """Calls checked that way, and accepted."""
    retry_eagerly: bool
    """Retry a stance miss with the plain ``forward``: with guard collectives the miss
    may be another rank's, and a second compiled call here would issue a collective
    that the other ranks never match."""
    changed: bool
    """Set by an event (:mod:`guardtrain.compile.watch`): a module in this target was
    assigned to, or gained or lost a hook; the next call checks the target first (H33,
    H34)."""
    change_note: str | None
    """What the first event since the last check was."""
    tensor_attribute: str | None
    """Set by an event: a tensor held as a plain module attribute (not a parameter or
    buffer) was replaced outside compiled code, which ``install_free_tensors`` would
    keep in the graph (H3); the check switches that lever off for the target."""
    flips: Flips
    """What the flip events keep (``requires_grad``, ``training``, plain attributes): a
    known state may be put back (:mod:`~guardtrain.compile.known_states`, H46)."""
    kept: Kept
    """The known states, and what makes them stale."""
    dirty: bool
    """Set by every trigger (an event, a batch's start, the code compiled or swapped): the
    next call attends to :attr:`changed`, :attr:`first_call` and the code's generation
    before it runs (:func:`~guardtrain.compile.forward.attend`); clear, a call checks
    none of them."""
    first_call: bool
    """Set before each batch: the next call is the batch's first, which checks the
    parameters' ``requires_grad`` that no event sees (H42)."""
    params: list[Any]
    """The module's parameters, in ``parameters()`` order (their ``requires_grad`` pattern
    picks the code, :mod:`guardtrain.compile.grads`)."""
    versions: Polled
    """Global namespaces, plain objects' and classes' dictionaries, and lists that this
    target's guards read, as they were at the last compile or check."""
    last_key: tuple[Any, ...] | None
    """The argument key of the last call admitted under the stance."""
    key_of: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    """What makes a steady call's key: ``call_key`` through
    :func:`~guardtrain.compile.repeat.promoting` until a key repeats, then one made for
    that key (:mod:`guardtrain.compile.repeat`)."""
    last_mode: CallMode | None
    last_decode: bool
    """Whether :attr:`last_key` describes a transformers cache (a ``generate()`` call, H53)."""
    guard_ns: list[int]
    """The time (ns) of full guard checks of the stance's entry on calls in check windows
    (:func:`~guardtrain.compile.accept.stance_entry`), at most
    :data:`~guardtrain.compile.accept.GUARD_SAMPLES`: reported, never decided on."""
    counts: CallCounts
    """Its run's call counts, which it counts into."""
    checked_generation: int
    """The code's generation at which this member was last checked against its entries."""
    calls: int
    """Calls outside the stance since the last rebuild (a called target with no compile
    ran uncompiled: Dynamo skipped its code)."""
    unverified: Callable[..., Any] | None
    """During a verify batch, what :attr:`compiled` was before it (else None)."""
    mismatch: str | None
    """The first difference from eager that the current verify batch saw."""
    handed_over: str | None
    """Why this target keeps full guards for the rest of the run (H51), or None."""
    uncompiled: bool
    """Its calls outside the stance run the module's own ``forward``, uncompiled, until the
    engine splits it: its entries are stale or about to be dropped (H51, H52)."""
    general_checks: int
    """Checks before calls after a change that was not a flip back to a known state: what
    the engine weighs against the guards the steady state skips (counts, H51)."""

    @property
    def installed(self) -> bool:
        """Whether the compiled ``forward`` is installed on the module."""

    def call_scope(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The trampoline frame's locals for a call: what its guard managers read."""

    def rebuild(self) -> None:
        """Compile a fresh code object, for every target that shares it."""

    def leave_shared_code(self, why: str) -> None:
        """Give this target private code of its own."""

    def drifted(self) -> bool:
        """Whether this member of shared code no longer has the group's structure."""

    def check_assertions(self, globals_too: bool = True) -> tuple[str | None, str | None]:
        """Re-check what this target's guards asserted: ``(stale, unmatched)``."""

    def free_tensors_off(self, why: str) -> None:
        """Switch ``install_free_tensors`` off for this target's code."""

    def set_under_stance(self, on: bool) -> None:
        """The stance went on or off."""

    def watch_modules(self) -> None:
        """Events of every module in the target mark it."""

    def forget_dispatch(self) -> None:
        """Empty the dispatch table and the accepted argument keys (entries may change)."""

    def code_rebuilt(self) -> None:
        """The code was rebuilt: forget what was learnt about its entries."""

    def entries_changed(self) -> None:
        """An entry was compiled: forget what was harvested or accepted."""

    def code_compiled(self, reason: str | None) -> None:
        """This member's call compiled an entry (``reason``: Dynamo's recompile reason)."""
