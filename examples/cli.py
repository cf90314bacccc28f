"""Train a small regressor with LightningCLI, optionally with a GuardTuneCallback.

Needs ``jsonargparse[signatures]`` (``pip install "guardtrain[dev]"`` or
``pip install "lightning[pytorch-extra]"``). Data are generated from ``--data.seed``;
nothing is downloaded. Add the callback and set its arguments on the command line::

    python examples/cli.py fit --trainer.callbacks+=guardtrain.GuardTuneCallback \\
        --trainer.callbacks.preset=aggressive \\
        --trainer.callbacks.guard_filter='[skip_all_nn_modules, skip_globals]' \\
        --trainer.callbacks.compile_kwargs='{backend: eager}'

Each ``--trainer.callbacks.ARG=VALUE`` applies to the callback added last by
``--trainer.callbacks+=``. Values are YAML: ``guard_filter=skip_globals`` is one
filter name, ``guard_filter='[a, b]'`` a list of names (quoted for the shell;
repeating ``--trainer.callbacks.guard_filter+=NAME`` builds the same list),
``targets='[net]'`` a list of submodule names, ``audit_every=null`` None. The
presets are listed by::

    python examples/cli.py fit --trainer.callbacks.help guardtrain.GuardTuneCallback

LightningCLI saves the whole configuration as ``config.yaml`` in the run's log
directory (``lightning_logs/version_N/``); it replays the run::

    python examples/cli.py fit --config lightning_logs/version_0/config.yaml

The callback can also be written in a config file of your own::

    trainer:
      callbacks:
        - class_path: guardtrain.GuardTuneCallback
          init_args:
            preset: aggressive
            guard_filter: [skip_all_nn_modules, skip_globals]
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class RandomRegressionData(L.LightningDataModule):
    """A noisy linear target drawn from ``seed``: training and validation sets.

    Args:
        n_features: inputs per sample.
        n_train: training samples.
        n_val: validation samples.
        batch_size: samples per batch.
        seed: seed of the generator that draws the data.
    """

    def __init__(
        self,
        n_features: int = 8,
        n_train: int = 256,
        n_val: int = 64,
        batch_size: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.n_features = n_features
        self.n_train = n_train
        self.n_val = n_val
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.seed)
        weight = torch.randn(self.n_features, 1, generator=g)

        def draw(n: int) -> TensorDataset:
            x = torch.randn(n, self.n_features, generator=g)
            return TensorDataset(x, x @ weight + 0.1 * torch.randn(n, 1, generator=g))

        self.train_set = draw(self.n_train)
        self.val_set = draw(self.n_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class LitRegressor(L.LightningModule):
    """An MLP with BatchNorm1d and Dropout; ``forward`` delegates to ``self.net``.

    Args:
        n_features: inputs per sample (match ``--data.n_features``).
        hidden: width of the hidden layer.
        dropout: dropout probability.
        lr: learning rate of SGD.
    """

    def __init__(
        self, n_features: int = 8, hidden: int = 32, dropout: float = 0.1, lr: float = 0.05
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(n_features, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, batch_size=len(y))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y), prog_bar=True, batch_size=len(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Build the CLI from ``args`` (default: ``sys.argv``); ``run=False`` only instantiates."""
    return LightningCLI(
        LitRegressor,
        RandomRegressionData,
        seed_everything_default=0,
        trainer_defaults={"max_epochs": 5},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
