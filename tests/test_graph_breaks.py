"""A default target that breaks the graph is replaced by its parts (H20)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import guard, make_trainer
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, TensorDataset


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


@pytest.mark.parametrize("preset", ["balanced", "aggressive"])
def test_the_demo_transformer_reaches_the_stance(preset: str) -> None:
    """3 epochs of 16 batches: at least half of them under the stance, equal to eager."""
    eager = run(None)
    cb = guard(preset, warmup_steps=5, stable_steps=2)
    guarded = run(cb)
    assert len(eager.train_losses) == len(guarded.train_losses) == 48
    for i, (a, b) in enumerate(zip(eager.train_losses, guarded.train_losses)):
        assert torch.equal(a, b), f"loss {i}"
    for (key, a), b in zip(eager.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), key
    s = cb.summary()
    assert s["steady_steps"] >= 24, s
    [split] = s["graph_breaks"]
    assert split["target"] == "model" and "Tensor.item()" in split["reason"]
    assert s["targets"] == split["regions"] and "model.transformer" in s["targets"]
    assert s["stance_blocked"] is None


def test_an_explicit_target_that_breaks_keeps_every_guard() -> None:
    """With ``targets=``, the breaking target stays: full guards, no stance, a hint."""
    eager = run(None)
    cb = guard("aggressive", targets=["model"], warmup_steps=5, stable_steps=2)
    with pytest.warns(UserWarning, match=r"Tensor\.item\(\).*targets=\['model\.embedding'"):
        guarded = run(cb)
    for a, b in zip(eager.train_losses, guarded.train_losses):
        assert torch.equal(a, b)
    s = cb.summary()
    assert s["targets"] == ["model"] and s["graph_breaks"] == []
    assert s["steady_steps"] == 0 and "graph breaks" in (s["stance_blocked"] or "")
