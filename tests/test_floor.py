"""The soundness floor: global-state guard types of the installed torch, functorch's
transforms and forward AD on warm targets, and the guards that create state (H39)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import guard_tuner
from torch import nn

from guardtrain import filters

STANCE_PRESETS = ["balanced", "aggressive", "turbo"]


def test_every_floor_guard_type_exists_in_the_installed_torch() -> None:
    from torch._dynamo.guards import GuardBuilder

    for name in filters.FLOOR_GUARD_TYPES:
        assert callable(getattr(GuardBuilder, name, None)), name
    # The names every torch in the supported range defines are all there.
    for name in ("GRAD_MODE", "GLOBAL_STATE", "SHAPE_ENV", "FUNCTORCH_STACK_MATCH", "DUAL_LEVEL"):
        assert name in filters.FLOOR_GUARD_TYPES, name
    assert "TORCH_FUNCTION_MODE_STACK" not in filters.FLOOR_GUARD_TYPES


def _grad(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.func.grad(lambda inp: model(inp).sum())(x)


def _vmap(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.func.vmap(model)(x.unsqueeze(1))


def _dual(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fwAD.dual_level():
        out = model(fwAD.make_dual(x, torch.ones_like(x)))
        tangent = fwAD.unpack_dual(out).tangent
    assert tangent is not None
    return tangent


TRANSFORMS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "func.grad": _grad,
    "func.vmap": _vmap,
    "forward_ad.dual_level": _dual,
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("preset", STANCE_PRESETS)
def test_a_warm_call_under_a_transform_matches_eager(preset: str, transform: str) -> None:
    """Warmed up and steady without any transform, then called under one: the call
    gives eager's result (the stance never runs the entry compiled outside it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    eager = copy.deepcopy(model)
    x = torch.randn(3, 4)
    run = TRANSFORMS[transform]
    with guard_tuner(model, preset) as tuner:
        for _ in range(6):
            with tuner.step((x,)):
                model(x).sum().backward()
        assert tuner.phase == "steady"
        outs: list[Any] = []
        for _ in range(3):
            with tuner.step((x,)):
                outs.append(run(model, x))
    expected = run(eager, x)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


class Lazy(nn.Module):
    """Creates a buffer on its first call, as litgpt's LoRA layer does, and counts into it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.created = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "_seen"):
            self.register_buffer("_seen", torch.zeros(()), persistent=False)
        self._seen.add_(1)
        return self.lin(x) * self._seen


@pytest.mark.parametrize("preset", ["off", "safe", *STANCE_PRESETS])
def test_a_buffer_created_in_forward_is_created_once(preset: str) -> None:
    """The floor keeps the ``hasattr`` guard: the code traced on the first call (which
    creates the buffer) never runs again once the buffer exists (H39)."""
    torch.manual_seed(0)
    model = Lazy()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 4)
    buffers: set[int] = set()
    with guard_tuner(model, preset) as tuner:
        for _ in range(10):
            with tuner.step((x,)), torch.no_grad():
                out = model(x)
            buffers.add(id(model._seen))
            with torch.no_grad():
                torch.testing.assert_close(out, eager(x), rtol=0, atol=0)
    assert len(buffers) == 1
    assert model._seen.item() == eager._seen.item() == 10
