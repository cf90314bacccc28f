"""A default target that breaks the graph is replaced by its parts (H20); warnings and the
summary name each break by Dynamo's reason, file and line."""

from __future__ import annotations

import functools
import re
from typing import Any

import lightning as L
import pytest
import torch
from helpers import guard, make_trainer
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, TensorDataset

from guardtrain.engine.breaks import BreakLog, describe

ITEM = r"Tensor\.item\(\) call.* at torch/nn/modules/transformer\.py:\d+ in _detect_is_causal_mask"
"""The demo's break, named with its file and line."""


class DemoLM(L.LightningModule):
    """Lightning's demo Transformer, which breaks on ``Tensor.item()`` inside ``nn.Transformer``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=50, ninp=16, nhead=2, nhid=16, nlayers=1, dropout=0.1)
        self.train_losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.nll_loss(self.model(x, y), y.view(-1))
        self.train_losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(callback: L.Callback | None) -> DemoLM:
    L.seed_everything(0, verbose=False)
    model = DemoLM()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (16 * 16, 8), generator=g)
    y = torch.randint(0, 50, (16 * 16, 8), generator=g)
    trainer = make_trainer([callback] if callback else [], max_epochs=3)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    return model


@functools.cache
def eager_run() -> DemoLM:
    """The run without the callback, once for every test here."""
    return run(None)


@pytest.mark.parametrize("preset", ["balanced", "aggressive", "turbo"])
def test_the_demo_transformer_reaches_the_stance(preset: str) -> None:
    """3 epochs of 16 batches: at least half of them under the stance, equal to eager.

    The break is in ``nn.Transformer``'s ``forward``: the first split goes down to it at
    once (its encoder and decoder become parts beside the embedding and the output
    layer, one re-arm). The decoder breaks too, at the call into torch's own code (which
    Dynamo never compiles as a frame of its own): it is split as well, down to its
    layers, so that no region runs uncompiled.
    """
    eager = eager_run()
    cb = guard(preset, warmup_steps=5, stable_steps=2)
    with pytest.warns(UserWarning, match=rf"'model' breaks the graph \(.*{ITEM}, called from "):
        guarded = run(cb)
    assert len(eager.train_losses) == len(guarded.train_losses) == 48
    for i, (a, b) in enumerate(zip(eager.train_losses, guarded.train_losses)):
        assert torch.equal(a, b), f"loss {i}"
    for (key, a), b in zip(eager.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), key
    s = cb.summary()
    assert s["steady_steps"] >= 24, s
    splits = {b["target"]: b for b in s["graph_breaks"]}
    assert list(splits)[:2] == ["model", "model.transformer.decoder"], splits
    first = splits["model"]
    assert "Tensor.item()" in first["reason"]
    assert re.fullmatch(
        r"torch/nn/modules/transformer\.py:\d+ in _detect_is_causal_mask, "
        r"called from lightning/pytorch/demos/transformer\.py:\d+",
        first["where"],
    ), first
    assert first["regions"] == [
        "model.embedding",
        "model.transformer.encoder",
        "model.transformer.decoder",
        "model.decoder",
    ]
    for split in splits.values():
        assert re.match(r"torch/nn/modules/transformer\.py:\d+", split["where"]), split
    assert "model.transformer.decoder.layers.0" in s["targets"]
    assert not any(t in splits for t in s["targets"])  # no target left that breaks
    assert s["stance_blocked"] is None
    assert f"graph break      model: {first['reason']} at {first['where']}" in cb.format_summary()


def test_an_explicit_target_that_breaks_keeps_every_guard() -> None:
    """With ``targets=``, the breaking target stays: full guards, no stance, a hint."""
    eager = eager_run()
    cb = guard("aggressive", targets=["model"], warmup_steps=5, stable_steps=2)
    with pytest.warns(UserWarning, match=rf"{ITEM}.*targets=\['model\.embedding'"):
        guarded = run(cb)
    for a, b in zip(eager.train_losses, guarded.train_losses):
        assert torch.equal(a, b)
    s = cb.summary()
    assert s["targets"] == ["model"] and s["graph_breaks"] == []
    assert s["steady_steps"] == 0 and "graph breaks" in (s["stance_blocked"] or "")


def _branches(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    if y.sum() > 0:  # data-dependent branching
        return y + 1
    return y - 1


def _prints(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def test_the_break_log_names_reason_file_and_line() -> None:
    """Each new break once, with the user's file and line; a reset is survived; nothing
    is registered, so nothing outlives the log."""
    log = BreakLog()
    assert log.new() == []
    torch.compile(_branches, backend="eager")(torch.ones(3))
    torch.compile(_prints, backend="eager")(torch.ones(3))
    torch.compile(_prints, backend="eager")(torch.ones(4))  # a recompile: the same break
    found = log.new()
    branch, brk = (f.__code__.co_firstlineno + 2 for f in (_branches, _prints))
    assert len(found) == 2, found
    assert found[0].where.endswith(f"test_graph_breaks.py:{branch} in _branches"), found
    assert found[1].where.endswith(f"test_graph_breaks.py:{brk} in _prints"), found
    assert found[0].reason.startswith("data-dependent branching")
    assert found[1].reason == "Call to `torch._dynamo.graph_break()`"
    assert describe(found[1:]) == f"{found[1].reason} at {found[1].where}"
    assert log.new() == []
    torch._dynamo.reset()  # empties Dynamo's record
    torch.compile(_prints, backend="eager")(torch.ones(3))
    assert [b.where for b in log.new()] == [found[1].where]


class Decoder(torch.nn.Module):
    """``nn.TransformerDecoder`` given a causal mask: it breaks on ``Tensor.item()`` in
    torch's own code, which Dynamo never compiles as a frame of its own."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.dec = torch.nn.TransformerDecoder(layer, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.dec(x, x, tgt_mask=mask)


@pytest.mark.parametrize("targets", [None, ["dec"]])
def test_a_break_at_the_call_into_torchs_own_code_is_seen(targets: list[str] | None) -> None:
    """Such a target would run uncompiled while looking compiled: by default it is split
    down to its layers; as an explicit target it keeps every guard and the stance stays off."""
    from helpers import guard_tuner

    net = Decoder()
    x = torch.randn(4, 5, 8)
    with guard_tuner(net, targets=targets, measure_lookup=False) as tuner:
        for _ in range(8):
            with tuner.step((x,)):
                net(x).sum().backward()
    s = tuner.summary()
    if targets is None:
        assert [b["target"] for b in s["graph_breaks"]] == ["<model>", "dec"], s["graph_breaks"]
        assert s["targets"] == ["dec.layers.0"] and s["steady_steps"] > 0
    else:
        assert s["graph_breaks"] == [] and s["steady_steps"] == 0
        assert "graph breaks" in (s["stance_blocked"] or "")
        [kept] = s["mixed_targets"]
        assert re.search(ITEM, kept["reason"]) and not kept["mixed"], kept
        assert s["switched_off"] == [] and s["compiled_again"] == {}, s


class BreakingBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.lin2 = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        torch._dynamo.graph_break()
        return x + self.lin2(x)


class BreakingStack(L.LightningModule):
    """Repeated blocks that break the graph inside their own ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[BreakingBlock() for _ in range(4)])
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).sum(-1, keepdim=True), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("preset", ["safe", "aggressive", "turbo"])
def test_repeated_blocks_breaking_inside_their_forward_match_eager_from_the_first_batch(
    preset: str,
) -> None:
    """The frames after each break are the blocks' shared `forward`: they must not be
    traced with `install_free_tensors`, or blocks 1-3 would run block 0's weights
    in the first batch, before the split (H12, H20)."""

    def run_stack(callback: L.Callback | None) -> BreakingStack:
        L.seed_everything(0, verbose=False)
        model = BreakingStack()
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        trainer = make_trainer([callback] if callback else [], max_epochs=2)
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
        return model

    eager = run_stack(None)
    guarded = run_stack(guard(preset))
    assert len(eager.losses) == len(guarded.losses) == 16
    for i, (a, b) in enumerate(zip(eager.losses, guarded.losses)):
        assert torch.equal(a, b), f"loss {i}"
    for (key, a), b in zip(eager.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), key


class BreaksInTraining(torch.nn.Module):
    """Breaks the graph only where grad mode is on: its ``no_grad`` calls (rollouts,
    ``generate()``) compile whole, its training calls break."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if torch.is_grad_enabled():
            torch._dynamo.graph_break()
        return self.b(h)


def _rollouts_and_updates(preset: str | None, steps: int = 12) -> tuple[list[torch.Tensor], Any]:
    """Each step: three ``no_grad`` calls, then an update from two calls in grad mode."""
    import contextlib

    from helpers import guard_tuner

    torch.manual_seed(0)
    net = BreaksInTraining()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = torch.randn(steps, 4, 8, generator=torch.Generator().manual_seed(1))
    tuner = None
    if preset is not None:
        tuner = guard_tuner(
            net,
            preset,
            warmup_steps=2,
            stable_steps=1,
            measure_lookup=False,
            compile_kwargs={"backend": "aot_eager"},
        )
    losses = []
    with tuner or contextlib.nullcontext():
        for i in range(steps):
            with tuner.step((xs[i],)) if tuner else contextlib.nullcontext():
                with torch.no_grad():
                    target = [net(xs[i]) for _ in range(3)][0]
                loss = (net(xs[i]) - target).pow(2).mean() + net(xs[i]).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
    return losses, tuner


def _plain_compiles() -> int:
    """Plain compile's compiles for :func:`_rollouts_and_updates`'s calls."""
    from helpers import PlainCompile

    torch.manual_seed(0)
    net = BreaksInTraining()
    plain = PlainCompile()
    plain.compile(net)
    xs = torch.randn(12, 4, 8, generator=torch.Generator().manual_seed(1))
    with plain:
        for x in xs:
            with torch.no_grad():
                net(x)
            (net(x).mean() + net(x).mean()).backward()
    return plain.compiles


@pytest.mark.parametrize("preset", ["aggressive", "turbo", "auto"])
def test_a_target_breaking_in_training_alone_serves_its_other_calls(preset: str) -> None:
    """The default target is kept whole, nothing compiled again for the break: the calls
    whose entry runs whole run directly (turbo, auto) or under the stance (aggressive),
    those whose entry breaks with full guards, never under the stance (H4); every loss
    equals eager's."""
    from helpers import assert_compiles_bounded

    eager, _ = _rollouts_and_updates(None)
    with pytest.warns(UserWarning, match="its calls whose entry breaks run with full guards"):
        losses, tuner = _rollouts_and_updates(preset)
    for i, (a, b) in enumerate(zip(eager, losses, strict=True)):
        assert torch.equal(a, b), f"loss {i}"
    s = tuner.summary()
    assert s["targets"] == ["<model>"] and s["graph_breaks"] == [], s["graph_breaks"]
    assert [m["target"] for m in s["mixed_targets"]] == ["<model>"], s["mixed_targets"]
    steady = s["steady_steps"]
    assert steady > 0 and s["stance_blocked"] is None
    assert s["full_guard_calls"] == 2 * steady
    if preset == "aggressive":
        assert s["direct_dispatch"]["calls"] == 0
    else:
        assert s["direct_dispatch"]["broken_targets"] == ["<model>"]
        assert s["direct_dispatch"]["calls"] == 3 * steady
    assert_compiles_bounded(s, _plain_compiles())
