"""Compiling targets in place: private caches, both call paths, undo, target resolution."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from guardtrain.compile import CompiledTarget, build_compile_kwargs, resolve_targets
from guardtrain.filters import keep_all


def make(module: nn.Module, ift: bool = False, name: str = "m") -> tuple[CompiledTarget, list]:
    reasons: list[Any] = []
    target = CompiledTarget(
        name,
        module,
        {"backend": "eager"},
        None,
        ift,
        on_compile=lambda t, r: reasons.append(r),
        on_miss=lambda t, e: False,
    )
    return target, reasons


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_both_call_paths_are_compiled_and_state_dict_keys_stay() -> None:
    block = Block()
    keys = list(block.state_dict())
    target, reasons = make(block)
    x = torch.randn(2, 4)
    ref = torch.tanh(block.lin(x))
    assert torch.equal(block(x), ref)
    assert torch.equal(block.forward(x), ref)
    assert target.code.compiles == 1 and reasons == [None]
    assert list(block.state_dict()) == keys
    target.uninstall()
    assert "forward" not in block.__dict__
    block(x)
    assert target.code.compiles == 1  # nothing compiled after uninstall


@pytest.mark.parametrize(
    "module", [nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4)], ids=["seq", "linear"]
)
def test_builtin_modules_are_compiled(module: nn.Module) -> None:
    target, _ = make(module)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(module(x), module.__dict__["forward"].__wrapped__(x))
    assert target.code.compiles == 1
    assert not target.graph_breaks
    target.uninstall()


def test_install_free_tensors_instances_do_not_share_graphs() -> None:
    """H12: two instances of one class, each with install_free_tensors, keep their own weights."""
    a, b = Block(), Block()
    ta, _ = make(a, ift=True, name="a")
    tb, _ = make(b, ift=True, name="b")
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(a(x), torch.tanh(a.lin(x)))
        assert torch.equal(b(x), torch.tanh(b.lin(x)))
    assert ta.code.compiles == tb.code.compiles == 1
    assert torch._dynamo.config.install_free_tensors is False  # only set around the call


def test_rebuild_forgets_entries() -> None:
    block = Block()
    target, _ = make(block)
    x = torch.randn(2, 4)
    block(x)
    block(x)
    assert target.code.compiles == 1
    target.rebuild()
    block(x)
    assert target.code.compiles == 2


def test_assertions_see_dropped_guards() -> None:
    class Scaled(Block):
        def __init__(self) -> None:
            super().__init__()
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * self.scale

    m = Scaled()
    target, _ = make(m)
    m(torch.randn(2, 4))
    assert target.check_assertions() == (None, None)
    m.scale = 3.0
    stale, unmatched = target.check_assertions()
    assert stale is None  # every guard was kept: Dynamo itself will recompile
    assert unmatched is not None and "scale: 2.0 -> 3.0" in unmatched


def test_graph_break_is_detected() -> None:
    class Breaks(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            torch._dynamo.graph_break()
            return h + 1

    m = Breaks()
    target, _ = make(m)
    m(torch.randn(2, 4))
    assert target.graph_breaks


def test_mode_is_expanded_into_options_and_options_are_fresh() -> None:
    user = {"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "options": {"x": 1}}
    first = build_compile_kwargs(user, keep_all)
    second = build_compile_kwargs(user, keep_all)
    assert first["options"] is not second["options"]
    assert first["options"]["guard_filter_fn"] is keep_all
    assert first["options"]["x"] == 1
    assert first["options"]["max_autotune"] is True
    assert "mode" not in first
    assert user["options"] == {"x": 1}  # the caller's dict is untouched (H10)


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(4, 1)
        self.loss = nn.MSELoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def test_resolve_targets() -> None:
    root = Root()
    names = [n for n, _ in resolve_targets(root, ["blocks.*"])]
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    # outermost matches only
    assert [n for n, _ in resolve_targets(root, ["blocks*"])] == ["blocks"]
    assert [n for n, _ in resolve_targets(root, ["head", "blocks.1"])] == ["head", "blocks.1"]
    assert [n for n, _ in resolve_targets(root, None)] == [""]  # two children with parameters
    one = nn.Module()
    one.net = Block()  # type: ignore[assignment]
    one.loss = nn.MSELoss()  # type: ignore[assignment]
    assert [n for n, _ in resolve_targets(one, None)] == ["net"]
    with pytest.raises(ValueError, match=r"`targets` entry 'nope' matches no submodule"):
        resolve_targets(root, ["nope"])


def test_module_without_forward_is_refused() -> None:
    with pytest.raises(ValueError, match="defines no `forward`"):
        make(nn.ModuleList([nn.Linear(2, 2)]))


def test_compiled_forward_is_refused() -> None:
    block = Block()
    block.forward = torch.compile(block.forward, backend="eager")  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="compiled `forward` already"):
        make(block)
