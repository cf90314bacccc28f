"""What turbo's per-call checks cost (H30), part by part, in ns per call.

Compiles a small module with the ``turbo`` preset (eager backend), brings it to
the steady state, and times each check that a direct call makes on the call's
own inputs: the call key (structure, plain values, tensors), the outside-state
check (stance, eval-frame callback, torch-function modes, saved-tensor hooks),
the reset check (the entry's code still in Dynamo's code map), Dynamo's
``GlobalStateGuard`` and ``TensorGuards``, and with ``--diff`` (two entries
compiled for one mode) the entry's diff guards. Medians of 7 repeats, minus an
empty loop. Usage::

    .venv/bin/python scripts/direct_check_cost.py [--args N] [--diff]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from guardtrain import GuardTuner
from guardtrain import compile as gc


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.n = n
        self.flag = False

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = self.lin(xs[0])
        if self.flag:
            out = out * 2
        for x in xs[1:]:
            out = out + x
        return out


def per_call(fn: Callable[[], Any], n: int = 100_000) -> float:
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e9)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--args", type=int, default=2, help="tensor arguments per call")
    ap.add_argument(
        "--diff", action="store_true", help="compile two entries of one mode (diff guards)"
    )
    options = ap.parse_args()
    n, diff = options.args, options.diff
    torch.set_num_threads(1)
    model = Many(n)
    xs = tuple(torch.randn(16, 8) for _ in range(n))
    with GuardTuner(
        model,
        "turbo",
        warmup_steps=2,
        stable_steps=1,
        compile_kwargs={"backend": "eager"},
        measure_lookup=False,
    ) as tuner:
        for _ in range(5):
            with tuner.step(xs):
                model(*xs).sum().backward()
                if diff:  # a second entry of the same mode: diff guards pick between them
                    model.flag = True
                    model(*xs).sum().backward()
                    model.flag = False
        target = tuner.engine.targets.installed[0]
        assert target.counts.direct_calls > 0, "no direct calls: not in the steady state"
        with tuner.step(xs):
            model(*xs)  # harvest, in this batch, for the training mode
            mode = next(iter(target.learnt.dispatch_table))
            direct = target.learnt.dispatch_table[mode][0]
            scope = target.call_scope
            found = gc.call_key(xs, {})
            assert found is not None
            key, tensors = found
            live = gc.live_codes
            assert live is not None
            empty = per_call(lambda: None)
            rows = {
                "call key": per_call(lambda: gc.call_key(xs, {})),
                "outside state (stance, callback, modes, hooks)": per_call(
                    lambda: gc.outside_state_clear(target.plain_stance)
                ),
                "reset check (code in Dynamo's code map)": per_call(
                    lambda: id(direct.code) in live
                ),
                "GlobalStateGuard.check": per_call(direct.global_state.check),
                f"TensorGuards.check ({n} tensors)": per_call(
                    lambda: direct.tensors.check(*tensors)
                ),
                "DirectEntry.matches (all of the above but the outside state"
                + (", the guards beyond the arguments)" if diff else ")"): per_call(
                    lambda: direct.matches(key, tensors, scope, xs, {})
                ),
            }
    print(f"torch {torch.__version__}; ns per call, minus an empty call ({empty:.0f} ns)")
    for name, ns in rows.items():
        print(f"  {name:55s} {ns - empty:7.0f}")


if __name__ == "__main__":
    main()
