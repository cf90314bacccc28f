"""Compare two checkouts of guardtrain on the bench, alternating runs.

    python scripts/ab_bench.py BASELINE_TREE CHANGED_TREE [--pairs 3] [--json PATH]

For each pair, the baseline tree runs first, then the changed tree, each in its
own process (``python -m guardtrain.bench`` with the tree first on ``PYTHONPATH``):

* ``--quick --configs compile,aggressive,turbo,floor``: the paired
  ``call_vs_floor`` ratio of ``aggressive`` and ``turbo`` on the transformer;
* ``--callback-cost --preset aggressive``: the hooks' and ``GuardTuner.step``'s
  µs per step in the steady state.

Alternating puts both trees under the same drift of machine load. The table
gives the median over the pairs of each tree and the difference
(changed - baseline). Both trees must have the same bench command line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

QUICK = ["--quick", "--configs", "compile,aggressive,turbo,floor", "--no-progress"]
COST = ["--callback-cost", "--preset", "aggressive"]
RATIO_CONFIGS = ("aggressive", "turbo")


def _run(tree: Path, args: list[str], python: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(
            [python, "-m", "guardtrain.bench", *args, "--json", str(out)],
            cwd=tree,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=1800,
        )
        return json.loads(out.read_text())


def _measure(tree: Path, python: str) -> dict[str, float]:
    row: dict[str, float] = {}
    quick = _run(tree, QUICK, python)
    for r in quick["results"]:
        if r["config"] in RATIO_CONFIGS:
            row[f"{r['config']} call/floor"] = r["ratios"]["call_vs_floor"]
    cost = _run(tree, COST, python)
    for name, us in cost["us_per_step"].items():
        row[f"{name} µs"] = us
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("baseline", type=Path)
    p.add_argument("changed", type=Path)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args()
    if args.pairs < 1:
        p.error(f"--pairs must be at least 1, got {args.pairs}")
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "changed": []}
    for i in range(args.pairs):
        for side in ("baseline", "changed"):
            runs[side].append(_measure(getattr(args, side).resolve(), args.python))
            print(f"pair {i + 1}/{args.pairs} {side}: {runs[side][-1]}", flush=True)
    keys = list(runs["baseline"][0])
    print("\n| measure | baseline (median) | changed (median) | changed - baseline |")
    print("|---|---|---|---|")
    for key in keys:
        base = statistics.median(r[key] for r in runs["baseline"])
        new = statistics.median(r[key] for r in runs["changed"])
        print(f"| {key} | {base:.3f} | {new:.3f} | {new - base:+.3f} |")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
