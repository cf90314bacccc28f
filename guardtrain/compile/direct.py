"""Turbo's direct dispatch: one harvested cache entry, and what a call must match to run it.

Under the stance a target with ``direct_dispatch`` keeps a *dispatch table* per call
mode (``target.learnt.dispatch_table``): the entries Dynamo chose for real calls,
each a :class:`DirectEntry`. A later call whose key, global state and tensors match
one runs its code directly, below Dynamo's entry path (H30); harvesting is in
:mod:`guardtrain.compile.harvest`.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn

from guardtrain._torch import guards, live_codes
from guardtrain.compile.caches import in_key
from guardtrain.compile.symbolic import beyond_arguments, has_shape_guards, symbolic_dims
from guardtrain.compile.trampoline import TRAMPOLINE_GLOBALS, cache_entry_list
from guardtrain.guardcheck import check as _guard_check

__all__ = ["DIRECT_LIMIT", "DirectEntry", "direct_supported", "live_codes", "whole"]

_guards = guards
DIRECT_LIMIT = 8
"""Entries harvested per mode (input signatures, e.g. a short last batch)."""


def direct_supported() -> bool:
    """Whether this torch has what direct dispatch needs (else turbo is refused)."""
    return (
        cache_entry_list is not None
        and live_codes is not None
        and hasattr(_guards, "TensorGuards")
        and hasattr(_guards, "GlobalStateGuard")
    )


class DirectEntry:
    """One harvested cache entry of a trampoline, and what a call must match to run it.

    Made from a real call that the entry's own guard manager accepted (every guard
    the filter kept); a later call runs the entry's code directly when its mode is
    the same, Dynamo's global-state guard holds, its arguments have the same
    structure and plain values, and its tensors pass ``TensorGuards`` built from the
    harvested call (dtype, device, ``requires_grad``, dispatch keys, sizes, strides).
    The key also holds which arguments are one tensor (Dynamo guards aliasing
    between inputs).

    Two kinds of entry need more of the entry's own guards (:attr:`rest`: its diff guards
    without the arguments' subtrees, one call into C):

    * When several entries were compiled for the call's mode, the guards that tell its
      entries apart outside the arguments (a module attribute, a submodule's ``training``
      flag, a global value): what the stance itself evaluates.
    * An entry compiled with symbolic sizes (a decode call's cache length, H53): its
      ``TensorGuards`` leave those dimensions free (:func:`~guardtrain.compile.symbolic.
      symbolic_dims`), and its shape guards decide them (the length inside the range
      compiled for, sizes that must agree). A call of sizes other than the harvested
      call's must also find no earlier entry (in cache order) whose diff guards pass:
      Dynamo would run the first entry that accepts it.
    """

    __slots__ = (
        "code",
        "decode",
        "earlier",
        "fn",
        "global_state",
        "key",
        "rest",
        "symbolic",
        "tensors",
    )

    def __init__(
        self,
        entry: Any,
        closure: tuple[types.CellType, ...],
        key: tuple[Any, ...],
        tensors: list[torch.Tensor],
        several: bool,
        scope: dict[str, Any],
        earlier: list[Any],
    ) -> None:
        self.code: types.CodeType = entry.code
        self.fn = types.FunctionType(
            entry.code, TRAMPOLINE_GLOBALS, entry.code.co_name, None, closure
        )
        self.key = key
        manager = entry.guard_manager
        dims = None
        if has_shape_guards(manager) and nn.Parameter not in key:
            # Not with a parameter as an input: the diff guards leave its metadata out.
            dims = symbolic_dims(entry, scope, tensors)
        sizes: Any = None  # None: every dimension as the tensor has it now
        strides: Any = None
        if dims is not None:
            sizes = [_free(t.shape, d[0]) for t, d in zip(tensors, dims)]
            strides = [_free(t.stride(), d[1]) for t, d in zip(tensors, dims)]
        self.tensors = _guards.TensorGuards(
            *tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides
        )
        self.global_state = _guards.GlobalStateGuard()
        self.rest: Any = None
        """The entry's diff guards beyond the arguments, where :meth:`matches` needs them
        (several entries for the mode, or symbolic sizes); else None. Entries are added
        only with the stance off, which empties every dispatch table, so a table never
        outlives a change in their number."""
        self.earlier: tuple[Any, ...] = ()
        """With symbolic sizes, the guard managers of the entries before this one."""
        if several or dims is not None:
            self.rest = beyond_arguments(manager)
            if self.rest is None and dims is not None:  # no clone: the sizes harvested only
                self.tensors = _guards.TensorGuards(
                    *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None
                )
                dims = None
            if self.rest is None and several:
                self.rest = _WholeDiff(manager)
        if dims is not None:
            self.earlier = tuple(earlier)
        self.symbolic = dims is not None
        """Whether its ``TensorGuards`` leave some sizes to the shape guards."""
        self.decode = in_key(key)
        """Whether the calls it serves carry a transformers cache (counted apart)."""

    def matches(
        self,
        key: tuple[Any, ...],
        tensors: list[torch.Tensor],
        scope: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> bool:
        """Whether a call with this key and these tensors may run this entry (``scope(args,
        kwargs)`` gives the frame's locals, for the entry's own guards)."""
        if not (
            key == self.key
            and id(self.code) in live_codes  # type: ignore[operator]  # none: no entry made
            and self.global_state.check()
            and self.tensors.check(*tensors)
        ):
            return False
        rest = self.rest
        if rest is None:
            return True
        frame = scope(args, kwargs)
        if not _guard_check(rest, frame):
            return False
        for manager in self.earlier:  # Dynamo rebuilds the diff guards when entries change
            root = manager.diff_guard_root
            if root is None or _guard_check(root, frame):
                return False
        return True


class _WholeDiff:
    """The entry's whole diff guard tree, read at each check (a torch without
    ``clone_manager``: Dynamo rebuilds the tree when entries change)."""

    __slots__ = ("manager",)

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def check(self, scope: dict[str, Any]) -> bool:
        root = self.manager.diff_guard_root
        return root is None or bool(root.check(scope))


_RESUME_PREFIXES = ("torch_dynamo_resume_in_", "__resume_at_")
"""How Dynamo names the resume functions of a frame it broke: the function's own name, and
the global that the compiled code calls it by."""


def whole(code: types.CodeType) -> bool:
    """Whether an entry's code runs its whole call as one compiled graph: it calls a
    compiled graph and no resume function. A trampoline's frame that broke the graph at
    its call into the module's ``forward`` (a break inside it) has no graph at all: the
    ``forward`` then runs as a frame of its own. An entry that breaks runs with full
    guards: run directly, the frames after the break would run uncompiled, and under the
    stance a miss there would come after part of the call ran (H4)."""
    names = code.co_names
    return any(n.startswith("__compiled_fn") for n in names) and not any(
        n.startswith(_RESUME_PREFIXES) for n in names
    )


def _free(values: Any, dims: tuple[int, ...]) -> list[int | None]:
    """``values`` (sizes or strides) with ``None`` at ``dims``: left to the shape guards."""
    return [None if i in dims else int(v) for i, v in enumerate(values)]
