"""Changes made between two calls: what the check finds, what to do, and the count by kind.

:func:`revalidate` is the one check: at loop boundaries and audits (H33), and before a
call when an event or a namespace version says that something a target reads may have
changed:

* the module's fingerprint moved (a replaced parameter or buffer, a hook added or
  removed): the compiled entries assumed the old objects, and Dynamo would not
  recompile on its own (H3, H34, H35): **rebuild**;
* an assertion that the filter dropped, or that the stance skips without a failing
  entry, no longer holds: **rebuild**;
* no entry's kept assertions hold (a new scalar value, another ``training`` flag):
  Dynamo recompiles by itself with full guards: **leave the stance** (under the
  stance; nothing to do outside it);
* a tensor held as a plain module attribute was replaced (a pruning pre-hook's masked
  weight, computed outside the compiled call): ``install_free_tensors`` kept the old one
  in the graph (H3): switch that lever off for the target and **rebuild**;
* before all of these, the parameters' ``requires_grad`` moved (H42): the engine
  switches to the code compiled for the new pattern, kept from earlier
  (:mod:`guardtrain.compile.grads`), and the check runs on it.

:func:`revalidate` returns a :class:`Found`, a record (what to do, the kind of change, whose
hooks, the words for people); the engine acts on its fields, never on its words, and
:class:`ChangeLog` counts each kind for ``summary()["caught_changes"]``.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from guardtrain.fingerprints import ModuleChange, fingerprint_change, module_fingerprint

__all__ = [
    "Action",
    "Change",
    "ChangeLog",
    "Found",
    "found_in",
    "revalidate",
    "stale_found",
]


class Change(enum.StrEnum):
    """The kinds of change counted in ``summary()["caught_changes"]``."""

    ARGUMENTS = "arguments"
    """A plain argument, ``None`` for a tensor, a keyword or a container's structure (H32)."""
    GLOBALS = "globals"
    """A global the compiled frames read: a scalar, a function, a module (H31, H33)."""
    MODULE_STATE = "module_state"
    """An attribute of a module or of an object its guards read, a submodule's mode (H33)."""
    HOOKS = "hooks"
    """A hook added to or removed from a module, or a global module hook (H34)."""
    PARAMETERS = "parameters"
    """A parameter or buffer replaced by another object (H3, H35)."""
    REQUIRES_GRAD = "requires_grad"
    """A parameter's ``requires_grad`` flipped: frozen or unfrozen (H42)."""
    SKIPPED = "skipped"
    """Not a change of the model: Dynamo skipped the target's code, which ran uncompiled
    (H18); a boundary rebuilds it."""


class Action(enum.StrEnum):
    REBUILD = "rebuild"
    """Forget the target's compiled entries: the next call compiles afresh."""
    LEAVE = "leave"
    """Leave the stance: the call runs with full guards and Dynamo recompiles."""


class Found(NamedTuple):
    """A change found in a target, and what it calls for."""

    action: Action
    kind: Change
    detail: str
    """What changed, in words for people (a message is made of it, never parsed)."""
    hooks_of: str | None = None
    """For a change of hooks: the submodule whose hooks changed, by its path in the
    target (None: the target's own module)."""

    def named(self, old: str, new: str) -> Found:
        """The same change with ``old`` in its words replaced by ``new`` (a name)."""
        return self._replace(detail=self.detail.replace(old, new))


def found_in(change: ModuleChange, action: Action = Action.REBUILD) -> Found:
    """A fingerprint's difference as a :class:`Found`: its kind from the row that moved."""
    kind = Change.HOOKS if change.row == "hooks" else Change.PARAMETERS
    return Found(action, kind, change.detail, change.hooks_of)


def revalidate(target: Any, under_stance: bool, swaps_parameters: str | None) -> Found | None:
    """What a change in ``target`` calls for, or None when its entries still fit.

    The one check of a target's entries against its module: before a call when an event
    or a moved version says something it reads may have changed, at loop boundaries and at
    audits; never per call. It checks the code of the parameters' ``requires_grad``
    pattern, which the engine switches to first (H42, ``Repairs.revalidate``). In order:
    a tensor held as a plain attribute, the module's fingerprint (a walk), the recorded
    assertions.
    A leave is said only ``under_stance`` (outside it Dynamo checks every guard itself).

    ``swaps_parameters`` (FSDP): it swaps the parameter objects around every forward by
    design, and without ``install_free_tensors`` they are graph inputs read afresh by
    every call, so only the fingerprint's hook rows are compared.
    """
    replaced, target.tensor_attribute = target.tensor_attribute, None
    if replaced is not None and target.code.install_free_tensors:
        # No fingerprint lists a plain attribute's tensor, and the graph kept the one it
        # read (H3): without the lever the tensor is a graph input, read at each call.
        detail = f"{replaced} (a tensor held as a plain attribute)"
        target.free_tensors_off(f"{detail}: install_free_tensors would keep the old one")
        return Found(Action.REBUILD, Change.PARAMETERS, detail)
    if target.reference is not None:
        then, now = target.reference, module_fingerprint(target.module)
        if swaps_parameters and not target.code.install_free_tensors:
            then, now = _hook_rows(then), _hook_rows(now)
        change = fingerprint_change(then, now)
        if change is not None:
            return found_in(change)
    stale, unmatched = target.check_assertions()
    if stale is not None:
        return stale_found(target, stale)
    if unmatched is not None and under_stance:
        return Found(Action.LEAVE, _assertion_kind(target), unmatched)
    return None


def _hook_rows(fingerprint: tuple[Any, ...]) -> tuple[Any, ...]:
    """The hook rows of a :func:`module_fingerprint` (no parameter or buffer rows)."""
    return tuple(row for row in fingerprint if row[0] == "hooks")


def stale_found(target: Any, stale: str) -> Found:
    """A rebuild for ``stale``, the assertion of ``target`` that no longer holds."""
    detail = f"{stale} (a guard that was dropped or skipped)"
    return Found(Action.REBUILD, _assertion_kind(target), detail)


def _assertion_kind(target: Any) -> Change:
    """The kind of change behind ``target``'s last failed assertion: a global's, or the
    module's state."""
    failed = target.last_failed
    return Change.GLOBALS if failed is not None and failed.glob else Change.MODULE_STATE


class ChangeLog:
    """Caught changes by kind: a count and the first reason of each."""

    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, Any]] = {}

    def add(self, kind: Change, reason: str) -> bool:
        """Count one change; True for the first of its kind (to be logged once)."""
        found = self.kinds.get(kind.value)
        if found is None:
            self.kinds[kind.value] = {"count": 1, "first": reason}
            return True
        found["count"] += 1
        return False

    def summary(self) -> dict[str, dict[str, Any]]:
        return {kind: dict(v) for kind, v in self.kinds.items()}
