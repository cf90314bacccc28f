"""Named filters, composition and the soundness floor, on real guard entries."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from guardtrain import GuardTrainError, filters


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)) * self.scale


@pytest.fixture(scope="module")
def entries() -> list[Any]:
    """The guard entries Dynamo builds for Net.forward."""
    captured: list[Any] = []

    def capture(es: Any) -> list[bool]:
        captured.extend(es)
        return [True] * len(es)

    net = Net()
    torch._dynamo.reset()
    torch.compile(net.forward, backend="eager", options={"guard_filter_fn": capture})(
        torch.randn(2, 4)
    )
    torch._dynamo.reset()
    return captured


def kept(f: Any, es: list[Any]) -> set[str]:
    return {e.name or e.guard_type for e, k in zip(es, f(es)) if k}


def test_floor_keeps_training_global_state_and_inputs(entries: list[Any]) -> None:
    keep = kept(filters.soundness_floor, entries)
    assert any(n.endswith("['drop'].training") for n in keep)
    assert {"GRAD_MODE", "GLOBAL_STATE", "SHAPE_ENV", "DEFAULT_DEVICE"} <= keep
    assert "x" in keep  # the input tensor's metadata
    # Scalar attributes read in forward (H19) are part of the floor ...
    assert {"self.scale", "self._modules['drop'].p"} <= keep
    # ... while identity, type, hook and tensor guards on modules are not.
    assert not any(
        n.endswith("._parameters['weight']") or n.endswith("_forward_hooks") for n in keep
    )
    assert "self._modules['lin']" not in keep


def test_named_filter_drops_module_guards_and_floor_restores_training(entries: list[Any]) -> None:
    f = filters.resolve("skip_all_nn_modules")
    plain = kept(f, entries)
    assert not any(n.endswith(".training") for n in plain)
    assert not any(n.endswith(".scale") for n in plain)
    floored = kept(filters.with_floor(f), entries)
    assert any(n.endswith(".training") for n in floored)
    assert any(n.endswith(".scale") for n in floored)  # a scalar read in forward (H19)
    assert not any(n.endswith("._parameters['weight']") for n in floored)


def test_all_of_adds_drops_and_any_of_adds_keeps(entries: list[Any]) -> None:
    a = filters.resolve("skip_all_nn_modules")
    b = filters.resolve("skip_globals")
    both = kept(filters.all_of(a, b), entries)
    assert both == kept(a, entries) & kept(b, entries)
    either = kept(filters.any_of(a, b), entries)
    assert either == kept(a, entries) | kept(b, entries)
    assert kept(filters.resolve(["skip_all_nn_modules", "skip_globals"]), entries) == both


def test_keep_all_and_none(entries: list[Any]) -> None:
    assert filters.resolve(None) is None
    assert filters.with_floor(filters.keep_all) is filters.keep_all
    assert all(filters.keep_all(entries))


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown filter 'nope'.*skip_all_nn_modules"):
        filters.resolve("nope")


def test_not_a_filter() -> None:
    with pytest.raises(TypeError, match="`guard_filter` must be a filter name") as info:
        filters.resolve(3)  # type: ignore[arg-type]
    assert isinstance(info.value, GuardTrainError)


def test_missing_filter_is_switched_off_with_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.compiler, "skip_all_guards_unsafe")
    with pytest.warns(UserWarning, match=r"needs torch>=2\.10"):
        assert filters.resolve("skip_all") is None


def test_floor_keeps_a_training_guard_in_either_form() -> None:
    """Dynamo names a module's flag ``m.training`` or ``object.__getattribute__(m,
    'training')``; the floor keeps both, a global module's too (no other rule keeps those)."""
    from types import SimpleNamespace

    def entry(name: str) -> Any:
        return SimpleNamespace(
            name=name,
            guard_type="CONSTANT_MATCH",
            is_global=True,
            has_value=True,
            value=True,
            orig_guard=None,
        )

    names = ["G['net']._modules['drop'].training", "object.__getattribute__(G['net'], 'training')"]
    assert filters.soundness_floor([entry(n) for n in names]) == [True, True]
    assert filters.soundness_floor([entry("G['net'].scale")]) == [False]
