"""Cost of the per-call entry check of a batch with an unseen signature (H26).

Times ``guardtrain.compile.accept.accepts`` for every target against one model call under
the stance, on the bench's 12-block transformer, whole model and 12 blocks
(shared code), ``aggressive``, eager backend, ``no_grad``, one thread.

    .venv/bin/python scripts/entry_check_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from guardtrain import GuardTuner
from guardtrain.bench.models import Transformer
from guardtrain.compile.accept import accepts


def median_us(fn: Callable[[], object], calls: int = 200, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def measure(targets: list[str] | None, label: str) -> None:
    model = Transformer().eval()
    x = torch.randn(8, 16, 16)
    kwargs = {"backend": "eager"}
    with (
        GuardTuner(
            model,
            "aggressive",
            targets=targets,
            compile_kwargs=kwargs,
            warmup_steps=2,
            stable_steps=1,
            measure_lookup=False,
        ) as tuner,
        torch.no_grad(),
    ):
        for _ in range(6):
            with tuner.step((x,)):
                model(x)
        compiled = tuner.engine.targets.installed
        args = (x,) if targets is None else (model.inp(x),)

        def check() -> None:
            for target in compiled:
                assert accepts(target, args, {})

        with tuner.step((x,)):
            check_us = median_us(check)
            call_us = median_us(lambda: model(x))
    print(
        f"{label}: {len(compiled)} entry checks {check_us:.1f} us per model call; "
        f"model call under the stance {call_us:.1f} us"
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    measure(None, "whole model")
    measure(["blocks.*"], "12 blocks (shared code)")


if __name__ == "__main__":
    main()
