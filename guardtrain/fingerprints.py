"""Module fingerprints: what guards assume about a module that a dropped guard would not see.

:func:`module_fingerprint` is taken at loop and epoch boundaries and audits;
:func:`fingerprint_change` returns the first difference between two of them as a
:class:`ModuleChange`: data (what kind of row, whose), with its words for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from guardtrain._torch import (
    BUFFERS,
    GLOBAL_HOOK_DICTS,
    MODULE_HOOK_DICTS,
    PARAMETERS,
    STATE_DICT_HOOKS,
    module_globals,
)

__all__ = ["ModuleChange", "fingerprint_change", "module_fingerprint"]

ROOT = "<root>"
"""How a fingerprint names the fingerprinted module itself (its own hooks)."""


@dataclass(frozen=True, slots=True)
class ModuleChange:
    """The first difference between two fingerprints."""

    row: str
    """The kind of row that changed: ``"hooks"``, ``"parameter"``, ``"buffer"`` or
    ``"order"`` (the same tensors in another order)."""
    name: str
    """Whose: the submodule (hooks; :data:`ROOT` for the module itself) or the tensor, by
    its path in the fingerprinted module."""
    detail: str
    """What changed, in words (``a forward hook was added to 'embed'``)."""

    @property
    def hooks_of(self) -> str | None:
        """The submodule whose hooks changed, or None (another row, or the module's own)."""
        return self.name if self.row == "hooks" and self.name != ROOT else None

    def __str__(self) -> str:
        return self.detail


_HOOK_DICTS = (*MODULE_HOOK_DICTS, STATE_DICT_HOOKS)


def module_fingerprint(module: nn.Module) -> tuple[tuple[Any, ...], ...]:
    """What guards assume about a module and that a dropped guard would not see.

    Identity, dtype, device and shape of every parameter and buffer, a buffer's
    ``requires_grad``, and the hook functions of every submodule and the global module
    hooks. Run at loop and epoch boundaries (it walks the module):
    ``install_free_tensors`` freezes tensor identity (H3), nn-module guard filters drop
    hook guards (H2), and Dynamo does not enforce hook guards by default
    (``skip_nnmodule_hook_guards``). A parameter's ``requires_grad`` is not in it: each
    pattern of those has compiled code of its own (:mod:`guardtrain.compile.grads`, H42).
    """
    # One walk over the submodules, in the order and with the de-duplication of
    # ``named_parameters``, ``named_buffers`` and ``named_modules``. Audits take one
    # of every steady target, so the loop reads the dicts directly.
    params: list[tuple[Any, ...]] = []
    buffers: list[tuple[Any, ...]] = []
    hooks: list[tuple[Any, ...]] = []
    seen_params: set[int] = set()
    seen_buffers: set[int] = set()
    for prefix, sub in module.named_modules():
        dot = prefix + "." if prefix else ""
        d = sub.__dict__
        if d[PARAMETERS]:
            _tensor_rows(params, seen_params, "parameter", dot, d[PARAMETERS])
        if d[BUFFERS]:
            _tensor_rows(buffers, seen_buffers, "buffer", dot, d[BUFFERS])
        if any(map(d.get, _HOOK_DICTS)):
            hooks.append(_hook_row(prefix, sub))
    rows = params + buffers + hooks
    global_hooks = _global_hooks()
    if any(global_hooks):
        rows.append(("hooks", "<global module hooks>", global_hooks))
    return tuple(rows)


def _tensor_rows(
    into: list[tuple[Any, ...]], seen: set[int], kind: str, dot: str, members: dict[str, Any]
) -> None:
    """Append a row per tensor of ``members`` not seen before (a tied weight: once)."""
    for key, t in members.items():
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        # A parameter's requires_grad picks its code's variant instead (H42).
        grad = t.requires_grad if kind == "buffer" else None
        into.append((kind, dot + key, id(t), grad, t.dtype, t.device, tuple(t.shape)))


def _hook_row(prefix: str, sub: nn.Module) -> tuple[Any, ...]:
    """``("hooks", name, ids per hook dict)`` of a submodule with hooks."""
    dicts = [getattr(sub, attr, None) for attr in _HOOK_DICTS]
    return (
        "hooks",
        prefix or ROOT,
        tuple(tuple(id(h) for h in d.values()) if d else () for d in dicts),
    )


def _global_hooks() -> tuple[tuple[int, ...], ...]:
    """The ids of the global module hooks (``register_module_forward_hook`` and others)."""
    return tuple(
        tuple(id(h) for h in module_globals.get(attr, {}).values()) for attr in GLOBAL_HOOK_DICTS
    )


_HOOK_KINDS = ("forward pre-hook", "forward hook", "backward pre-hook", "backward hook")


def _hooks_change(name: str, before: tuple[Any, ...] | None, row: tuple[Any, ...]) -> str:
    """What changed in the hooks of submodule ``name``: which kind was added or removed."""
    old = before[2] if before is not None else ((),) * len(row[2])
    for kind, was, now in zip(_HOOK_KINDS, old, row[2]):
        if len(now) > len(was) and set(was) <= set(now):
            return f"a {kind} was added to {name!r}"
        if len(now) < len(was) and set(now) <= set(was):
            return f"a {kind} was removed from {name!r}"
    return f"hooks of {name!r} changed"


def fingerprint_change(old: tuple[Any, ...], new: tuple[Any, ...]) -> ModuleChange | None:
    """The first difference between two :func:`module_fingerprint` values, or None."""
    if old == new:
        return None
    old_by_name = {(r[0], r[1]): r for r in old}
    new_by_name = {(r[0], r[1]): r for r in new}
    for key, row in new_by_name.items():
        before = old_by_name.get(key)
        detail = _row_change(key, before, row)
        if detail is not None:
            return ModuleChange(key[0], key[1], detail)
    for kind, name in old_by_name:
        if (kind, name) not in new_by_name:
            if kind == "hooks":
                return ModuleChange(kind, name, f"hooks of {name!r} were removed")
            return ModuleChange(kind, name, f"{kind} {name!r} was removed")
    return ModuleChange("order", "", "parameters or buffers were reordered")


#: The fields of a parameter or buffer row after its kind and name, and what each is called.
_ROW_FIELDS = ((3, "requires_grad"), (4, "dtype"), (5, "device"), (6, "shape"))


def _row_change(
    key: tuple[str, str], before: tuple[Any, ...] | None, row: tuple[Any, ...]
) -> str | None:
    """How one row of a fingerprint differs from the row of the same name before, or None."""
    kind, name = key
    if kind == "hooks":
        return None if before == row else _hooks_change(name, before, row)
    if before is None:
        return f"{kind} {name!r} was added"
    if before[2] != row[2]:
        return f"{kind} {name!r} was replaced by another tensor object"
    for i, what in _ROW_FIELDS:
        if before[i] != row[i]:
            return f"{what} of {kind} {name!r} changed {before[i]} -> {row[i]}"
    return None
