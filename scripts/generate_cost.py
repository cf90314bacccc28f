"""``generate()``'s time under guardtrain against plain ``model.compile()`` (H53).

A tiny ``LlamaForCausalLM`` (2 layers, hidden 32, vocabulary 64, random weights) in
``eval()``, four prompts of 8 tokens, ``max_new_tokens=24`` (24 model calls: the prefill,
then decode calls with a growing ``DynamicCache``). Two copies of the model: one compiled
with ``model.compile()``, one under :class:`~guardtrain.GuardTuner` with each
``generate()`` inside ``tuner.loop("predict")`` and ``tuner.step(prompts)``. Both warm up
first; then rounds that time each side's ``generate()`` by the calling thread's CPU time
(and the wall clock) at one torch thread, the order alternating from round to round.
Prints per round the medians and their ratio, then the median of the per-round ratios,
the share of the model calls that ran under the stance or directly, and whether the
tokens equal eager's (greedy) and plain compile's (sampled, the same seed). Usage::

    .venv/bin/python scripts/generate_cost.py [--preset auto] [--backend inductor]
        [--rounds 7] [--per-round 10] [--sample]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from guardtrain import GuardTuner

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout: benchmarks/
from benchmarks.hf_data import tiny_llama_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="auto")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--per-round", type=int, default=10, help="generate() calls per side a round")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--sample", action="store_true", help="sample (top_k=8) instead of greedy")
    a = p.parse_args()
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    def model() -> Any:
        torch.manual_seed(0)
        return LlamaForCausalLM(tiny_llama_config()).eval()

    prompts = torch.randint(4, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    extra: dict[str, Any] = {"do_sample": True, "top_k": 8} if a.sample else {"do_sample": False}

    def generate(m: Any) -> torch.Tensor:
        torch.manual_seed(3)
        with torch.no_grad():
            return m.generate(
                input_ids=prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=a.new_tokens,
                pad_token_id=0,
                **extra,
            )

    eager = generate(model())
    plain = model()
    plain.compile(backend=a.backend)
    guarded = model()
    with GuardTuner(guarded, a.preset, compile_kwargs={"backend": a.backend}) as tuner:

        def under_guardtrain() -> torch.Tensor:
            with tuner.loop("predict"), tuner.step(prompts):
                return generate(guarded)

        sides = {"plain": lambda: generate(plain), "guardtrain": under_guardtrain}
        for _ in range(3):  # warm up: compiles, then a complete predict pass
            outs = {name: f() for name, f in sides.items()}
        before = tuner.summary()["decode_calls"]
        ratios, wall_ratios = [], []
        for r in range(a.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            cpu: dict[str, list[int]] = {name: [] for name in sides}
            wall: dict[str, list[int]] = {name: [] for name in sides}
            for name in order:
                for _ in range(a.per_round):
                    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                    outs[name] = sides[name]()
                    cpu[name].append(time.thread_time_ns() - c0)
                    wall[name].append(time.perf_counter_ns() - w0)
            m = {n: statistics.median(v) / 1e3 for n, v in cpu.items()}
            w = {n: statistics.median(v) / 1e3 for n, v in wall.items()}
            ratios.append(m["guardtrain"] / m["plain"])
            wall_ratios.append(w["guardtrain"] / w["plain"])
            print(
                f"round {r}: plain {m['plain']:.0f} us, guardtrain {m['guardtrain']:.0f} us "
                f"(thread CPU), ratio {ratios[-1]:.3f} (wall {wall_ratios[-1]:.3f})"
            )
        s = tuner.summary()
        served = s["decode_calls"]["served"] - before["served"]
        full = s["decode_calls"]["full_guards"] - before["full_guards"]
    print(
        f"guardtrain ({a.preset}) / plain compile, generate() thread CPU time: median "
        f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] over "
        f"{a.rounds} rounds (wall {statistics.median(wall_ratios):.3f})"
    )
    print(f"model calls in the rounds: {served} served, {full} with full guards")
    same = torch.equal(outs["guardtrain"], outs["plain"])
    print(
        f"tokens equal plain compile's: {same}; equal eager's: {torch.equal(outs['guardtrain'], eager)}"
    )


if __name__ == "__main__":
    main()
