"""Per-call cost of ``torch.compiler.set_enable_guard_collectives(True)`` in steady state.

Starts ``--world`` processes (gloo, CPU by default; ``--device cuda`` uses NCCL,
one GPU per rank), compiles a small MLP with ``backend="eager"`` in each, warms
it up, and times blocks of ``--calls`` compiled calls under ``no_grad`` in these
configurations, interleaved (the order rotates every repeat), reporting the
median over ``--repeats`` of the per-call time:

* ``eager``: the uncompiled module (reference);
* ``guards``: compiled, default stance, full guards;
* ``stance``: compiled, ``set_stance(skip_guard_eval_unsafe=True)``;
* ``stance+gc``: the stance and guard collectives (guardtrain's ``guard_collectives=True``);
* ``guards+gc``: full guards and guard collectives;
* ``all_gather_object``: one ``dist.all_gather_object`` of a bool on a second
  group, which is what the guard-collective hook issues per compiled call;
* ``all_reduce``: one ``dist.all_reduce`` of a one-element tensor (what a
  tensor-based vote would cost, for comparison).

Every rank runs the same calls in the same order (guard collectives need an
SPMD program). Rank 0 prints a table and writes JSON to ``--out`` if given.

    .venv/bin/python scripts/bench_guard_collectives.py --repeats 15 --calls 200
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

CONFIGS = (
    "eager",
    "guards",
    "stance",
    "stance+gc",
    "guards+gc",
    "all_gather_object",
    "all_reduce",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _set(stance: bool, gc: bool) -> None:
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=stance)
    torch.compiler.set_enable_guard_collectives(gc)


def _worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        backend, device = "nccl", torch.device("cuda", rank)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world
    )
    ref_group = dist.new_group(backend=backend)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    x = torch.randn(8, args.width, device=device)
    compiled = torch.compile(model, backend="eager")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        for _ in range(5):
            compiled(x)
        # Dynamo's guard group is created (a collective) at the first guarded call with gc on.
        _set(False, True)
        compiled(x)
        _set(False, False)

        def block(config: str) -> float:
            if config == "all_gather_object":
                out: list[Any] = [None] * args.world
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    dist.all_gather_object(out, True, group=ref_group)
                t1 = time.perf_counter()
                return (t1 - t0) / args.calls
            if config == "all_reduce":
                flag = torch.ones(1, device=device)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    dist.all_reduce(flag, group=ref_group)
                sync()
                t1 = time.perf_counter()
                return (t1 - t0) / args.calls
            fn = model if config == "eager" else compiled
            _set("stance" in config, config.endswith("+gc"))
            try:
                fn(x)  # not timed: the first call after a stance change
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn(x)
                sync()
                t1 = time.perf_counter()
            finally:
                _set(False, False)
            return (t1 - t0) / args.calls

        times: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for rep in range(args.repeats):
            order = CONFIGS[rep % len(CONFIGS) :] + CONFIGS[: rep % len(CONFIGS)]
            for config in order:
                times[config].append(block(config))
    result = {c: statistics.median(v) * 1e6 for c, v in times.items()}
    spread = {c: (min(v) * 1e6, max(v) * 1e6) for c, v in times.items()}
    queue.put((rank, result, spread))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200, help="compiled calls per timed block")
    ap.add_argument("--repeats", type=int, default=15, help="blocks per configuration")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_worker, args=(args, _free_port(), queue), nprocs=args.world, join=True)
    rows = sorted(queue.get() for _ in range(args.world))
    report = {
        "torch": torch.__version__,
        "device": args.device,
        "world": args.world,
        "model": f"{args.layers} x (Linear({args.width}, {args.width}) + ReLU), input (8, {args.width}), no_grad",
        "calls_per_block": args.calls,
        "repeats": args.repeats,
        "median_us_per_call": {f"rank{r}": res for r, res, _ in rows},
        "min_max_us_per_call": {f"rank{r}": sp for r, _, sp in rows},
    }
    print(f"torch {torch.__version__}, {args.world} processes, {args.device}, {report['model']}")
    print(f"median of {args.repeats} blocks of {args.calls} calls, µs per call")
    print(f"{'config':<20}" + "".join(f"{'rank' + str(r):>12}" for r, _, _ in rows))
    for c in CONFIGS:
        print(f"{c:<20}" + "".join(f"{res[c]:>12.1f}" for _, res, _ in rows))
    r0 = rows[0][1]
    print(
        f"guard collectives add {r0['stance+gc'] - r0['stance']:.1f} µs per compiled call "
        f"under the stance (rank 0), {r0['guards+gc'] - r0['guards']:.1f} µs with full guards"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
