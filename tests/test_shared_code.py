"""Targets of one class and structure share compiled code (H24), and H12 still holds."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import guard, make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guardtrain.compile import share_groups, structure_key


class Block(nn.Module):
    def __init__(self, d: int = 8, act: Any = torch.relu, scale: float = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(0.1)
        self.act = act
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.lin(self.norm(x)))) * self.scale


class Stack(nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class StackModule(L.LightningModule):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.net = Stack(blocks)
        self.losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run(
    make_blocks: Any, cb: L.Callback | None, extra: list[L.Callback] | None = None
) -> StackModule:
    L.seed_everything(0, verbose=False)
    model = StackModule(make_blocks())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    val = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8)
    callbacks = ([cb] if cb else []) + (extra or [])
    trainer = make_trainer(callbacks, max_epochs=3, limit_val_batches=2)
    trainer.fit(model, data, val)
    return model


def assert_eager_equal(eager: StackModule, guarded: StackModule) -> None:
    assert len(eager.losses) == len(guarded.losses) > 0
    for i, (a, b) in enumerate(zip(eager.losses, guarded.losses)):
        assert torch.equal(a, b), f"loss {i}"
    for a, b in zip(eager.val_losses, guarded.val_losses):
        assert torch.equal(a, b)
    for (key, a), b in zip(eager.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), key


def same_blocks() -> list[Block]:
    return [Block() for _ in range(6)]


@pytest.mark.parametrize("preset", ["balanced", "aggressive", "turbo"])
def test_repeated_blocks_compile_once_per_mode(preset: str) -> None:
    """Six blocks, one class: Dynamo traces one graph per (training, grad) mode seen,
    every block runs its own weights, and the run equals eager."""
    eager = run(same_blocks, None)
    torch._dynamo.utils.counters.clear()
    cb = guard(preset, targets=["net.blocks.*"])
    guarded = run(same_blocks, cb)
    assert_eager_equal(eager, guarded)
    # One class, two modes: (training, grad) and (eval, no_grad); block 0 gets an
    # input that does not require grad, the others one that does: 3 graphs.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1 * 2 + 2
    s = cb.summary()
    assert s["compiles"] == 3 and s["steady_steps"] > 0
    [group] = s["shared_code"]
    assert group["targets"] == [f"net.blocks.{i}" for i in range(6)]
    assert group["class"] == "Block"


def test_a_block_whose_dropped_guard_differs_gets_code_of_its_own() -> None:
    """Block 3 holds another object in `self.cfg`, whose field `forward` reads: the
    guard on it is dropped under `aggressive`, so block 3 must not run block 0's
    graph (H12, H24). It leaves the shared code before its first call."""

    class Cfg:
        def __init__(self, act: Any) -> None:
            self.act = act

    class CfgBlock(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(self.cfg.act(self.lin(self.norm(x))))

    def blocks() -> list[Block]:
        made = [CfgBlock() for i in range(6)]
        for i, b in enumerate(made):
            b.cfg = Cfg(torch.tanh if i == 3 else torch.relu)
        return made

    eager = run(blocks, None)
    cb = guard("aggressive", targets=["net.blocks.*"])
    guarded = run(blocks, cb)
    assert_eager_equal(eager, guarded)
    s = cb.summary()
    assert [o["target"] for o in s["own_code"]] == ["net.blocks.3"]
    assert "net.blocks.3.cfg.act" in s["own_code"][0]["why"]
    assert s["shared_code"][0]["targets"] == [f"net.blocks.{i}" for i in (0, 1, 2, 4, 5)]


def test_a_function_attribute_is_part_of_the_structure() -> None:
    a, b = Block(act=torch.relu), Block(act=torch.tanh)
    assert share_groups([a, b, Block(act=torch.relu)]) == [0, None, 0]


@pytest.mark.parametrize("preset", ["balanced", "aggressive", "turbo"])
def test_blocks_whose_scalars_differ_get_code_of_their_own(preset: str) -> None:
    """A float or a dropout `p` that differs per block is a kept guard (H19): on one
    shared code object each value would add an entry, up to the recompile limit.
    The blocks whose value no shared entry fits leave for code of their own."""

    def blocks() -> list[Block]:
        made = [Block(scale=1.0 / (i + 1)) for i in range(10)]
        for i, b in enumerate(made):
            b.drop.p = 0.05 + 0.01 * i
        return made

    eager = run(blocks, None)
    cb = guard(preset, targets=["net.blocks.*"])
    guarded = run(blocks, cb)
    assert_eager_equal(eager, guarded)
    s = cb.summary()
    assert [o["target"] for o in s["own_code"]] == [f"net.blocks.{i}" for i in range(1, 10)]
    assert all("no shared entry fits it" in o["why"] for o in s["own_code"])
    assert s["steady_steps"] > 0 and s["stance_blocked"] is None


class Replace(L.Callback):
    """Replaces block 2's weight with a new Parameter at the start of epoch 1."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            lin = pl_module.net.blocks[2].lin
            lin.weight = nn.Parameter(lin.weight.detach() * 0.5)
            trainer.optimizers[0].param_groups[0]["params"] = list(pl_module.parameters())


def test_a_replaced_parameter_of_one_block_is_seen() -> None:
    eager = run(same_blocks, None, [Replace()])
    cb = guard("aggressive", targets=["net.blocks.*"])
    guarded = run(same_blocks, cb, [Replace()])
    assert_eager_equal(eager, guarded)
    reasons = [r["reason"] for r in cb.summary()["rearms"]]
    assert any("net.blocks.2" in r and "weight" in r for r in reasons), reasons


def test_share_groups() -> None:
    a, b, c = Block(), Block(), Block(d=4)
    frozen = Block()
    frozen.lin.weight.requires_grad_(False)
    hooked = Block()
    hooked.register_forward_hook(lambda *args: None)
    lone = nn.Linear(8, 8)
    assert structure_key(a) == structure_key(b)
    # A frozen block is of the group: it runs the group's code compiled for its own
    # requires_grad pattern (H42), so its parameter's requires_grad is not in the key.
    assert structure_key(frozen) == structure_key(a)
    assert share_groups([a, b, c, frozen, hooked, lone]) == [0, 0, None, 0, None, None]
    assert share_groups([c, a, lone, b, Block(d=4)]) == [0, 1, None, 1, 0]


class Freeze(L.Callback):
    """Freezes block 2 at the start of epoch 1 (its parameters stay in the optimizer)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            pl_module.net.blocks[2].requires_grad_(False)


def test_a_block_frozen_at_a_boundary_runs_the_groups_code_for_its_pattern() -> None:
    """Block 2's parameters stop requiring grad: it runs the group's code compiled for
    its requires_grad pattern (H42), while the others keep the shared entries and still
    get their gradients (eager-equal, with aot_eager: the eager backend would hide a
    stale entry, H43)."""
    eager = run(same_blocks, None, [Freeze()])
    cb = guard("aggressive", targets=["net.blocks.*"], compile_kwargs={"backend": "aot_eager"})
    guarded = run(same_blocks, cb, [Freeze()])
    assert_eager_equal(eager, guarded)
    s = cb.summary()
    assert s["own_code"] == [], s["own_code"]  # no code of its own: a variant of the group's
    caught = s["caught_changes"]
    assert "net.blocks.2" in caught["requires_grad"]["first"], caught
    assert s["phase"] == "steady", s["rearms"]


def test_a_member_that_leaves_during_a_verify_batch_runs_its_own_code() -> None:
    """Leaving shared code while a verify wrapper is installed: after the verify
    batch the member runs its new code, not the group's."""
    from guardtrain import filters
    from guardtrain.compile import CompiledTarget

    class Cfg:
        def __init__(self, act: Any) -> None:
            self.act = act

    class CfgBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cfg = Cfg(torch.relu)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.cfg.act(self.lin(x))

    flt = filters.with_floor(filters.resolve("skip_all_nn_modules"))
    hooks: dict[str, Any] = {"on_compile": lambda t, r: None, "on_miss": lambda t, r: True}
    a, b = CfgBlock(), CfgBlock()
    ta = CompiledTarget("a", a, {"backend": "eager"}, flt, False, shared=True, **hooks)
    tb = CompiledTarget("b", b, {"backend": "eager"}, flt, False, share_with=ta, **hooks)
    x = torch.randn(2, 4)
    try:
        with torch.no_grad():
            a(x), b(x)
            b.cfg.act = torch.tanh  # a dropped guard: block a's entry no longer fits b
            for t in (ta, tb):
                t.start_verify(1e-4, 1e-6)
            a(torch.randn(3, 4))  # a compile: b re-checks the shared entries at its call
            b(x)
            assert tb.own_code is not None and not tb.code.shared
            assert ta.stop_verify() is None and tb.stop_verify() is None
            assert torch.equal(b(x), torch.tanh(b.lin(x)))
            assert torch.equal(a(x), torch.relu(a.lin(x)))
    finally:
        ta.uninstall()
        tb.uninstall()
