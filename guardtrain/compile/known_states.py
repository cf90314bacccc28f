"""Known states: a flip back to a state a target ran in is a swap, not a re-check (H46).

Some state alternates on every step between values that each have code: peft's
``disable_adapter()`` flips the adapters' ``requires_grad`` off and back on around every
DPO reference pass, Lightning's ``toggle_optimizer`` flips the other network's, an RL
loop switches ``eval()`` and ``train()``, and autocast may be on every other step. The
events see each flip (:mod:`guardtrain.compile.watch`), and the general check before the
call (fingerprint, assertions, the stance's choice, a poll reset and a re-watch) cost
more per call than plain compile's whole step (on a 2-layer Llama).

A target's *state* is ``(requires_grad of its parameters, training of its modules, the
plain attributes flips assigned, autocast)``: what the flip events keep
(:class:`Flips`) and the call's autocast. When a target leaves a state it ran in, what
its calls learnt there is kept (:class:`Known`: the code variant, its caller, the keys
admitted, turbo's table, the polled versions), in warm-up too (where only the code and
the versions matter). When it comes back to that state, and only flips were seen since,
that is put back with a dictionary lookup and a few assignments, provided that

* the code has compiled nothing and was not rebuilt since (its ``generation``), and
* nothing else that only the general check would see happened since (:attr:`Kept.epoch`: it
  moves at every check for a change that was not a flip, at every change of the stance
  but a loop pass's start and end, at every rebuild, around verify batches).

Everything the per-call path checks still runs after a swap: the restored versions
compare against what they were when the state was left, and the argument key and mode
against the keys admitted in that state. A state seen for the first time, or no longer
known, takes the general check, and is known from then on.

What the events cannot see (``torch.Tensor.requires_grad_(p)``, FSDP2's ``DTensor``
parameters) the first call of each batch reads from the flags themselves and writes into
the bits (:func:`guardtrain.compile.forward.first_call_of_batch`); between two calls of
one batch such a flip is not seen, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from guardtrain.compile.call_mode import CallMode
from guardtrain.compile.code import TargetCode
from guardtrain.compile.direct import DirectEntry
from guardtrain.compile.polled import Polled

__all__ = [
    "KNOWN_LIMIT",
    "Flips",
    "Kept",
    "Known",
    "Learnt",
    "StateKey",
    "keep",
    "leave",
    "resume",
    "state_key",
    "swap",
]

KNOWN_LIMIT = 16
"""States kept per target; past it the oldest is forgotten (it takes the general check
when it comes back)."""

StateKey = tuple[bytes, bytes, tuple[Any, ...], bool]
"""``(requires_grad bits, training bits, plain attributes assigned, autocast)`` of a target."""


@dataclass(slots=True, eq=False)
class Learnt:
    """What a target's calls learnt about its entries, in its current state: one object,
    held by the target (``target.learnt``), kept by reference when the target leaves the
    state and put back by reference when it comes back (:func:`keep`, :func:`swap`). A
    new table goes here, and nowhere else. Emptied whenever the entries may change
    (:meth:`~guardtrain.compile.CompiledTarget.forget_dispatch` makes a new one)."""

    dispatch_table: dict[CallMode, list[DirectEntry]] = field(default_factory=dict)
    """Harvested entries per mode (direct dispatch), for this module: with shared code
    another member's kept guards (a scalar attribute) may pick another entry."""
    harvests: int = 0
    """Guard-manager evaluations spent harvesting since the table was last emptied."""
    verdicts: dict[CallMode, dict[tuple[Any, ...], str]] = field(default_factory=dict)
    """One verdict per call kind, by mode and argument key
    (:mod:`~guardtrain.compile.accept`): ``ADMITTED``, the stance's own choice of entry was
    shown to accept it (H32; a key with the plain values the stance checks itself masked
    stands for every key like it); ``FULL_GUARDS``, an entry accepts it but not the
    stance's choice (H44); ``BROKEN``, Dynamo's entry for it breaks the graph (H4). The
    last two run with full guards, and a broken one is never harvested."""
    delegated: dict[tuple[Any, ...], frozenset[int]] = field(default_factory=dict)
    """Per key structure, the positions of plain values in the entries' diff guards,
    which the stance evaluates on every call."""


@dataclass(slots=True, kw_only=True)
class Known:
    """What a target's calls learnt in one state, as it was when the target left it."""

    code: TargetCode
    generation: int
    """The code's generation then: a compile or a rebuild since makes this stale."""
    epoch: int
    """The target's :attr:`epoch` then."""
    compiled: Callable[..., Any]
    checked_generation: int
    versions: Polled
    learnt: Learnt
    """The tables, by reference."""
    last_key: tuple[Any, ...] | None
    last_mode: CallMode | None
    last_decode: bool
    key_of: Callable[..., Any]
    """The per-call fields the steady path reads first (kept on the target itself, one
    attribute lookup each)."""


@dataclass(slots=True, eq=False)
class Flips:
    """What the flip events keep of a watched target's state (H46)."""

    only: bool = False
    """Every event since the target's ``changed`` was set was a flip."""
    grad_bits: bytearray = field(default_factory=bytearray)
    """Its parameters' ``requires_grad`` (``parameters()`` order)."""
    train_bits: bytearray = field(default_factory=bytearray)
    """Its modules' ``training`` flags (``modules()`` order)."""
    param_slots: dict[int, int] = field(default_factory=dict)
    """``id(parameter)`` -> its byte in :attr:`grad_bits`."""
    module_slots: dict[int, int] = field(default_factory=dict)
    """``id(module)`` -> its byte in :attr:`train_bits`."""
    attr_values: dict[tuple[int, str], tuple[type, Any]] = field(default_factory=dict)
    """``(id(module), name)`` -> ``(type, value)`` of each plain attribute that guards read
    and that a flip assigned (in the order first assigned; never emptied)."""


@dataclass(slots=True, eq=False)
class Kept:
    """A target's known states, and what makes them stale."""

    known: dict[StateKey, Known] = field(default_factory=dict)
    """What the calls learnt in each state the target left."""
    state: StateKey | None = None
    """The state the target's per-call tables belong to (None: none established since the
    last check)."""
    epoch: int = 0
    """Moves whenever something a kept state assumed may have changed unseen by flips:
    a check of another change, the stance on or off (but for a loop pass's start or end),
    a rebuild."""

    def stale(self) -> None:
        """What was learnt in other states may be stale: no state is established."""
        self.epoch += 1
        self.state = None


def state_key(target: Any, autocast: bool) -> StateKey:
    """The target's state now, for a call with ``autocast``."""
    flips = target.flips
    return (
        bytes(flips.grad_bits),
        bytes(flips.train_bits),
        tuple(flips.attr_values.values()),
        autocast,
    )


def keep(target: Any) -> bool:
    """Keep what ``target``'s calls learnt in the state it is leaving (:attr:`Kept.state`),
    so that a flip back finds it; False when there is nothing to keep (in a verify batch,
    or no state established since the last check)."""
    kept = target.kept
    key = kept.state
    if key is None or target.unverified is not None:
        return False
    known = kept.known
    known.pop(key, None)
    if len(known) >= KNOWN_LIMIT:
        del known[next(iter(known))]
    known[key] = Known(
        code=target.code,
        generation=target.code.generation,
        epoch=kept.epoch,
        compiled=target.compiled,
        checked_generation=target.checked_generation,
        versions=target.versions,
        learnt=target.learnt,
        last_key=target.last_key,
        last_mode=target.last_mode,
        last_decode=target.last_decode,
        key_of=target.key_of,
    )
    kept.state = None
    return True


def leave(target: Any) -> None:
    """Before the general check of a flip: keep the state being left, and give the target
    fresh tables and versions, so that what it learns next is not written into the kept
    ones (the versions are taken again at the end of the check)."""
    if keep(target):
        target.forget_dispatch()
        target.versions = target.versions.successor()


def resume(target: Any) -> None:
    """The steady state is on again after a loop pass started or ended (the state was left
    then, :func:`leave`): what the target's calls learnt in its state before is put back if
    still true (as :func:`swap` checks), without counting a swap."""
    kept = target.kept
    if target.changed or kept.state is not None:
        return
    key = state_key(target, target.code.autocast)
    if key in kept.known:
        swap(target, key, count=False)


def swap(target: Any, key: StateKey, count: bool = True) -> bool:
    """Put back what ``target`` learnt in state ``key``, if it is still true: the same
    epoch, the code not compiled nor rebuilt since and still its family's variant for
    the key's ``requires_grad`` and autocast. The state being left is kept. True when
    swapped; ``count``: a flip, counted in the run's ``swaps`` (``target.counts``)."""
    kept = target.kept
    found: Known | None = kept.known.pop(key, None)
    if found is None:
        return False
    code = found.code
    if (
        found.epoch != kept.epoch
        or found.generation != code.generation
        or code.pattern_bits != key[0]
        or code.autocast is not key[3]
        or code.variants.get((code.pattern, code.autocast)) is not code
    ):
        return False
    left = kept.state
    if count and left is not None and left[0] != key[0]:
        target.counts.grad_swaps += 1  # a requires_grad flip, as the general check counts it
    keep(target)
    old = target.code
    if code is not old:
        old.members.remove(target)
        if old.current is target:
            old.current = None
        code.members.append(target)
        target.code = code
    target.compiled = found.compiled
    target.checked_generation = found.checked_generation
    target.dirty = True  # the code may have compiled since this member was checked
    target.versions = found.versions
    target.learnt = found.learnt
    target.last_key = found.last_key
    target.last_mode = found.last_mode
    target.last_decode = found.last_decode
    target.key_of = found.key_of
    kept.state = key
    target.counts.swaps += count
    return True
