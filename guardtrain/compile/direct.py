"""Turbo's direct dispatch: one harvested cache entry, and what a call must match to run it.

Under the stance a target with ``direct_dispatch`` keeps a *dispatch table* per call
mode (``CompiledTarget.dispatch_table``): the entries Dynamo chose for real calls,
each a :class:`DirectEntry`. A later call whose key, global state and tensors match
one runs its code directly, below Dynamo's entry path (H30); harvesting is in
:mod:`guardtrain.compile.harvest`.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from guardtrain.compile.trampoline import TRAMPOLINE_GLOBALS, cache_entry_list
from guardtrain.guardcheck import check as _guard_check

__all__ = ["DIRECT_LIMIT", "DirectEntry", "direct_supported", "live_codes"]

_guards = torch._C._dynamo.guards
live_codes: dict[int, Any] | None = getattr(
    getattr(torch._dynamo.utils, "orig_code_map", None), "values", None
)
"""Dynamo's map from each compiled entry's code to its original code, keyed by ``id``.

``torch._dynamo.reset()`` empties it in place, and an entry's code stays alive while
a dispatch holds it, so ``id(code) in live_codes`` tells whether Dynamo still knows
the entry (H30)."""
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
    between inputs). When several entries were compiled for the call's mode, a call
    must also pass the entry's *diff guards*, the guards that tell its entries apart (a module
    attribute, a submodule's ``training`` flag, a global value): what the stance
    itself evaluates.
    """

    __slots__ = ("code", "fn", "global_state", "key", "manager", "tensors")

    def __init__(
        self,
        entry: Any,
        closure: tuple[types.CellType, ...],
        key: tuple[Any, ...],
        tensors: list[torch.Tensor],
        several: bool,
    ) -> None:
        self.code: types.CodeType = entry.code
        self.fn = types.FunctionType(
            entry.code, TRAMPOLINE_GLOBALS, entry.code.co_name, None, closure
        )
        self.key = key
        # Static sizes and strides (None: every dimension as the tensor has it now).
        self.tensors = _guards.TensorGuards(
            *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None
        )
        self.global_state = _guards.GlobalStateGuard()
        self.manager: Any = entry.guard_manager if several else None
        """The entry's guard manager when other entries may serve a call of the same
        mode: its diff guards pick between them. With one compile per mode the mode
        key and global state already tell the entries apart (their guards check
        grad mode, ``.training`` and autocast), and the diff guards are skipped.
        Entries are added only with the stance off, which empties every dispatch
        table, so a table never outlives a change in their number."""

    def matches(
        self,
        key: tuple[Any, ...],
        tensors: list[torch.Tensor],
        scope: Callable[[], dict[str, Any]],
    ) -> bool:
        """Whether a call with this key and these tensors may run this entry (``scope``
        gives the frame's locals, for the diff guards)."""
        assert live_codes is not None
        if not (
            key == self.key
            and id(self.code) in live_codes
            and self.global_state.check()
            and self.tensors.check(*tensors)
        ):
            return False
        if self.manager is None:
            return True
        root = self.manager.diff_guard_root  # Dynamo rebuilds it when entries change
        return root is None or _guard_check(root, scope())
