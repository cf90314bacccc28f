"""Shared fixtures: a tiny LightningModule, fixed data, and eager-vs-guarded runs."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("PYTHONHASHSEED", "0")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)

EAGER = {"backend": "eager"}


def guard(preset: str = "aggressive", **kwargs: Any) -> Any:
    """A GuardTuneCallback for tests: eager backend, a short warm-up."""
    from guardtrain import GuardTuneCallback

    kwargs.setdefault("warmup_steps", 3)
    kwargs.setdefault("stable_steps", 2)
    kwargs.setdefault("compile_kwargs", EAGER)
    return GuardTuneCallback(preset, **kwargs)


@pytest.fixture(autouse=True)
def _clean_dynamo():
    """Every test starts and ends with fresh Dynamo caches and the default stance."""
    torch._dynamo.reset()
    cfg = torch._dynamo.config
    saved = {
        "install_free_tensors": cfg.install_free_tensors,
        "use_recursive_dict_tags_for_guards": cfg.use_recursive_dict_tags_for_guards,
    }
    yield
    torch.compiler.set_stance("default")
    for key, value in saved.items():
        setattr(cfg, key, value)
    torch._dynamo.reset()


class TinyModule(L.LightningModule):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear; records every loss it computes."""

    def __init__(self, width: int = 16, p: float = 0.3, grad_in_val: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(p)
        )
        self.head = nn.Linear(width, 1)
        self.grad_in_val = grad_in_val
        self.train_losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.train_losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        if self.grad_in_val:
            with torch.enable_grad():
                loss = nn.functional.mse_loss(self(x), y)
        else:
            loss = nn.functional.mse_loss(self(x), y)
        self.val_losses.append(loss.detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loaders(
    n_train: int = 100, n_val: int = 50, batch_size: int = 16, drop_last: bool = False
) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_train, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n_train, 1, generator=g)
    xv = torch.randn(n_val, 8, generator=g)
    yv = xv[:, :1] * 0.5
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, drop_last=drop_last)
    val = DataLoader(TensorDataset(xv, yv), batch_size=batch_size)
    return train, val


def make_trainer(callbacks: Sequence[L.Callback] = (), **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(kwargs)
    return L.Trainer(callbacks=list(callbacks), **options)


def fit(
    model: L.LightningModule,
    callbacks: Sequence[L.Callback] = (),
    data: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(callbacks, **trainer_kwargs)
    train, val = loaders(**(data or {}))
    trainer.fit(model, train, val)
    return trainer


def assert_same_run(eager: TinyModule, guarded: TinyModule, exact: bool = True) -> None:
    """Same losses at every step and the same final weights (bitwise with backend='eager')."""
    check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    assert len(eager.train_losses) == len(guarded.train_losses)
    assert len(eager.val_losses) == len(guarded.val_losses)
    for i, (a, b) in enumerate(zip(eager.train_losses, guarded.train_losses)):
        assert check(a, b), f"train loss {i}: eager {a.item()} vs guarded {b.item()}"
    for i, (a, b) in enumerate(zip(eager.val_losses, guarded.val_losses)):
        assert check(a, b), f"val loss {i}: eager {a.item()} vs guarded {b.item()}"
    sd_e, sd_g = eager.state_dict(), guarded.state_dict()
    assert list(sd_e) == list(sd_g)
    for key in sd_e:
        assert check(sd_e[key], sd_g[key]), f"weights differ at {key}"


def compare(
    factory: Callable[[], TinyModule],
    callback: Callable[[], L.Callback],
    extra: Callable[[], Sequence[L.Callback]] = lambda: (),
    exact: bool = True,
    **fit_kwargs: Any,
) -> tuple[Any, TinyModule]:
    """Fit an uncompiled model and a guarded one the same way; assert equal; return the callback."""
    L.seed_everything(0, verbose=False)
    eager = factory()
    fit(eager, list(extra()), **fit_kwargs)
    L.seed_everything(0, verbose=False)
    guarded = factory()
    cb = callback()
    fit(guarded, [cb, *extra()], **fit_kwargs)
    assert_same_run(eager, guarded, exact=exact)
    return cb, guarded


def assert_restored(model: nn.Module) -> None:
    """No trace of the callback: stance, Dynamo config, instance `forward` attributes."""
    stance = torch._dynamo.eval_frame._stance
    assert stance.skip_guard_eval_unsafe is False
    assert torch._dynamo.config.install_free_tensors is False
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is False
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__, f"{name or 'root'} still has a compiled forward"
