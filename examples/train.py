"""Train a small classifier with Hydra configs, optionally with a GuardTuneCallback.

The configs live in ``conf/`` at the top of the repository, in the
lightning-hydra-template layout (``data/``, ``model/``, ``trainer/``,
``callbacks/``). guardtrain's Hydra plugin adds its ``guard`` group::

    python examples/train.py +guard=aggressive
    python examples/train.py +guard=off                  # same task, guards left alone
    python examples/train.py +guard=balanced callbacks.guard_tune.warmup_steps=50
    python examples/train.py +guard=aggressive callbacks.guard_tune.compile_kwargs.backend=eager

The run logs ``final val/loss=...`` and, with a GuardTuneCallback, guardtrain's
summary (``guardtrain summary``, ``phase ... steady``). Data are generated from
the seed, so two runs of the same config give the same numbers.
"""

from __future__ import annotations

import logging
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

log = logging.getLogger(__name__)


class BlobsDataModule(L.LightningDataModule):
    """Gaussian blobs drawn from ``seed``: a training set and a validation set.

    The training loader drops its short last batch; the validation loader keeps
    it (``n_val`` is not a multiple of ``batch_size``), so every validation pass
    ends with a batch of another shape.
    """

    def __init__(
        self,
        n_features: int = 16,
        n_classes: int = 4,
        n_train: int = 960,
        n_val: int = 200,
        batch_size: int = 64,
        spread: float = 5.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.n_features = n_features
        self.n_classes = n_classes
        self.n_train = n_train
        self.n_val = n_val
        self.batch_size = batch_size
        self.spread = spread
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.seed)
        centres = torch.randn(self.n_classes, self.n_features, generator=g) * 3.0

        def draw(n: int) -> TensorDataset:
            y = torch.randint(self.n_classes, (n,), generator=g)
            x = centres[y] + self.spread * torch.randn(n, self.n_features, generator=g)
            return TensorDataset(x, y)

        self.train_set = draw(self.n_train)
        self.val_set = draw(self.n_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class LitClassifier(L.LightningModule):
    """An MLP with BatchNorm1d and Dropout; ``forward`` delegates to ``self.net``."""

    def __init__(
        self,
        n_features: int,
        n_classes: int,
        hidden: int = 64,
        dropout: float = 0.3,
        lr: float = 0.05,
        momentum: float = 0.9,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(n_features, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.forward(x), y)
        self.log(
            "train/loss", loss, on_step=False, on_epoch=True, batch_size=len(y), sync_dist=True
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.forward(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=-1) == y).float().mean()
        self.log("val/loss", loss, prog_bar=True, batch_size=len(y), sync_dist=True)
        self.log("val/acc", acc, batch_size=len(y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum
        )


def instantiate_callbacks(callbacks_cfg: DictConfig | None) -> list[L.Callback]:
    """Instantiate every child of ``cfg.callbacks`` that has a ``_target_``."""
    callbacks: list[L.Callback] = []
    if not callbacks_cfg:
        return callbacks
    for cb_conf in callbacks_cfg.values():
        if isinstance(cb_conf, DictConfig) and "_target_" in cb_conf:
            log.info("Instantiating callback <%s>", cb_conf._target_)
            callbacks.append(hydra.utils.instantiate(cb_conf))
    return callbacks


def check_guard_group(cfg: DictConfig) -> None:
    """Fail if ``+guard=<option>`` was read as a plain value instead of a config group.

    Hydra treats ``+guard=aggressive`` as "add the key ``guard``" when no search
    path holds a ``guard`` group, and the run would go on without the callback.
    """
    if "guard" in cfg:
        raise ValueError(
            f"`guard={cfg.guard}` is a plain value, not a config: Hydra found no `guard` group, "
            "so guardtrain's Hydra plugin is not importable here (an editable install older "
            "than hydra_plugins/ needs `pip install -e .` again). "
            "Or pass hydra.searchpath=[pkg://guardtrain.conf]"
        )


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit on the blobs and return the final validation metrics."""
    check_guard_group(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = BlobsDataModule(**cfg.data)
    model = LitClassifier(n_features=cfg.data.n_features, n_classes=cfg.data.n_classes, **cfg.model)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks)
    trainer.fit(model, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    if trainer.is_global_zero:
        for key in sorted(metrics):
            # repr() round-trips: two runs can be compared bit for bit.
            log.info("final %s=%r", key, metrics[key])
    if torch.distributed.is_initialized():
        # Lightning destroys only an NCCL process group at exit. A gloo group left alive can
        # abort the process as it exits: a worker thread frees a finished collective's tensors
        # while the interpreter finalizes ("terminate called without an active exception").
        torch.distributed.destroy_process_group()
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float:
    return train(cfg)["val/loss"]


if __name__ == "__main__":
    main()
