"""The ``requires_grad`` of a target's parameters: its pattern, and code per pattern (H42).

With ``aot_eager`` or inductor the graph fixes at compile time which inputs get a
gradient. Dynamo guards each parameter's ``requires_grad``, but the nn-module filters
drop those guards and the stance never evaluates them (torch leaves parameters out of
its diff guards). So a parameter unfrozen in the middle of an epoch would silently get
no gradient.

guardtrain keeps one code object per *pattern* (the parameters' ``requires_grad`` in
``parameters()`` order, :func:`pattern`): every entry of a code was compiled for one
pattern, and a target whose pattern changed runs the code of the new one
(:func:`use_variant`), compiled on its first call and kept
(:meth:`~guardtrain.compile.code.TargetCode.variant`). A pattern that comes back
(peft's ``disable_adapter()`` twice per DPO step, Lightning's ``toggle_optimizer``)
finds its entries compiled: no rebuild, no recompile.

A change is seen by the events on ``nn.Parameter`` (:mod:`guardtrain.compile.watch`)
before the next call, and by :func:`moved` at the first call of each batch for what
events miss (``torch.Tensor.requires_grad_(p)``, FSDP2's ``DTensor`` parameters): one
pass in C over the parameters.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from guardtrain._torch import DisableTorchFunction, requires_grad_getter

__all__ = ["describe", "moved", "pattern", "use_variant"]

# The tensor's own flag, read in C (the getset descriptor; typed as a bool by torch's stubs).
_get_requires_grad: Callable[[torch.Tensor], bool] = requires_grad_getter
_no_torch_function = DisableTorchFunction


def pattern(params: Iterable[torch.Tensor]) -> tuple[bool, ...]:
    """The ``requires_grad`` of each parameter, in order (the tensor's own flag, read in C).

    Read with torch functions disabled: a tensor's property is overridable, so a
    torch-function mode the user has active would otherwise see these reads."""
    with _no_torch_function():
        return tuple(map(_get_requires_grad, params))


def moved(target: Any) -> bool:
    """Whether ``target``'s parameters no longer have the pattern its code compiled for."""
    return pattern(target.params) != target.code.pattern


def describe(target: Any) -> str:
    """Which parameter's ``requires_grad`` differs from the code's pattern, and how."""
    old, now = target.code.pattern or (), pattern(target.params)
    changed = [i for i, (a, b) in enumerate(zip(old, now)) if a != b]
    if not changed:
        return "requires_grad of its parameters changed"
    names = [n for n, _ in target.module.named_parameters()]
    first = names[changed[0]] if changed[0] < len(names) else f"#{changed[0]}"
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return (
        f"requires_grad of parameter {first!r} changed {old[changed[0]]} -> {now[changed[0]]}{more}"
    )


def use_variant(target: Any, autocast: bool | None = None) -> bool:
    """Make ``target`` run the code compiled for its parameters' ``requires_grad`` as they
    are now, and for ``autocast`` (None: the code's own; made, without entries, for a new
    variant); True when it switched.

    The target keeps its fingerprint (which leaves a parameter's ``requires_grad`` out)
    and forgets what it harvested or accepted: those belong to the other code's entries.
    """
    now = pattern(target.params)
    old = target.code
    if autocast is None:
        autocast = old.autocast
    if now == old.pattern and autocast is old.autocast:
        return False
    new = old.variant(now, autocast)
    old.members.remove(target)
    if old.current is target:
        old.current = None
    new.members.append(target)
    target.code = new
    if new.generation == 0:  # made just now: no trampoline yet
        reference = target.reference
        new.fresh()  # compiles on the next call; sets the target's `compiled`
        target.reference = reference
    else:
        target.compiled = new.caller(target.module)
    target.checked_generation = -1  # shared code: does the new code fit this member?
    target.dirty = True
    target.entries_changed()
    return True
