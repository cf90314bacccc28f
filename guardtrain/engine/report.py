"""The run's report: the summary table and the ``guard/*`` metrics, from a summary dict.

Pure functions of :meth:`GuardEngine.summary`'s plain dict (``str``, ``int``,
``float``, lists and dicts of those), so checkpoints holding its values load
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import Any

from guardtrain.engine import warmstart
from guardtrain.engine.phases import PHASE_NUMBERS

__all__ = ["format_summary", "metrics"]


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run table logged at INFO on rank zero."""
    lines = [
        "guardtrain summary",
        f"  preset           {s['preset']}",
        f"  targets          {', '.join(s['targets']) or '-'}",
        f"  phase            {s['phase']}  (loops: "
        + ", ".join(f"{k}={v}" for k, v in s["phases"].items())
        + ")",
        f"  warm-up steps    {s['warmup_steps_taken']}",
        f"  steady steps     {s['steady_steps']}",
        f"  compiles         {s['compiles']}",
        f"  re-arms          {len(s['rearms'])}",
    ]
    if s.get("checked_batches"):
        lines.insert(
            -2,
            f"  checked batches  {s['checked_batches']}  (unseen signatures kept under the "
            f"stance: {s.get('checked_calls', 0)} calls accepted by an entry's guards)",
        )
    for r in s["rearms"][:10]:
        lines.append(f"    step {r['step']}: {r['reason']}")
    if len(s["rearms"]) > 10:
        lines.append(f"    ... {len(s['rearms']) - 10} more")
    lookup = s["lookup_us"]
    if "steady" in lookup:
        lines.append(
            f"  guards µs/step   {lookup.get('full_guards', float('nan')):.1f} with full guards, "
            f"{lookup['steady']:.1f} under the stance (guard + pre-graph, profiled)"
        )
    lines += _direct_dispatch(s.get("direct_dispatch") or {})
    lines += _targets_and_levers(s)
    return "\n".join(lines)


def _direct_dispatch(direct: dict[str, Any]) -> list[str]:
    """The direct-dispatch lines: on with its calls, or refused with why."""
    if not direct.get("requested"):
        return []
    if direct.get("on"):
        lines = [
            f"  direct dispatch  on: {direct.get('calls', 0)} calls ran a harvested entry "
            "directly (guard µs/step not profiled: those calls skip Dynamo's entry path)"
        ]
    else:
        lines = [f"  direct dispatch  refused: {direct.get('refused')}"]
    for t in direct.get("refused_targets", []):
        lines.append(f"    not for {t['target']}: {t['why']}")
    return lines


def _targets_and_levers(s: dict[str, Any]) -> list[str]:
    """Graph breaks, shared and own code, levers switched off, and the rest of the table."""
    lines = []
    for b in s.get("graph_breaks", []):
        where = f" at {b['where']}" if b.get("where") else ""
        lines.append(
            f"  graph break      {b['target']}: {b['reason']}{where}; "
            f"compiled its parts {', '.join(b['regions'])}"
        )
    for group in s.get("shared_code", []):
        names = group["targets"]
        lines.append(
            f"  shared code      {len(names)} {group['class']} targets: {names[0]} ... {names[-1]}"
        )
    for own in s.get("own_code", []):
        lines.append(f"  own code         {own['target']}: {own['why']}")
    for off in s["switched_off"]:
        lines.append(f"  switched off     {off['lever']}: {off['why']}")
    if s.get("took_over"):
        lines.append(f"  took over        {', '.join(s['took_over'])}")
    if s["uncompiled_targets"]:
        lines.append(f"  ran uncompiled   {', '.join(s['uncompiled_targets'])}")
    if s["stance_blocked"]:
        lines.append(f"  stance blocked   {s['stance_blocked']}")
    if s.get("compile_cache"):
        lines.append(f"  compile cache    {warmstart.describe(s['compile_cache'])}")
    return lines


def metrics(phase: str, compiles: int, rearms: int) -> dict[str, float]:
    """The ``guard/*`` metrics: phase number (0 off, 1 warm-up, 2 steady), counts."""
    return {
        "guard/phase": float(PHASE_NUMBERS[phase]),
        "guard/compiles": float(compiles),
        "guard/rearms": float(rearms),
    }
