"""A plain PyTorch training loop with GuardTuner, on generated data.

    python examples/plain_loop.py                  # eager backend: quick
    python examples/plain_loop.py --backend inductor
    python examples/plain_loop.py --fabric         # the same loop under Lightning Fabric
    python examples/plain_loop.py --no-guard       # the same loop without guardtrain

The run prints the final validation loss and guardtrain's summary.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guardtrain import GuardTuner


def make_data(seed: int = 0) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(600, 16, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long()
    train = DataLoader(TensorDataset(x[:500], y[:500]), batch_size=32, shuffle=True, generator=g)
    val = DataLoader(TensorDataset(x[500:], y[500:]), batch_size=32)  # a short last batch
    return train, val


class NoGuard:
    """Stands in for GuardTuner in the comparison run: every step and loop is a no-op."""

    phase = "-"

    def __enter__(self) -> NoGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self, batch: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def loop(self, name: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--preset", default="aggressive")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--fabric", action="store_true")
    parser.add_argument("--no-guard", action="store_true", help="run without guardtrain")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(
        nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader, val_loader = make_data()
    fabric = None
    if args.fabric:
        import lightning as L

        fabric = L.Fabric(accelerator="cpu", devices=1)
        model, opt = fabric.setup(model, opt)
        train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)
    loss_fn = nn.CrossEntropyLoss()
    val_loss = float("nan")
    guard = (
        NoGuard()
        if args.no_guard
        else GuardTuner(
            model,
            preset=args.preset,
            fabric=fabric,
            warmup_steps=5,
            stable_steps=2,
            compile_kwargs={"backend": args.backend},
        )
    )
    with guard as tuner:
        for _ in range(args.epochs):
            model.train()
            with tuner.loop("train"):
                for batch in train_loader:
                    with tuner.step(batch):
                        loss = loss_fn(model(batch[0]), batch[1])
                        (fabric.backward(loss) if fabric else loss.backward())
                        opt.step()
                        opt.zero_grad()
            model.eval()
            total, count = 0.0, 0
            with tuner.loop("validate"), torch.no_grad():
                for batch in val_loader:
                    with tuner.step(batch):
                        total += float(loss_fn(model(batch[0]), batch[1])) * len(batch[1])
                        count += len(batch[1])
            val_loss = total / count
    print(f"final val/loss={val_loss!r} phase={guard.phase}")
    return val_loss


if __name__ == "__main__":
    main()
