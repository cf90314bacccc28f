"""Verify batches: the eager ``forward`` run beside each compiled call, and compared with it."""

from __future__ import annotations

from typing import Any

import torch

from guardtrain._torch import BUFFERS, module_store
from guardtrain.compile.target_state import TargetState

__all__ = ["start_verify", "stop_verify"]


def start_verify(target: TargetState, rtol: float, atol: float) -> None:
    """Until :func:`stop_verify`, run the eager ``forward`` beside each compiled call.

    The eager call sees the same RNG state and copies of the buffers as the
    compiled one saw them, under ``no_grad``; the module's own buffers and the
    RNG end as the compiled call left them. Cost per verified call: one eager
    forward plus one copy of the module's buffers.
    """
    target.mismatch = None
    plain = target.compiled
    module, bound = target.module, target.bound

    def verifying(*args: Any, **kwargs: Any) -> Any:
        slots = [
            (buffers, name, b)
            for buffers in (module_store(owner, BUFFERS) for owner in module.modules())
            for name, b in buffers.items()
            if b is not None
        ]
        before = [b.detach().clone() for _, _, b in slots]
        rng = _rng_state()
        out = plain(*args, **kwargs)
        rng_after = _rng_state()
        # The eager call runs on copies of the buffers as they were before the
        # compiled call: the originals (saved for backward) are not touched.
        try:
            for (buffers, name, _), copy in zip(slots, before):
                buffers[name] = copy
            _set_rng_state(rng)
            with torch.no_grad():
                ref = bound(*args, **kwargs)
        finally:
            for buffers, name, original in slots:
                buffers[name] = original
            _set_rng_state(rng_after)
        if target.mismatch is None:
            target.mismatch = _compare(out, ref, rtol, atol)
        return out

    target.unverified = plain
    target.compiled = verifying
    target.direct = False  # a verified call takes the path that compares it with eager


def stop_verify(target: TargetState) -> str | None:
    """End verification; describe the first mismatch seen, or return None."""
    if target.unverified is None:
        return None
    # The current code's caller: the code may have been rebuilt, or this target
    # may have left shared code, while it verified.
    target.compiled = target.code.caller(target.module)
    target.unverified = None
    target.set_under_stance(target.under_stance)
    return target.mismatch


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _compare(out: Any, ref: Any, rtol: float, atol: float) -> str | None:
    """Describe the first difference between two outputs (pytrees of tensors), or None."""
    from torch.utils._pytree import tree_flatten

    got, got_spec = tree_flatten(out)
    exp, exp_spec = tree_flatten(ref)
    if got_spec != exp_spec:
        return f"output structure differs: {got_spec} vs {exp_spec}"
    for i, (a, b) in enumerate(zip(got, exp)):
        found = _compare_leaf(a, b, rtol, atol)
        if found is not None:
            return f"output {i}: {found}"
    return None


def _compare_leaf(a: Any, b: Any, rtol: float, atol: float) -> str | None:
    """Describe how the compiled output leaf ``a`` differs from eager's ``b``, or None. A
    tensor on one side only is a difference (``!=`` would compare it element-wise)."""
    tensors = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
    if tensors == (True, True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{tuple(a.shape)} {a.dtype} vs eager {tuple(b.shape)} {b.dtype}"
        if not torch.allclose(a.detach(), b, rtol=rtol, atol=atol, equal_nan=True):
            diff = (a.detach().double() - b.double()).abs().max().item()
            return f"max abs difference {diff:.3g} (rtol={rtol}, atol={atol})"
        return None
    if any(tensors):
        return f"{_kind(a)} vs eager {_kind(b)}"
    return f"{a!r} vs eager {b!r}" if a != b else None


def _kind(leaf: Any) -> str:
    """A leaf as a mismatch names it: a tensor by shape and dtype, anything else by value."""
    if isinstance(leaf, torch.Tensor):
        return f"tensor {tuple(leaf.shape)} {leaf.dtype}"
    return repr(leaf)
