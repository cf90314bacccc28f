"""The optimizer step on the bench's 12-block transformer, side by side (H49).

Four configurations of Adam (one model each, the same seed), interleaved in one process,
the order rotating every round: the eager step (``foreach=True``), plain compile
(``torch.compile`` of a function that calls ``opt.step()``, PyTorch's recipe),
guardtrain's compiled step (``compile_optimizer=True``, :class:`GuardTuner`) and the
same compiled step with every step run with full guards (what its direct dispatch
saves). Each step: fresh gradients from one forward and backward (not timed), then the
timed ``opt.step()``; a ``LambdaLR`` schedule on a float lr moves it every step
(``--no-schedule``: a constant lr). Medians of ``--steps`` timed steps after
``--warmup`` untimed ones; the ratio of each median to plain compile's.

    python scripts/optimizer_step_cost.py [--backend inductor] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from guardtrain import GuardTuner
from guardtrain.bench.models import Transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--no-schedule", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kw = {"backend": args.backend}
    x = torch.randn(4, 8, 16)
    runs: dict[str, dict[str, Any]] = {}
    for name in ("eager foreach", "plain compile", "guardtrain", "guardtrain, full guards"):
        torch.manual_seed(0)
        model = Transformer()
        # foreach for eager (its fastest on the CPU); the compiled ones trace the default
        # (a foreach update specialises on a float lr: a recompile at each new value).
        foreach = True if name == "eager foreach" else None
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
        sched = (
            None
            if args.no_schedule
            else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
        )
        step: Callable[[], Any] = opt.step
        tuner = None
        if name == "plain compile":

            def plain(opt: torch.optim.Optimizer = opt) -> None:
                opt.step()

            step = torch.compile(plain, **kw)
        elif name.startswith("guardtrain"):
            tuner = GuardTuner(
                model, "off", compile_kwargs=kw, compile_optimizer=True, optimizers=[opt]
            )
            tuner.__enter__()
            step = opt.step
            if name.endswith("full guards"):  # every step with full guards, none direct
                for compiled in tuner._engine.run.optimizers.installed:
                    compiled.direct_allowed = False
        runs[name] = {"model": model, "opt": opt, "sched": sched, "step": step, "tuner": tuner}
    params = sum(1 for _ in runs["eager foreach"]["model"].parameters())

    def one(run: dict[str, Any]) -> float:
        model, opt = run["model"], run["opt"]
        model(x).square().mean().backward()
        started = time.perf_counter_ns()
        run["step"]()
        took = (time.perf_counter_ns() - started) / 1e3
        opt.zero_grad(set_to_none=True)
        if run["sched"] is not None:
            run["sched"].step()
        return took

    names = list(runs)
    for name in names:
        for _ in range(args.warmup):
            one(runs[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.steps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            times[name].append(one(runs[name]))
    plain = statistics.median(times["plain compile"])
    print(
        f"torch {torch.__version__}, {args.backend}, Adam on {params} parameters, "
        f"{'constant lr' if args.no_schedule else 'LambdaLR on a float lr'}, "
        f"{args.steps} steps each, µs per step (median, quartiles)"
    )
    print("| step | median | quartiles | / plain compile |")
    print("|---|---:|---|---:|")
    for name in names:
        ts = sorted(times[name])
        q = len(ts) // 4
        med = statistics.median(ts)
        print(f"| {name} | {med:.0f} | {ts[q]:.0f}-{ts[3 * q]:.0f} | {med / plain:.2f} |")
    for name in names:
        tuner = runs[name]["tuner"]
        if tuner is not None:
            print(name, tuner.summary()["optimizers"])
            tuner.__exit__(None, None, None)


if __name__ == "__main__":
    main()
