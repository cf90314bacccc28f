"""Scalar attributes read in `forward` join the soundness floor (H19)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import TinyModule, compare, guard


class Tempered(TinyModule):
    """Divides the output by ``self.temperature``, a float changed every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)) / self.temperature


class Anneal(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        pl_module.temperature = 1.0 + 0.1 * trainer.global_step


@pytest.mark.parametrize("preset", ["off", "safe", "balanced", "aggressive"])
def test_an_annealed_temperature_matches_eager(preset: str) -> None:
    """The float changes every step; no preset runs a stale constant."""
    cb, _ = compare(Tempered, lambda: guard(preset), extra=lambda: [Anneal()])
    s = cb.summary()
    if preset in ("balanced", "aggressive"):
        # After one recompile Dynamo reads the float as an input: the stance is safe.
        assert s["steady_steps"] > 0


class Step(L.Callback):
    """Changes the temperature once, at the start of epoch 2 (a boundary)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 2:
            pl_module.temperature = 2.0


def test_a_scalar_changed_at_a_boundary_is_seen() -> None:
    cb, _ = compare(Tempered, lambda: guard("aggressive"), extra=lambda: [Step()], max_epochs=3)
    texts = [r["reason"] for r in cb.summary()["rearms"]] + [
        e["reason"] for e in cb.summary()["compile_events"]
    ]
    assert any("temperature" in t for t in texts), texts
