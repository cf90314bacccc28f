"""Cold against warm start with inductor: time to the first steady step (``compile_cache``).

Each run is a fresh process with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (a new
machine or container). A *cold* run has no compile-cache file and saves one at
the end; a *warm* run loads a copy of the first cold run's file. Runs alternate
(cold, warm, cold, warm, ...) so that load on the machine hits both alike; the
table gives the median of each.

Measured in the child, from entering ``GuardTuner`` (the load included) to the
end of the first training step that runs under the stance, plus the whole
process (imports included)::

    .venv/bin/python scripts/warm_start_bench.py --repeats 3 --depth 12
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
from torch._dynamo.utils import counters
from guardtrain import GuardTuner
from guardtrain.bench.models import Transformer

path, depth, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = Transformer(depth=depth)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(4, 8, 16)
imported = time.perf_counter()
first_steady = None
with GuardTuner(
    model, "aggressive", compile_kwargs={"backend": "inductor"}, compile_cache=path,
    warmup_steps=3, stable_steps=2, measure_lookup=False, log_metrics=False,
) as tuner:
    for step in range(steps):
        steady = tuner.phase == "steady"
        with tuner.step((x,)):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if steady and first_steady is None:
            first_steady = time.perf_counter() - imported
summary = tuner.summary()
print(json.dumps({
    "first_steady_s": first_steady,
    "process_s": time.perf_counter() - start,
    "import_s": imported - start,
    "compile_cache": summary["compile_cache"],
    "steady_steps": summary["steady_steps"],
    "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
    "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
    "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
    "loss": loss.item(),
}))
"""


def run(kind: str, cache_file: Path, work: Path, depth: int, steps: int) -> dict[str, Any]:
    inductor_dir = Path(tempfile.mkdtemp(prefix=f"inductor-{kind}-", dir=work))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir))
    env.pop("GUARDTRAIN_DISABLE", None)
    wall = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache_file), str(depth), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if out.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["kind"] = kind
    result["wall_s"] = time.perf_counter() - wall
    shutil.rmtree(inductor_dir, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=12, help="transformer blocks (bench: 12)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args(argv)
    import torch

    work = Path(tempfile.mkdtemp(prefix="guardtrain-warm-start-"))
    runs: list[dict[str, Any]] = []
    saved = work / "saved.bin"
    try:
        for i in range(args.repeats):
            cold_file = work / f"cold-{i}.bin"
            runs.append(run("cold", cold_file, work, args.depth, args.steps))
            if not saved.exists():
                shutil.copy(cold_file, saved)
            warm_file = work / f"warm-{i}.bin"
            shutil.copy(saved, warm_file)
            runs.append(run("warm", warm_file, work, args.depth, args.steps))
            for r in runs[-2:]:
                print(json.dumps(r), flush=True)
    finally:
        size = saved.stat().st_size if saved.exists() else 0
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(
        f"\ntorch {torch.__version__}, Transformer(depth={args.depth}), {os.cpu_count()} CPUs, "
        f"median of {args.repeats}; cache file {size / 1e6:.2f} MB"
    )
    print("| start | time to first steady step (s) | process (s) | Inductor FX graphs hit/missed |")
    print("|---|---|---|---|")
    for kind in ("cold", "warm"):
        mine = [r for r in runs if r["kind"] == kind]
        steady = statistics.median(r["first_steady_s"] for r in mine)
        process = statistics.median(r["process_s"] for r in mine)
        print(
            f"| {kind} | {steady:.1f} | {process:.1f} | "
            f"{mine[0]['fxgraph_hit']}/{mine[0]['fxgraph_miss']} |"
        )


if __name__ == "__main__":
    main()
