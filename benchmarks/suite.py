"""The suite's run: workloads one after another, their configurations interleaved.

For each workload every configuration is built (its own model, the same seed), then
each is warmed up with one untimed turn (its compiles happen there), then ``repeats``
rounds: in each round every configuration runs one turn (``settle`` untimed steps,
then ``steps`` timed ones), the order rotating from round to round. Each step is timed
by the calling thread's CPU time and by the wall clock; at one torch thread the CPU
time decides (:func:`clock_of`: other processes' load does not count in it). Reported
per configuration: the median ms per timed step over all rounds, the per-round medians,
and against plain compile the median of the per-round ratios (each round's turns ran
side by side) with their range; for the presets the facts of ``summary()`` that
explain the speed.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import sys
import time
import traceback
import warnings
from typing import Any

import torch

from benchmarks import dpo, gan, litgpt_fabric, loops, rollouts, trl_dpo
from benchmarks.core import PLAIN, Runner, Setting, Turn, Workload, frames, quiet
from guardtrain.bench.timing import clock_of, describe, threads
from guardtrain.errors import GuardTrainValueError
from guardtrain.profiling import compile_seconds

__all__ = [
    "DEFAULT_CONFIGS",
    "SUITE_CONFIGS",
    "WORKLOADS",
    "SuiteOptions",
    "check_suite",
    "format_checks",
    "format_suite",
    "parse_suite_configs",
    "run_suite",
]

SUITE_CONFIGS = ("eager", "compile", "off", "safe", "balanced", "aggressive", "turbo", "auto")
"""The configurations a workload runs, in table order (no ``floor``: it is not sound)."""
DEFAULT_CONFIGS = ("compile", "balanced", "aggressive", "turbo", "auto")
CHECK_LIMIT = 1.00
"""``--check``: the most a preset's ratio of medians to plain compile may be."""

WORKLOADS: dict[str, Workload] = {
    w.name: w for m in (dpo, trl_dpo, gan, loops, rollouts, litgpt_fabric) for w in m.WORKLOADS
}
"""Every workload, in the suite's order."""


@dataclasses.dataclass
class SuiteOptions:
    workloads: list[str]
    configs: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_CONFIGS))
    repeats: int = 4
    steps: int | None = None
    """Timed steps per turn (default: the workload's)."""
    backend: str = "inductor"
    fallback: bool = True
    """Run ``aot_eager`` where a workload says inductor does not fit."""
    tiny: bool = False
    threads: int | None = 1
    progress: bool = True
    compile_optimizer: bool = False
    """The presets with ``compile_optimizer=True``, plain compile with PyTorch's recipe."""


def parse_suite_configs(values: list[str] | None) -> list[str]:
    """``--configs`` for the suite: names from :data:`SUITE_CONFIGS`, in table order.

    Raises:
        GuardTrainValueError: an unknown name or ``floor``.
    """
    if not values:
        return list(DEFAULT_CONFIGS)
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    for name in names:
        if name not in SUITE_CONFIGS:
            raise GuardTrainValueError(
                f"--configs: {name!r} is not a configuration of the workloads; allowed: "
                f"{', '.join(SUITE_CONFIGS)}."
            )
    if not names:
        raise GuardTrainValueError(f"--configs is empty; allowed: {', '.join(SUITE_CONFIGS)}.")
    return [c for c in SUITE_CONFIGS if c in names]


def _progress(options: SuiteOptions, message: str) -> None:
    if options.progress:
        print(f"[workloads] {message}", file=sys.stderr, flush=True)


def run_suite(options: SuiteOptions) -> dict[str, Any]:
    """Run the workloads; returns the results (see :func:`format_suite`)."""
    t0 = time.perf_counter()
    results = []
    with threads(options.threads), quiet():
        for name in options.workloads:
            results.append(_run_workload(WORKLOADS[name], options, clock_of(options.threads)))
    return {
        "suite": "workloads",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "threads": options.threads,
        "clock": clock_of(options.threads),
        "options": dataclasses.asdict(options),
        "workloads": results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _backend(w: Workload, options: SuiteOptions) -> tuple[str, str | None]:
    if options.backend == "inductor" and w.inductor is not None and options.fallback:
        return "aot_eager", f"aot_eager instead of inductor: {w.inductor}"
    return options.backend, None


@dataclasses.dataclass
class _Plan:
    """How one workload runs: its backend and its steps per turn."""

    backend: str
    note: str | None
    steps: int
    settle: int
    warmup: int
    stable: int


def _plan(w: Workload, options: SuiteOptions) -> _Plan:
    backend, note = _backend(w, options)
    steps = options.steps or (w.tiny_steps if options.tiny else w.steps)
    warmup, stable = w.warmup(options.tiny)
    return _Plan(backend, note, steps, w.settle(options.tiny), warmup, stable)


def _header(w: Workload, options: SuiteOptions, plan: _Plan) -> dict[str, Any]:
    """A workload's result before it runs: what it is and how it runs."""
    return {
        "workload": w.name,
        "description": w.description,
        "adapter": w.adapter,
        "plain": w.plain,
        "backend": plan.backend,
        "backend_note": plan.note,
        "settle_steps": plan.settle,
        "timed_steps": plan.steps,
        "repeats": options.repeats,
        "warmup_steps": plan.warmup,
        "stable_steps": plan.stable,
        "calls_per_step": w.calls_per_step,
    }


class _Run:
    """One workload's configurations as runners, and what their turns measured."""

    def __init__(self, w: Workload, options: SuiteOptions, plan: _Plan) -> None:
        self.w, self.options, self.plan = w, options, plan
        self.configs = options.configs
        self.runners: dict[str, Runner] = {}
        self.turns: dict[str, list[Turn]] = {c: [] for c in self.configs}
        self.compiles: dict[str, dict[str, float]] = {
            c: {"warmup": 0, "rounds": 0, "seconds": 0.0} for c in self.configs
        }
        self.warm_s: dict[str, float] = {}

    def build(self) -> None:
        options, plan = self.options, self.plan
        for c in self.configs:
            setting = Setting(
                c, plan.backend, options.tiny, plan.warmup, plan.stable, options.compile_optimizer
            )
            self.runners[c] = self.w.build(setting)

    def warm_up(self) -> None:
        """One untimed turn per configuration (its compiles happen here)."""
        plan = self.plan
        for c in self.configs:
            before, seconds, start = frames(), compile_seconds(), time.perf_counter()
            self.runners[c].turn(plan.settle, min(plan.steps, 8), seed=0)
            self.warm_s[c] = round(time.perf_counter() - start, 2)
            self.compiles[c]["warmup"] = frames() - before
            self.compiles[c]["seconds"] += compile_seconds() - seconds
            message = f"{c} warmed up in {self.warm_s[c]} s ({plan.backend})"
            _progress(self.options, f"{self.w.name}: {message}")

    def rounds(self) -> None:
        """``repeats`` rounds of one turn per configuration, the order rotating."""
        repeats, plan = self.options.repeats, self.plan
        for r in range(repeats):
            k = r % len(self.configs)
            for c in self.configs[k:] + self.configs[:k]:
                before, seconds = frames(), compile_seconds()
                self.turns[c].append(self.runners[c].turn(plan.settle, plan.steps, seed=r + 1))
                self.compiles[c]["rounds"] += frames() - before
                self.compiles[c]["seconds"] += compile_seconds() - seconds
            _progress(self.options, f"{self.w.name}: round {r + 1}/{repeats} done")

    def measure(self) -> list[str]:
        """Build, warm up and run the rounds; returns guardtrain's distinct warnings."""
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            self.build()
            self.warm_up()
            self.rounds()
            return _distinct(str(x.message) for x in seen if "guardtrain" in str(x.filename))

    def notes(self) -> dict[str, list[str]]:
        """Each configuration's notes, with one for a configuration that ran eagerly."""
        for c in self.configs:
            if c != "eager" and not (self.compiles[c]["warmup"] + self.compiles[c]["rounds"]):
                self.runners[c].notes.append(
                    "no Dynamo frame compiled: this configuration ran eagerly"
                )
        return {c: self.runners[c].notes for c in self.configs if self.runners[c].notes}

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()


def _failed(w: Workload, options: SuiteOptions, out: dict[str, Any], err: Exception) -> None:
    """Record the exception being handled in ``out``."""
    out["error"] = f"{type(err).__name__}: {err}"[:2000]
    out["traceback"] = traceback.format_exc()[-4000:]
    _progress(options, f"{w.name}: error {out['error'][:300]}")


def _run_workload(w: Workload, options: SuiteOptions, clock: str) -> dict[str, Any]:
    plan = _plan(w, options)
    out = _header(w, options, plan)
    missing = w.missing()
    if missing is None and options.compile_optimizer and w.framework_step is not None:
        missing = f"not with --compile-optimizer: {w.framework_step}"
    if missing is not None:
        out["skipped"] = missing
        _progress(options, f"{w.name}: skipped ({missing})")
        return out
    torch._dynamo.reset()  # no compiled code of an earlier workload (same classes) is reused
    t0 = time.perf_counter()
    run = _Run(w, options, plan)
    try:
        caught = run.measure()
        summaries = {c: run.runners[c].summary() for c in options.configs}
        notes = run.notes()
    except Exception as err:
        _failed(w, options, out, err)
        return out
    finally:
        run.close()
        torch._dynamo.reset()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["warmup_s"] = run.warm_s
    out["configs"] = _stats(options.configs, run.turns, run.compiles, summaries, clock)
    if notes:
        out["notes"] = notes
    if caught:
        out["warnings"] = caught
    return out


def _distinct(messages: Any, limit: int = 5) -> list[str]:
    found: list[str] = []
    for m in messages:
        m = m[:300]
        if m not in found:
            found.append(m)
    return found[:limit]


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3 if times else float("nan")


def _row(
    turns: list[Turn], compiles: dict[str, float], summary: dict[str, Any] | None, clock: str
) -> dict[str, Any]:
    """One configuration's figures, from its turns: ``median_ms`` and ``round_ms`` by the
    deciding ``clock``, ``wall_ms`` and ``cpu_ms`` (medians) by each."""
    last_loss = turns[-1].losses[-1] if turns and turns[-1].losses else None
    row: dict[str, Any] = {
        **_clocked(turns, clock),
        "timed": sum(len(turn.times) for turn in turns),
        "steady_timed": sum(s for turn in turns for s in turn.steady),
        "dynamo_compiles": {
            "warmup": int(compiles["warmup"]),
            "rounds": int(compiles["rounds"]),
            "seconds": round(compiles["seconds"], 2),
        },
        "last_loss": last_loss,
        "steps_per_turn": [len(turn.losses) for turn in turns],
    }
    row["loss_finite"] = last_loss is not None and bool(torch.isfinite(torch.tensor(last_loss)))
    if summary is not None:
        row["summary"] = facts(summary)
    return row


def _clocked(turns: list[Turn], clock: str) -> dict[str, Any]:
    """The medians of a configuration's turns: by the deciding ``clock`` over all timed steps
    (``median_ms``) and per round (``round_ms``); by each clock (``wall_ms``, ``cpu_ms``)."""
    measured = [turn.cpu if clock == "cpu" else turn.times for turn in turns]
    return {
        "median_ms": round(_median_ms([t for ts in measured for t in ts]), 3),
        "round_ms": [round(_median_ms(ts), 3) for ts in measured],
        "wall_ms": round(_median_ms([t for turn in turns for t in turn.times]), 3),
        "cpu_ms": round(_median_ms([t for turn in turns for t in turn.cpu]), 3),
    }


def _compare(row: dict[str, Any], plain: dict[str, Any]) -> None:
    """Add to ``row`` its ratios to plain compile's row: per round (the configurations'
    turns of one round ran side by side), and their median, which decides."""
    per_round = [a / b for a, b in zip(row["round_ms"], plain["round_ms"]) if b]
    row["ratio_rounds"] = [round(x, 3) for x in per_round]
    row["ratio"] = round(statistics.median(per_round), 3) if per_round else None
    row["ratio_min"] = round(min(per_round), 3) if per_round else None
    row["ratio_max"] = round(max(per_round), 3) if per_round else None
    row["ratio_wall"] = round(row["wall_ms"] / plain["wall_ms"], 3) if plain["wall_ms"] else None


def _stats(
    configs: list[str],
    turns: dict[str, list[Turn]],
    compiles: dict[str, dict[str, float]],
    summaries: dict[str, dict[str, Any] | None],
    clock: str,
) -> dict[str, Any]:
    rows = {c: _row(turns[c], compiles[c], summaries.get(c), clock) for c in configs}
    if PLAIN in rows:
        for c in configs:
            if c != PLAIN:
                _compare(rows[c], rows[PLAIN])
                rows[c]["losses_vs_plain"] = _loss_diff(turns[c], turns[PLAIN])
    return rows


def _loss_diff(got: list[Turn], plain: list[Turn]) -> dict[str, Any]:
    """Every step's loss against plain compile's, turn by turn (the same data, seeds and
    steps): ``equal`` (bitwise), else the largest absolute difference."""
    diffs = [
        abs(a - b)
        for g, p in zip(got, plain)
        for a, b in zip(g.losses, p.losses)
        if not (math.isnan(a) or math.isnan(b))
    ]
    same_count = all(len(g.losses) == len(p.losses) for g, p in zip(got, plain))
    worst = max(diffs) if diffs else None
    return {"equal": same_count and worst == 0.0, "max_abs_diff": worst, "compared": len(diffs)}


def facts(s: dict[str, Any]) -> dict[str, Any]:
    """What explains a preset's speed, from its ``summary()`` (all runs of the workload)."""
    reasons: list[str] = []
    for r in s["rearms"]:
        reason = str(r.get("reason", ""))[:160]
        if reason not in reasons:
            reasons.append(reason)
    return {
        "phase": s["phase"],
        "compiles": s["compiles"],
        "compiles_by_target": dict(s["compiles_by_target"]),
        "compiled_again": sum(s["compiled_again"].values()),
        "steady_steps": s["steady_steps"],
        "warmup_steps_taken": s["warmup_steps_taken"],
        "rearms": len(s["rearms"]),
        "rearm_reasons": reasons[:3],
        "full_guard_calls": s["full_guard_calls"],
        "decode_calls": dict(s["decode_calls"]),
        "direct_calls": s["direct_dispatch"]["calls"],
        "direct_refused": s["direct_dispatch"]["refused"],
        "caught_changes": {k: v.get("count", 0) for k, v in s["caught_changes"].items()},
        "stance_blocked": s["stance_blocked"],
        "graph_breaks": len(s["graph_breaks"]),
        "targets": s["targets"][:6],
    }


# -- the report ----------------------------------------------------------------------------------

HEADER = (
    "workload",
    "backend",
    "config",
    "ms/step",
    "/compile [rounds]",
    "steady",
    "compiles",
    "compile s",
    "rearms",
    "full-guard",
    "direct",
    "caught changes",
    "losses",
)


def _ratio(row: dict[str, Any]) -> str:
    if row.get("ratio") is None:
        return "-"
    if row.get("ratio_min") is None:
        return f"{row['ratio']:.2f}"
    return f"{row['ratio']:.2f} [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]"


def _losses(row: dict[str, Any]) -> str:
    d = row.get("losses_vs_plain")
    if d is None:
        return "-"
    if d["equal"]:
        return "= plain"
    return "-" if d["max_abs_diff"] is None else f"±{d['max_abs_diff']:.1e}"


def _cells(w: dict[str, Any], c: str, row: dict[str, Any]) -> list[str]:
    s = row.get("summary")
    dyn = row["dynamo_compiles"]
    if s is None:
        steady, counts = "-", ["-", "-", "-", "-"]
    else:
        caught = ", ".join(f"{k} {v}" for k, v in s["caught_changes"].items()) or "-"
        steady = f"{row['steady_timed']}/{row['timed']}"
        counts = [str(s[k]) for k in ("rearms", "full_guard_calls", "direct_calls")] + [caught]
    head = [w["workload"], w["backend"], c, f"{row['median_ms']:.2f}", _ratio(row), steady]
    seconds = f"{dyn.get('seconds', 0.0):.1f}"
    return [*head, f"{dyn['warmup']}+{dyn['rounds']}", seconds, *counts, _losses(row)]


def _not_run(w: dict[str, Any]) -> str | None:
    """The note on a workload that was skipped or raised, else None."""
    if "skipped" in w:
        return f"{w['workload']}: skipped: {w['skipped']}"
    if "error" in w:
        return f"{w['workload']}: error: {w['error'][:400]}"
    return None


def _workload_notes(w: dict[str, Any]) -> list[str]:
    """The notes on a workload that ran: its backend, each first re-arm, the runners'."""
    notes: list[str] = []
    if w.get("backend_note"):
        notes.append(f"{w['workload']}: {w['backend_note']}")
    for c, row in w["configs"].items():
        s = row.get("summary")
        if s and s["rearm_reasons"]:
            notes.append(f"{w['workload']} {c}: first re-arm: {s['rearm_reasons'][0]}")
    for c, ns in w.get("notes", {}).items():
        notes.extend(f"{w['workload']} {c}: {n}" for n in ns)
    return notes


def _aligned(rows: list[list[str]]) -> list[str]:
    """The rows as lines, columns padded, a rule under the first (the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * n for n in widths))
    return lines


def format_suite(data: dict[str, Any]) -> str:
    """The results as a table, then one line per workload note (backend, errors, skips)."""
    rows = [list(HEADER)]
    notes: list[str] = []
    for w in data["workloads"]:
        problem = _not_run(w)
        if problem is not None:
            notes.append(problem)
            continue
        rows.extend(_cells(w, c, row) for c, row in w["configs"].items())
        notes.extend(_workload_notes(w))
    clock = describe(data.get("clock", "wall"))
    head = (
        f"torch {data['torch']}, {data['threads'] or 'default'} thread(s), {data['date']}; "
        f"timed by {clock}; ms/step: median over all timed steps; /compile: median of the "
        "per-round ratios to plain compile [min-max]; steady: timed steps guardtrain ran "
        "steady; compiles: Dynamo frames compiled in warm-up + rounds; compile s: torch's "
        "compile seconds (frames and backward graphs) in them"
    )
    return "\n".join([head, "", *_aligned(rows), *([""] if notes else []), *notes])


def check_suite(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One verdict per workload and preset: met when its ratio of medians to plain compile
    is at most :data:`CHECK_LIMIT`; a workload that raised is one verdict, not met."""
    verdicts: list[dict[str, Any]] = []
    for w in data["workloads"]:
        if "error" in w:
            verdicts.append(
                {"workload": w["workload"], "config": None, "ratio": None, "met": False}
            )
            continue
        for c, row in w.get("configs", {}).items():
            if row.get("ratio") is None or c == "eager":
                continue
            verdicts.append(
                {
                    "workload": w["workload"],
                    "config": c,
                    "ratio": row["ratio"],
                    "range": [row["ratio_min"], row["ratio_max"]],
                    "met": row["ratio"] <= CHECK_LIMIT,
                }
            )
    return verdicts


def format_checks(verdicts: list[dict[str, Any]]) -> str:
    lines = []
    for v in verdicts:
        if v["config"] is None:
            lines.append(f"{v['workload']}: NOT met (the workload raised)")
            continue
        lo, hi = v["range"]
        span = "" if lo is None else f" [{lo:.3f}-{hi:.3f}]"
        verdict = "met" if v["met"] else "NOT met"
        lines.append(
            f"{v['workload']} {v['config']}: {v['ratio']:.3f}{span} x plain compile, "
            f"limit {CHECK_LIMIT:.2f}: {verdict}"
        )
    if not lines:
        lines.append("no workload could be checked (a plain `compile` configuration is needed)")
    return "\n".join(lines)
