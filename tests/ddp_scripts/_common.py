"""Shared pieces of the multi-process scripts: a tiny model, per-rank data, result files.

The scripts in this folder are started by ``tests/test_distributed.py`` with
``subprocess.run``; Lightning's ``ddp`` strategy then starts the other ranks by
re-running the same command line (which is why they cannot run inside pytest).
Nothing here imports pytest or the test suite.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

N_BATCHES = 10
BATCH = 8
FEATURES = 8


def set_collective_timeout(seconds: float) -> timedelta:
    """Make every process group (also Dynamo's guard group, created lazily) time out early.

    ``torch.distributed`` reads ``default_pg_timeout`` when a group is created
    without a timeout; Dynamo's guard-collective group is created that way. A
    hang in a collective then becomes an error after ``seconds`` instead of 30 min.
    """
    timeout = timedelta(seconds=seconds)
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    return timeout


class Batches(Dataset):
    """Pre-made batches (use with ``batch_size=None``): rank-specific data.

    ``short_at``: the batch fetched in that position (counted over every epoch,
    so with ``num_workers=0`` it is the training batch of that global step) is
    3 rows short, in this process only: an uneven shard, once.
    """

    def __init__(self, rank: int, seed: int, n: int, short_at: int | None = None) -> None:
        g = torch.Generator().manual_seed(1000 * seed + rank)
        self.items = []
        for _ in range(n):
            x = torch.randn(BATCH, FEATURES, generator=g)
            y = x[:, :1] * 0.5 + 0.1 * torch.randn(BATCH, 1, generator=g)
            self.items.append((x, y))
        self.short_at = short_at
        self.fetched = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        x, y = self.items[i]
        if self.fetched == self.short_at:
            x, y = x[:-3], y[:-3]
        self.fetched += 1
        return x, y


class TinyDDPModule(L.LightningModule):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear, as tests/helpers.py's TinyModule.

    Data is made per rank in the dataloader hooks (``use_distributed_sampler=False``).

    Args:
        short_batch: ``(rank, global_step)``: that rank's dataloader yields a
            batch 3 rows short at that step (an uneven shard); the callback's
            per-batch check sees it before the step.
        slice_at: ``(rank, global_step)``: that rank cuts its batch inside
            ``training_step`` (the callback's per-batch check does not see it;
            a compiled call under the stance misses).
        shard: apply ``fully_shard`` in ``configure_model`` (ModelParallelStrategy).
    """

    def __init__(
        self,
        width: int = 16,
        p: float = 0.3,
        short_batch: tuple[int, int] | None = None,
        slice_at: tuple[int, int] | None = None,
        shard: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(FEATURES, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(p)
        )
        self.head = nn.Linear(width, 1)
        self.short_batch = short_batch
        self.slice_at = slice_at
        self.shard = shard
        self.train_losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh
        for module in (self.backbone, self.head):
            fully_shard(module, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.slice_at is not None and tuple(self.slice_at) == (
            self.global_rank,
            self.global_step,
        ):
            x, y = x[:-2], y[:-2]
        loss = nn.functional.mse_loss(self(x), y)
        self.train_losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(nn.functional.mse_loss(self(x), y).detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        short = None
        if self.short_batch is not None and self.short_batch[0] == self.global_rank:
            short = self.short_batch[1]
        return DataLoader(Batches(self.global_rank, 1, N_BATCHES, short), batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Batches(self.global_rank, 2, 3), batch_size=None)


class EvalForOneStep(L.Callback):
    """On one rank, at one global step, switch the module to eval for that batch only.

    Put it before the GuardTuneCallback: the guard's per-batch check then sees the flag.
    """

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.fired = False
        self._active = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int
    ) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            pl_module.eval()
            self.fired = self._active = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self._active:
            pl_module.train()
            self._active = False


def guard_collectives_hook_installed() -> bool:
    """Whether Dynamo's guard-collective hook is installed now (read without changing it)."""
    from torch._C._dynamo.eval_frame import set_guard_complete_hook
    from torch._dynamo.eval_frame import guard_collectives_hook

    previous = set_guard_complete_hook(None)
    set_guard_complete_hook(previous)
    return previous is guard_collectives_hook


def stance_on() -> bool:
    """Whether guardtrain's targets are steady (their calls set the stance for themselves)."""
    from guardtrain.compile import steady_now

    return steady_now()


class Probe(L.Callback):
    """Per rank, at every training batch start (after the guard's hook): stance and collectives.

    ``stance`` and ``collectives`` get one character per training batch
    (``"1"`` on, ``"0"`` off), indexed by global step. ``rearms_local`` is the
    guard's ``summary()["rearms"]`` at ``on_train_end``, before anything at the
    end of ``fit`` could merge other ranks' re-arms into it.
    """

    def __init__(self, guard: Any) -> None:
        self.guard = guard
        self.stance: list[str] = []
        self.collectives: list[str] = []
        self.rearms_local: list[Any] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int
    ) -> None:
        self.stance.append("1" if stance_on() else "0")
        self.collectives.append("1" if guard_collectives_hook_installed() else "0")

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.guard is not None:
            self.rearms_local = list(self.guard.summary()["rearms"])

    def report(self) -> dict[str, Any]:
        stance = "".join(self.stance)
        return {
            "stance": stance,
            "collectives": "".join(self.collectives),
            "first_stance_step": stance.find("1") if "1" in stance else None,
            "rearms_local": self.rearms_local,
        }


class SaveResults(L.Callback):
    """At the end of training, on every rank: the full state dict and the losses of this rank."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        state = trainer.strategy.lightning_module_state_dict()  # a collective for FSDP
        state = {k: _full(v) for k, v in state.items()}
        torch.save(
            {
                "state_dict": state,
                "train_losses": [t.cpu() for t in pl_module.train_losses],
                "val_losses": [t.cpu() for t in pl_module.val_losses],
            },
            self.out / f"rank{trainer.global_rank}.pt",
        )


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy of a tensor; a DTensor (ModelParallelStrategy) is gathered (a collective)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)
