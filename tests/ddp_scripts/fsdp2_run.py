"""FSDP2 (``fully_shard``) on the CPU, 2 processes over gloo: GuardTuner beside an eager twin.

Usage::

    python -m torch.distributed.run --standalone --nproc_per_node 2 fsdp2_run.py OUT plain ...
    python fsdp2_run.py OUT fabric ...   # Fabric's ModelParallelStrategy starts rank 1 itself

``plain``: ``fully_shard`` by hand over ``init_device_mesh("cpu", (2,))``.
``fabric``: ``ModelParallelStrategy`` with a ``parallelize_fn`` that applies
``fully_shard`` over its data-parallel mesh. Each rank trains a guarded net and
an uncompiled twin (same initial weights, same data) one after the other and
writes ``OUT/rank{r}.json``: whether every loss and the final (gathered) weights
equalled the twin's, bitwise, and the guard's summary.

Options: ``--guard PRESET`` (aggressive), ``--targets a,b`` (regional targets),
``--short-batch STEP`` (rank 1's batch at that step is 3 rows short: an uneven
shard), ``--steps N`` (24), ``--timeout S`` (collectives time out, 60), ``--hook-at STEP``
(a forward hook halving ``blocks[0].lin``'s output added to both nets before that step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from guardtrain import GuardTuner
from guardtrain.compile import steady_now

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _leave import leave
from helpers import turbo_everywhere

turbo_everywhere()

FEATURES, WIDTH, BATCH = 8, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """No Dropout: the twin and the guarded net run one after the other on one RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batches(rank: int, steps: int, short_at: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(steps):
        x = torch.randn(BATCH, FEATURES, generator=g)
        y = x[:, :1] * 0.5
        if step == short_at and rank == 1:
            x, y = x[:-3], y[:-3]
        out.append((x, y))
    return out


def _halve(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 0.5


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered (a collective on each DTensor)."""
    state = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = t.detach().clone()
    return state


def train(args: argparse.Namespace, rank: int, setup: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = Net()
    twin, net = Net(), Net()
    twin.load_state_dict(reference.state_dict())
    net.load_state_dict(reference.state_dict())
    twin, twin_opt = setup(twin)
    net, opt = setup(net)
    data = batches(rank, args.steps, args.short_batch)
    loss_fn = nn.functional.mse_loss
    equal_losses, losses = True, []
    targets = args.targets.split(",") if args.targets else None
    with GuardTuner(
        net,
        args.guard,
        targets=targets,
        warmup_steps=3,
        stable_steps=2,
        compile_kwargs={"backend": args.backend},
        fabric=args.fabric_obj,
    ) as tuner:
        stance = []
        for step, (x, y) in enumerate(data):
            if step == args.hook_at:
                for model in (net, twin):
                    model.blocks[0].lin.register_forward_hook(_halve)
            with tuner.step((x, y)):
                loss = loss_fn(net(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            stance.append("1" if steady_now() else "0")
            ref = loss_fn(twin(x), y)
            ref.backward()
            twin_opt.step()
            twin_opt.zero_grad()
            losses.append((loss.item(), ref.item()))
            equal_losses = equal_losses and torch.equal(loss.detach(), ref.detach())
    a, b = full_state(net), full_state(twin)
    s = tuner.summary()
    return {
        "rank": rank,
        "equal_losses": bool(equal_losses),
        "equal_weights": list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a),
        "losses": losses,
        "steps": len(losses),
        "stance": "".join(stance),
        "summary": {
            k: s[k]
            for k in (
                "phase",
                "steady_steps",
                "levers",
                "switched_off",
                "direct_dispatch",
                "auto",
                "step",
                "rearms",
                "targets",
            )
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=["plain", "fabric"])
    parser.add_argument("--guard", default="aggressive")
    parser.add_argument("--targets", default="")
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--short-batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--hook-at", type=int, default=None)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(seconds=args.timeout)  # a hang fails fast
    args.fabric_obj = None
    if args.mode == "plain":
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (2,))

        def setup(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
            model = shard(model, mesh)
            return model, torch.optim.SGD(model.parameters(), lr=0.05)

    else:
        import lightning as L
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(
            parallelize_fn=lambda model, mesh: shard(model, mesh["data_parallel"]),
            data_parallel_size=2,
            tensor_parallel_size=1,
            timeout=timedelta(seconds=args.timeout),
        )
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        args.fabric_obj = fabric
        rank = fabric.global_rank

        def setup(model: nn.Module) -> tuple[Any, Any]:
            model = fabric.setup_module(model)
            return model, fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))

    try:
        result = train(args, rank, setup)
    except BaseException:
        (out / f"rank{rank}.error.txt").write_text(traceback.format_exc())
        raise
    tmp = out / f"rank{rank}.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, out / f"rank{rank}.json")


if __name__ == "__main__":
    main()
    leave()
