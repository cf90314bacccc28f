"""Compiled code: one trampoline and what Dynamo compiled for it, private or shared.

A :class:`TargetCode` belongs to one target (private code) or to a group of
identical blocks (shared code, H24; :func:`structure_key`, :func:`share_groups`).
What it holds is shared by every member: a write to it (``graph_breaks``, the guard
filter, ``install_free_tensors``) is a write for the whole group, which is why the
engine writes it as ``target.code.<...>``.
"""

from __future__ import annotations

import enum
import functools
import re
import types
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

import guardtrain.compile.watch as _watch
from guardtrain._torch import reset_code
from guardtrain.compile.assertions import (
    Assertion,
    Recorded,
    attribute_names,
    global_assertions,
    kept_global_assertions,
    recorded_guards,
    user_path,
)
from guardtrain.compile.call_mode import (
    CallMode,
    inlined_hooks_active,
    mode_of,
    unambiguous_modes,
)
from guardtrain.compile.direct import whole
from guardtrain.compile.options import build_compile_kwargs
from guardtrain.compile.resolve import forward_function
from guardtrain.compile.trampoline import (
    CLOSURE_NAME,
    SHARED_NAME,
    TRAMPOLINE_GLOBALS,
    cache_entry_list,
    compiling_frame,
    new_trampoline,
    trampoline_function,
)
from guardtrain.filters import SAVED_TENSORS_HOOKS, GuardFilter, is_rechecked, keep_all

__all__ = ["VARIANT_LIMIT", "CodeMember", "TargetCode", "share_groups", "structure_key"]

VARIANT_LIMIT = 8
"""Variants (``requires_grad`` pattern and autocast state) kept per code family
(:meth:`TargetCode.variant`)."""


class CodeMember(Protocol):
    """What compiled code needs of each target that runs it."""

    name: str
    module: nn.Module
    bound: Callable[..., Any]
    compiled: Callable[..., Any]
    dirty: bool
    """Set when the code compiles or is rebuilt: the member's next call attends to it."""

    def code_rebuilt(self) -> None:
        """The code was rebuilt: forget what was learnt about its entries."""

    def entries_changed(self) -> None:
        """An entry was compiled: forget what was harvested or accepted."""

    def code_compiled(self, reason: str | None) -> None:
        """This member's call compiled an entry (``reason``: Dynamo's recompile reason)."""


class TargetCode:
    """One compiled trampoline and what Dynamo compiled for it.

    A target alone has *private* code: the trampoline calls the instance's bound
    ``forward`` from a closure, and may use ``install_free_tensors`` (H12).
    Targets of one class and one structure (:func:`structure_key`) *share* code
    (H24): the trampoline takes the module as its first argument, so parameters
    are graph inputs and one Dynamo trace serves every instance, as with
    ``block.compile()``; ``install_free_tensors`` is off for it.
    """

    def __init__(
        self,
        func: types.FunctionType,
        compile_kwargs: dict[str, Any],
        guard_filter: GuardFilter | None,
        install_free_tensors: bool,
        shared: bool,
    ) -> None:
        self.func = func
        """The module's plain ``forward`` function."""
        self.shared = shared
        self.install_free_tensors = install_free_tensors and not shared
        self.drops_guards = guard_filter is not None and guard_filter is not keep_all
        """Whether the installed filter drops guards (off, keep all, for graph breaks)."""
        self.members: list[CodeMember] = []
        self.current: CodeMember | None = None
        """The member whose call is running (the one a compile is reported for)."""
        self.generation = 0
        """Counts compiles and rebuilds: a member re-checks its fit when it moved."""
        self.compiles = 0
        self.compile_kwargs = compile_kwargs
        self.guard_filter = guard_filter or keep_all
        self._inner_codes: set[types.CodeType] = set()
        self.prefix = SHARED_NAME if shared else CLOSURE_NAME
        self.group_key: tuple[Any, ...] | None = None
        """The :func:`structure_key` its members had when they were grouped (shared code)."""
        self.trampoline: types.CodeType
        """The trampoline's code object: the frame Dynamo compiles and caches entries for."""
        self.compiled: Callable[..., Any]
        self.assertions: list[tuple[Assertion, ...]] = []
        """What each compile's guards asserted (:mod:`guardtrain.compile.assertions`)."""
        self.modes: set[CallMode] = set()
        """The mode of every compile."""
        self.mode_compiles: dict[CallMode, int] = {}
        """Compiles per mode: with more than one, entries of one mode differ by guards
        that the mode key does not cover (a module attribute, a global; H30)."""
        self.stance_modes: set[CallMode] = set()
        """The modes a call may have under the stance: compiled, and, unless a
        ``.training`` guard failed once (the stance evaluates guards that failed,
        H1), the only training value compiled with that grad mode and autocast:
        otherwise the stance picks among entries by global state and shapes and
        cannot tell a training entry from an eval one (a validation call would run
        the training graph)."""
        self.graph_breaks = False
        self.broken_modes: set[CallMode] = set()
        """The modes in which an entry of the trampoline breaks the graph: their calls run
        with full guards, never under the stance, whose miss in a resumed frame would come
        after part of the call ran (H4). Calls of the other modes are served."""
        self.own_compiles = 0
        """Compiles of the trampoline's own frame (one entry each)."""
        self.own_mode: CallMode | None = None
        """The mode of the latest compile of the trampoline's own frame."""
        self.guard_count = 0
        """The most guards an entry of the trampoline kept: what a call with full guards
        evaluates."""
        self.plain_guard_count = 0
        """The most guards Dynamo built for an entry of the trampoline, before the filter:
        what plain compile evaluates for such a call, and a steady call skips (H51 weighs
        checks against it)."""
        self.closure: tuple[types.CellType, ...] = ()
        self.keep_hooks_guard = False
        """Keep the saved-tensor-hooks guard in every compile: hooks that Dynamo
        inlines were active at a call or a compile (H31). Survives rebuilds."""
        self.dropped_hooks_guard = False
        """A compile of the current code dropped the saved-tensor-hooks guard."""
        self.pattern: tuple[bool, ...] | None = None
        """The parameters' ``requires_grad`` (in ``parameters()`` order) that every entry
        of this code was compiled for (H42)."""
        self.pattern_bits = b""
        """:attr:`pattern` as bytes, as a target's ``grad_bits`` hold it."""
        self.autocast = False
        """Whether every entry of this code was compiled under autocast (H44)."""
        self.variants: dict[Any, TargetCode] = {None: self}
        """This code and its variants, one per ``(pattern, autocast)``, shared by all of
        them (:meth:`variant`)."""

    def set_pattern(self, pattern: tuple[bool, ...]) -> None:
        """The ``requires_grad`` pattern this code (the first of its family) compiles for,
        outside autocast."""
        self.variants = {(pattern, False): self}
        self.pattern = pattern
        self.pattern_bits = bytes(pattern)

    def variant(self, pattern: tuple[bool, ...], autocast: bool) -> TargetCode:
        """The code of this family for ``pattern`` (the parameters' ``requires_grad``)
        and ``autocast``, made without members (the caller adds one and calls
        :meth:`fresh`) when there is none yet (H42, H44). The stance checks neither
        parameters nor, reliably, autocast (an entry's diff guards hold the global state
        of the latest compile): each variant's entries differ in neither, so each state
        is the stance's and turbo's choice in its own code, and a state that comes back
        (``disable_adapter()``, ``toggle_optimizer``) finds its entries compiled. At most
        :data:`VARIANT_LIMIT` are kept; past it the least recently used one without
        members is dropped."""
        key = (pattern, autocast)
        found = self.variants.pop(key, None)
        if found is None:
            found = TargetCode(
                self.func,
                self.compile_kwargs,
                self.guard_filter if self.drops_guards else None,
                self.install_free_tensors,
                self.shared,
            )
            found.keep_hooks_guard = self.keep_hooks_guard
            found.group_key = self.group_key
            found.variants = self.variants
            found.pattern = pattern
            found.pattern_bits = bytes(pattern)
            found.autocast = autocast
        self.variants[key] = found  # the most recently used last
        while len(self.variants) > VARIANT_LIMIT:
            idle = next((k for k, v in self.variants.items() if not v.members), None)
            if idle is None:
                break
            del self.variants[idle]
        return found

    def free_tensors_off(self) -> None:
        """No ``install_free_tensors`` for this code and its variants."""
        for code in self.variants.values():
            code.install_free_tensors = False

    def mark_graph_breaks(self) -> None:
        """A graph break was found after the fact (at the call into a ``forward`` that
        Dynamo never compiles as a frame of its own, H20): for every member."""
        self.graph_breaks = True

    def keep_every_guard(self) -> None:
        """From the next rebuild on, keep every guard and trace without
        ``install_free_tensors`` (graph breaks: the frames after a break run code that
        other instances share, H12), for every member and every variant."""
        for code in self.variants.values():
            code.install_free_tensors = False
            code.drops_guards = False

    def rebuild(self) -> None:
        """Compile a fresh code object for this code and each variant with members (a
        change that makes entries stale holds for every ``requires_grad`` pattern); the
        variants without members are dropped."""
        for key, code in list(self.variants.items()):
            if code is self:
                continue
            if code.members:
                code.fresh()
            else:
                del self.variants[key]
        self.fresh()

    def fresh(self) -> None:
        """Compile a fresh code object: every entry of the old one is forgotten, and every
        member calls the new one.

        Code objects other than the trampoline that were compiled for it (the
        module's own ``forward`` and its resume functions after a graph break)
        are shared with other instances of the class; their entries are dropped
        too (Dynamo's ``reset_code``).
        """
        for code in self._inner_codes:
            if reset_code is not None:
                reset_code(code)
        self._inner_codes = set()
        self.trampoline = new_trampoline(self.shared)
        self.assertions = []
        self.modes = set()
        self.mode_compiles = {}
        self.stance_modes = set()
        self._training_failed = False
        self._root_entries = 0
        self.graph_breaks = False
        self.broken_modes = set()
        self.guard_count = 0
        self.plain_guard_count = 0
        self.dropped_hooks_guard = False
        self.generation += 1
        for member in self.members:
            member.dirty = True
            member.code_rebuilt()
        if not self.drops_guards:
            self.guard_filter = keep_all
        self.closure = (types.CellType(self.func if self.shared else self.members[0].bound),)
        fn = trampoline_function(self.trampoline, self.closure, self.shared)
        self.compiled = torch.compile(fn, **build_compile_kwargs(self.compile_kwargs, self._track))
        for member in self.members:
            member.compiled = self.caller(member.module)

    def caller(self, module: nn.Module) -> Callable[..., Any]:
        """What a call of ``module`` runs: the compiled trampoline (with the module as
        its first argument for shared code)."""
        if not self.shared:
            return self.compiled

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.compiled(module, *args, **kwargs)

        return call

    def call_scope(
        self, member: CodeMember, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """The trampoline frame's locals for a call of ``member``: what its guard
        managers read."""
        if self.shared:
            return {
                SHARED_NAME: member.module,
                "args": args,
                "kwargs": kwargs,
                "forward": self.func,
            }
        return {"args": args, "kwargs": kwargs, CLOSURE_NAME: member.bound}

    def scope(self, member: CodeMember) -> dict[str, Any]:
        """What the recorded assertions evaluate in for ``member``: the frame's module and
        ``G``."""
        if self.shared:
            return {SHARED_NAME: member.module, "G": TRAMPOLINE_GLOBALS}
        return {CLOSURE_NAME: member.bound, "G": TRAMPOLINE_GLOBALS}

    def _track(self, entries: Sequence[Any]) -> list[bool]:
        """The guard filter Dynamo calls at each compile: filters, then records what the
        compile's guards asserted, and tells the members."""
        member = self.current or self.members[0]
        code, reason = compiling_frame()
        own_frame = code is not None and code is self.trampoline
        if not own_frame:
            # A frame after a graph break (the module's own `forward`, its resume
            # functions, a function it called): code that other instances share, whose
            # guards name that frame's locals, which no boundary re-check can evaluate.
            # Every guard stays, so a target with graph breaks is never rebuilt for them.
            # The same where the compiling frame cannot be told (a torch that lays out
            # its `_compile` otherwise): the filter fails closed.
            keep = [True] * len(entries)
        else:
            keep = [bool(k) for k in self.guard_filter(entries)]
        mode = mode_of(member.module)
        self._note_frame(code, own_frame)
        self._note_mode(mode, reason)
        recorded = recorded_guards(entries, keep, self.prefix, member.name, self.shared)
        recorded.extend(self._moved(entries, keep, own_frame))
        if own_frame:
            recorded.extend(kept_global_assertions(entries, keep))
            self.own_mode = mode
            self.guard_count = max(self.guard_count, sum(keep))
            self.plain_guard_count = max(self.plain_guard_count, len(keep))
        self.assertions.append(Recorded(recorded))
        _watch.read_names.update(attribute_names(entries))
        for m in self.members:
            # The entries change: what was accepted or harvested may no longer be what
            # the stance picks (a compile can happen under the stance, H32).
            m.entries_changed()
        shown = None if reason is None else user_path(reason, member.name, self.shared)
        member.code_compiled(shown)
        return keep

    def _note_frame(self, code: types.CodeType | None, own_frame: bool) -> None:
        """Which frame compiles: a graph break's, or the trampoline's (whose entries may
        have been forgotten by Dynamo's ``reset()``)."""
        if code is not None and not own_frame:
            # A graph break: this frame is the module's own `forward` or a resume
            # function of it, code shared with every instance of the class.
            self.graph_breaks = True
            self._inner_codes.add(code)
        elif own_frame:
            existing = self.cache_entries()
            if 0 <= existing < self._root_entries:
                # Entries we recorded are gone (Dynamo's reset()): so is what
                # they asserted, and the modes they were compiled for.
                self.modes.clear()
                self.mode_compiles.clear()
                self.broken_modes.clear()
                self.assertions = []
                self._training_failed = False
            self._root_entries = existing + 1
            self.own_compiles += 1

    def _note_mode(self, mode: CallMode, reason: str | None) -> None:
        """Count a compile for ``mode``, and update the modes the stance may serve."""
        if reason is not None and _names_training(reason):
            # A failed `.training` guard is one the stance evaluates from now on.
            self._training_failed = True
        self.modes.add(mode)
        self.mode_compiles[mode] = self.mode_compiles.get(mode, 0) + 1
        modes = self.modes
        self.stance_modes = set(modes) if self._training_failed else unambiguous_modes(modes)
        self.stance_modes -= self.broken_modes
        self.compiles += 1
        self.generation += 1
        for member in self.members:
            member.dirty = True  # does the new entry fit each member (shared code)?

    def note_entry(self) -> None:
        """After a call that compiled an entry of the trampoline (the newest, for
        :attr:`own_mode`): if that entry breaks the graph, calls of its mode run with full
        guards from now on (:attr:`broken_modes`)."""
        mode = self.own_mode
        if cache_entry_list is None or mode is None:
            return
        entries = cache_entry_list(self.trampoline)
        if entries and not whole(entries[0].code):
            self.broken_modes.add(mode)
            self.stance_modes.discard(mode)

    def _moved(self, entries: Sequence[Any], keep: list[bool], own_frame: bool) -> list[Assertion]:
        """The guards that guardtrain checks itself and the filter dropped (H31).

        Identity guards on globals are recorded for the boundary re-check; one that
        cannot be recorded (a frame other than the trampoline, whose globals are
        another module's, or an expression that does not evaluate to the guarded
        object) is kept. The saved-tensor-hooks guard is kept once hooks that
        Dynamo inlines were seen; otherwise the wrapper checks for hooks per call.
        """
        moved: dict[str, Assertion] = {}
        for i, (entry, kept) in enumerate(zip(entries, keep)):
            if kept or not is_rechecked(entry):
                continue
            if entry.guard_type == SAVED_TENSORS_HOOKS:
                if not self.keep_hooks_guard and inlined_hooks_active():
                    self.keep_hooks_guard = True
                if self.keep_hooks_guard:
                    keep[i] = True
                else:
                    self.dropped_hooks_guard = True
                continue
            found = global_assertions(entry) if own_frame else None
            if found is None:
                keep[i] = True  # never drop what cannot be re-checked
                continue
            for a in found:
                moved.setdefault(a.name, a)
        return list(moved.values())

    def live_entries(self) -> int:
        """The entries a rebuild would drop: the trampoline's, of this code and of each
        variant (a ``requires_grad`` pattern or autocast state that comes back compiles
        again), and those of the frames after their graph breaks."""
        if cache_entry_list is None:
            return 0
        return sum(
            len(cache_entry_list(code.trampoline))
            + sum(len(cache_entry_list(inner)) for inner in code._inner_codes)
            for code in self.variants.values()
        )

    def cache_entries(self) -> int:
        """Cache entries Dynamo holds for the trampoline (-1 when this torch cannot tell)."""
        if cache_entry_list is None:
            return -1
        return len(cache_entry_list(self.trampoline))


_TRAINING_GUARD = re.compile(r"\.training(?![A-Za-z0-9_])")


def _names_training(reason: str) -> bool:
    """Whether a recompile reason's failed guards test a module's ``training`` flag: its
    guard expressions, not the source lines Dynamo quotes after them (``# ...``), and
    ``.training`` as a whole name (not ``.training_frac``)."""
    return any(_TRAINING_GUARD.search(line.partition("#")[0]) for line in reason.splitlines())


_SCALAR_TYPES = (bool, int, float, str, type(None))
_NOT_STRUCTURE = ("training", "forward")  # `forward`: the one guardtrain installs
_IDENTITY_TYPES = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
    type,
)
_VALUE_TYPES = (torch.dtype, torch.device, enum.Enum)


def structure_key(module: nn.Module, func: Any = None) -> tuple[Any, ...]:
    """What two instances must have in common to share compiled code (H24).

    The class and its ``forward``; every submodule's name and class; every parameter's
    and buffer's name, dtype, device and shape, and a buffer's ``requires_grad`` (a
    parameter's picks the code's variant, H42); the hooks (by identity); and each
    submodule's other public attributes: a plain tensor's metadata, a function's
    identity, a dtype's, device's or enum's value, any other object's type. A guard filter may drop
    the guards on these, so an instance that differed in one of them would run
    another's graph. Scalar attributes need not match: their guards are kept
    (H19), so a differing value compiles an entry of its own. What an object
    attribute holds is compared per call by :func:`guardtrain.compile.forward.fit`.
    """
    rows: list[Any] = [type(module), func or forward_function("", module)]
    for name, sub in module.named_modules():
        rows.append((name, type(sub)))
        for key, value in sub.__dict__.items():
            if key.startswith("_") or key in _NOT_STRUCTURE or isinstance(value, _SCALAR_TYPES):
                continue  # a scalar's guard is kept (H19): Dynamo tells values apart
            if isinstance(value, torch.Tensor):  # a plain tensor attribute
                row: Any = (value.dtype, value.device, tuple(value.shape), value.requires_grad)
            elif isinstance(value, _IDENTITY_TYPES):
                row = id(value)
            elif isinstance(value, _VALUE_TYPES):
                row = value
            else:
                row = type(value)
            rows.append((name, key, row))
    for name, p in module.named_parameters():
        # Not `requires_grad`: each pattern has code of its own (TargetCode.variant, H42).
        rows.append(("p", name, p.dtype, p.device, tuple(p.shape)))
    for name, b in module.named_buffers():
        rows.append(("b", name, b.dtype, b.device, tuple(b.shape), b.requires_grad))
    from guardtrain.fingerprints import module_fingerprint

    rows.extend(row for row in module_fingerprint(module) if row[0] == "hooks")
    return tuple(rows)


def share_groups(modules: Sequence[nn.Module]) -> list[int | None]:
    """For each module, the index of the first module whose compiled code it shares.

    Modules with equal :func:`structure_key` share one code object when there
    are two or more of them (H24); each of the others gets ``None`` (code of its
    own, with ``install_free_tensors`` where the preset asks for it).
    """
    keys = [structure_key(m) for m in modules]
    first: dict[Any, int] = {}
    counts: dict[Any, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
        counts[key] = counts.get(key, 0) + 1
    return [first[key] if counts[key] > 1 else None for key in keys]
