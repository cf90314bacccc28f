"""What GuardTrainerCallback's hooks cost per forward call in the steady state, in µs.

Trains a tiny GPT-2 in a Hugging Face ``Trainer`` with ``GuardTrainerCallback`` (eager
backend) until training is steady, then, inside a later step (the run still active),
times the callback's two hooks on the last batch's arguments, as torch calls them
around ``model(**inputs)``: the forward pre-hook (the engine's ``batch_start``: the
batch-signature match, the stance set) and the forward hook (the stance lifted, the
engine's ``batch_end``). Audits (every ``audit_every`` calls) are included, amortised;
one audit's boundary re-check and its parts are timed on their own too.

For scale it also times what torch itself adds to a call for two hooks (a module
whose ``forward`` does nothing, with and without two no-op hooks). Medians of 7
repeats. Usage::

    .venv/bin/python scripts/hf_hook_cost.py [--preset aggressive] [--calls 20000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from guardtrain import GuardTrainerCallback
from guardtrain.compile import assertions as _assertions
from guardtrain.fingerprints import module_fingerprint
from guardtrain.hf_accelerate import Hook

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout: benchmarks/
from benchmarks.hf_data import tiny_gpt2


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, 64, (16,), generator=g) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.items[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def per_call(fn: Any, calls: int, repeats: int = 7) -> float:
    """Median µs per call of ``fn``, minus an empty loop."""

    def loop(f: Any) -> float:
        t = time.perf_counter()
        for _ in range(calls):
            f()
        return (time.perf_counter() - t) / calls * 1e6

    empty = statistics.median(loop(lambda: None) for _ in range(repeats))
    return statistics.median(loop(fn) for _ in range(repeats)) - empty


class Timer(TrainerCallback):
    """Times the guard's hooks once training is steady (inside the run)."""

    def __init__(self, guard: GuardTrainerCallback, calls: int) -> None:
        self.guard = guard
        self.calls = calls
        self.result: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}

    def record(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self.inputs = dict(kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        g = self.guard
        if self.result or g.phase != "steady" or state.global_step < 30:
            return
        model = kw["model"]
        before, after = model._forward_pre_hooks, model._forward_hooks
        pre = next(h for h in before.values() if isinstance(h, Hook))
        post = next(h for h in after.values() if isinstance(h, Hook))
        inputs = self.inputs
        model.train()
        steady_before = g.engine.run.machine.steady_steps

        def both() -> None:
            pre(model, (), inputs)
            post(model, (), None)

        self.result = {
            "hooks_us": per_call(both, self.calls),
            "steady": g.phase == "steady",
            "steady_calls_counted": g.engine.run.machine.steady_steps - steady_before,
            "audit": audit_parts(g.engine, max(self.calls // 100, 20)),
        }


def audit_parts(engine: Any, calls: int) -> dict[str, float]:
    """µs of one audit's boundary re-check of every target, and of its parts summed over
    the targets: the assertions (grouped checks, and one by one for comparison) and the
    module fingerprints. Side by side in this process, medians of 7."""
    targets = engine.targets.installed

    def assertions() -> None:
        for t in targets:
            t.check_assertions()

    def fingerprints() -> None:
        for t in targets:
            module_fingerprint(t.module)

    parts = {
        "boundary_us": per_call(lambda: engine._batches.boundary("train"), calls),
        "assertions_us": per_call(assertions, calls),
        "fingerprints_us": per_call(fingerprints, calls),
    }
    grouped = _assertions._all_hold
    _assertions._all_hold = lambda entries, scope, globals_too: False  # type: ignore[assignment]
    try:
        parts["assertions_one_by_one_us"] = per_call(assertions, calls)
    finally:
        _assertions._all_hold = grouped
    return parts


def torch_hook_overhead(calls: int) -> float:
    """µs that two no-op hooks (one with kwargs, one always called) add to a call."""

    class Nothing(nn.Module):
        def forward(self, **kwargs: Any) -> None:
            return None

    plain, hooked = Nothing(), Nothing()
    hooked.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    hooked.register_forward_hook(lambda m, a, o: None, always_call=True)
    x = {"input_ids": torch.ones(1)}
    return per_call(lambda: hooked(**x), calls) - per_call(lambda: plain(**x), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="aggressive")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument(
        "--audit-every", type=int, default=200, help="0: no audits (the per-call path only)"
    )
    opts = parser.parse_args()
    torch.set_num_threads(1)
    set_seed(0)
    model, _ = tiny_gpt2()
    guard = GuardTrainerCallback(
        opts.preset,
        compile_kwargs={"backend": "eager"},
        warmup_steps=8,
        stable_steps=4,
        audit_every=opts.audit_every or None,
    )
    timer = Timer(guard, opts.calls)
    model.register_forward_pre_hook(timer.record, with_kwargs=True)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            max_steps=32,
            per_device_train_batch_size=4,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            logging_strategy="no",
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=Tokens(128), callbacks=[guard, timer]
        )
        trainer.train()
    if not timer.result:
        raise SystemExit(f"training never became steady: {guard.summary()['phases']}")
    r = timer.result
    print(
        f"torch {torch.__version__}, preset {opts.preset}, audit_every {opts.audit_every or None}, "
        f"{time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.1f}\n"
        f"GuardTrainerCallback hooks per forward (steady): {r['hooks_us']:.2f} µs "
        f"(steady throughout: {r['steady']}, {r['steady_calls_counted']} steady calls counted)\n"
        f"torch's own cost of two hooks on a call: {torch_hook_overhead(opts.calls):.2f} µs"
    )
    a = r["audit"]
    print(
        f"one audit (every {opts.audit_every or None} calls): boundary re-check "
        f"{a['boundary_us']:.0f} µs; its assertions {a['assertions_us']:.0f} µs "
        f"(one by one: {a['assertions_one_by_one_us']:.0f} µs), "
        f"fingerprints {a['fingerprints_us']:.0f} µs"
    )


if __name__ == "__main__":
    main()
