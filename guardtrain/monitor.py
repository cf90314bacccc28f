"""Recompile detection and reasons; the state fingerprints the callback compares.

Compiles are counted by the guard filter every target installs: Dynamo calls
it once per frame compilation (graph-break resume frames included), never for
a lazily compiled backward, and it keeps working across ``torch._dynamo.reset()``
(H6). The reason is Dynamo's own recompile reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "CompileMonitor",
    "batch_signature",
    "module_fingerprint",
    "fingerprint_change",
]


@dataclass(slots=True)
class CompileMonitor:
    """Counts frame compilations of the callback's targets and keeps their reasons."""

    compiles: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    max_events: int = 100

    def record(self, step: int, target: str, reason: str | None) -> None:
        self.compiles += 1
        if len(self.events) < self.max_events:
            self.events.append(
                {"step": step, "target": target or "<root>", "reason": reason or "first compile"}
            )


def batch_signature(batch: Any) -> Any:
    """Shapes, dtypes and devices of the tensors in ``batch``, as a hashable value.

    Containers (tuple, list, dict) keep their structure; other leaves count by
    type only. This is the per-batch check: about 1 µs for a two-tensor batch.
    """
    cls = type(batch)
    if cls is tuple or cls is list:  # the common case: a flat tuple or list of tensors
        try:
            return (cls, tuple([(t.shape, t.dtype, t.device) for t in batch]))
        except AttributeError:
            pass
    if isinstance(batch, torch.Tensor):
        return (batch.shape, batch.dtype, batch.device)
    if isinstance(batch, (tuple, list)):
        return (type(batch), tuple(batch_signature(b) for b in batch))
    if isinstance(batch, dict):
        return (type(batch), tuple((k, batch_signature(v)) for k, v in batch.items()))
    return type(batch)


def describe_signature(signature: Any) -> str:
    """A short readable form of a :func:`batch_signature`."""
    if (
        isinstance(signature, tuple)
        and len(signature) == 3
        and isinstance(signature[0], torch.Size)
    ):
        shape, dtype, device = signature
        return f"{tuple(shape)} {str(dtype).replace('torch.', '')} {device}"
    if isinstance(signature, tuple) and len(signature) == 2 and isinstance(signature[0], type):
        inner = signature[1]
        if signature[0] is dict or issubclass(signature[0], dict):
            return "{" + ", ".join(f"{k!r}: {describe_signature(v)}" for k, v in inner) + "}"
        return "(" + ", ".join(describe_signature(s) for s in inner) + ")"
    if isinstance(signature, type):
        return signature.__name__
    return repr(signature)


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def module_fingerprint(module: nn.Module) -> tuple[tuple[Any, ...], ...]:
    """What guards assume about a module and that a dropped guard would not see.

    Identity, ``requires_grad``, dtype, device and shape of every parameter and
    buffer, and the hook functions of every submodule and the global module
    hooks. Run at loop and epoch boundaries (it walks the module):
    ``install_free_tensors`` freezes tensor identity (H3), nn-module guard
    filters drop ``requires_grad`` and hook guards (H2), and Dynamo does not
    enforce hook guards by default (``skip_nnmodule_hook_guards``).
    """
    rows: list[tuple[Any, ...]] = []
    for kind, items in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, t in items:
            rows.append((kind, name, id(t), t.requires_grad, t.dtype, t.device, tuple(t.shape)))
    for name, sub in module.named_modules():
        hooks = tuple(tuple(id(h) for h in getattr(sub, attr, {}).values()) for attr in _HOOK_DICTS)
        if any(hooks):
            rows.append(("hooks", name or "<root>", hooks))
    from torch.nn.modules import module as module_module

    global_hooks = tuple(
        tuple(id(h) for h in getattr(module_module, attr, {}).values()) for attr in _GLOBAL_HOOKS
    )
    if any(global_hooks):
        rows.append(("hooks", "<global module hooks>", global_hooks))
    return tuple(rows)


def fingerprint_change(old: tuple[Any, ...], new: tuple[Any, ...]) -> str | None:
    """Describe the first difference between two :func:`module_fingerprint` values."""
    if old == new:
        return None
    old_by_name = {(r[0], r[1]): r for r in old}
    new_by_name = {(r[0], r[1]): r for r in new}
    for key, row in new_by_name.items():
        before = old_by_name.get(key)
        kind, name = key
        if kind == "hooks":
            if before != row:
                return f"hooks of {name!r} changed"
            continue
        if before is None:
            return f"{kind} {name!r} was added"
        if before[2] != row[2]:
            return f"{kind} {name!r} was replaced by another tensor object"
        if before[3] != row[3]:
            return f"requires_grad of {kind} {name!r} changed {before[3]} -> {row[3]}"
        if before[4] != row[4]:
            return f"dtype of {kind} {name!r} changed {before[4]} -> {row[4]}"
        if before[5] != row[5]:
            return f"device of {kind} {name!r} changed {before[5]} -> {row[5]}"
        if before[6] != row[6]:
            return f"shape of {kind} {name!r} changed {before[6]} -> {row[6]}"
    for key in old_by_name:
        if key not in new_by_name:
            if key[0] == "hooks":
                return f"hooks of {key[1]!r} were removed"
            return f"{key[0]} {key[1]!r} was removed"
    return "parameters or buffers were reordered"
