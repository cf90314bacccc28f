"""A minimal stand-in for the lightning-hydra-template's MNIST app, for tests/test_template.py.

Not a copy of the template: only the parts that matter to guardtrain, written
again here, with the same structure:

* ``SimpleDenseNet``: the network, built by Hydra from a ``_target_`` node
  (``model.net``) and passed to the LightningModule as an argument;
* ``TemplateLitModule(net, optimizer, scheduler, compile)``: calls
  ``self.save_hyperparameters(logger=False)``, so the ``net`` object itself is
  pickled into every checkpoint's ``hyper_parameters``; its ``setup`` runs
  ``self.net = torch.compile(self.net)`` when ``compile`` is true and the stage
  is ``fit`` (Lightning calls it after the callbacks' ``setup``);
  ``configure_optimizers`` calls the partial optimizer/scheduler from hparams;
* ``GeneratedDataModule``: 2-D "images" drawn from a seed (no download),
  flattened by the net as the template's net flattens MNIST images; the
  validation set ends with a short batch.

The configs are in ``tests/template_conf/`` (``train.yaml``, ``model/``,
``data/``, ``trainer/``, ``callbacks/``, ``paths/``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SimpleDenseNet(nn.Module):
    """Flatten -> (Linear -> BatchNorm1d -> ReLU -> Dropout) x 2 -> Linear."""

    def __init__(
        self,
        input_size: int = 16,
        lin1_size: int = 32,
        lin2_size: int = 32,
        output_size: int = 4,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(lin1_size, lin2_size),
            nn.BatchNorm1d(lin2_size),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(lin2_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, 1, h, w) -> (batch, h * w), as the template's net does for MNIST.
        return self.model(x.view(x.size(0), -1))


class TemplateLitModule(L.LightningModule):
    """The template's LightningModule pattern: a module argument saved as a hyperparameter."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: Any,
        scheduler: Any,
        compile: bool,
    ) -> None:
        super().__init__()
        # Stores `net` (the nn.Module object) in self.hparams and so in every checkpoint.
        self.save_hyperparameters(logger=False)
        self.net = net
        self.criterion = nn.CrossEntropyLoss()  # a child without parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.forward(x)
        return self.criterion(logits, y), logits.argmax(dim=1), y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _, y = self.model_step(batch)
        self.log("train/loss", loss, on_step=False, on_epoch=True, batch_size=len(y))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, y = self.model_step(batch)
        acc = (preds == y).float().mean()
        self.log("val/loss", loss, on_step=False, on_epoch=True, batch_size=len(y))
        self.log("val/acc", acc, on_step=False, on_epoch=True, batch_size=len(y))

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "monitor": "val/loss",
                "interval": "epoch",
                "frequency": 1,
            },
        }


class GeneratedDataModule(L.LightningDataModule):
    """Class-dependent 1 x side x side "images" drawn from ``seed``; nothing is downloaded."""

    def __init__(
        self,
        n_train: int = 256,
        n_val: int = 100,
        batch_size: int = 32,
        side: int = 4,
        n_classes: int = 4,
        noise: float = 2.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        g = torch.Generator().manual_seed(h.seed)
        centres = torch.randn(h.n_classes, 1, h.side, h.side, generator=g)

        def draw(n: int) -> TensorDataset:
            y = torch.randint(h.n_classes, (n,), generator=g)
            x = centres[y] + h.noise * torch.randn(n, 1, h.side, h.side, generator=g)
            return TensorDataset(x, y)

        self.train_set = draw(h.n_train)
        self.val_set = draw(h.n_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
