"""The end-of-run summary table, and the run's one line at setup (what ``auto`` chose where
it is not turbo, recursive dict tags turned off).

Each is a pure function of :func:`~guardtrain.engine.summary.build`'s dict (or the run's
levers), logged at INFO on rank zero.
"""

from __future__ import annotations

from typing import Any

from guardtrain.engine import warmstart
from guardtrain.engine.levers import Levers

__all__ = ["auto_note", "format_summary", "setup_line"]


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
        f"  compiles         {_compiles(s)}",
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
    lines += _step_lines(s)
    lines += _direct_lines(s.get("direct_dispatch") or {})
    lines += _optimizer_lines(s.get("optimizers") or [])
    lines += _code_lines(s)
    lines += _state_lines(s)
    return "\n".join(lines)


def _compiles(s: dict[str, Any]) -> str:
    """The frame compiles (each a cache entry), per target where there are several,
    Dynamo's own count of graphs, the compiles that guardtrain's rebuilds made again (its
    margin over plain compile), and torch's compile seconds."""
    text = f"{s['compiles']} frames"
    if len(per := s["compiles_by_target"]) > 1:
        text += " (" + ", ".join(f"{name} {n}" for name, n in per.items()) + ")"
    text += f", {s['graphs']} graphs by Dynamo's count (in the whole process)"
    if again := sum(s["compiled_again"].values()):
        text += f"; {again} compiled again after changes"
    return text + f"; {s['compile_seconds']:.1f} s compiling"


def _step_lines(s: dict[str, Any]) -> list[str]:
    """The bottom line: the steady step, the saving and its share; what ``auto`` chose."""
    lines = []
    auto = s.get("auto")
    if auto:
        lines.append(f"  auto chose       {auto['chose']} ({auto['why']})")
    step = s["step"]
    if step["median_us"] is not None:
        text = (
            f"  step (steady)    {step['median_us'] / 1e3:.2f} ms median of {step['steady_steps']}"
        )
        if step.get("saved_us") is not None:
            profiled = step.get("guards_share") is not None
            text += (
                f"; guardtrain saved {'' if profiled else 'about '}{step['saved_us']:.1f} "
                f"µs/step ({100 * step['saved_share']:.1f}% of the step with full guards"
            )
            if profiled:
                text += f"), guards take {100 * step['guards_share']:.1f}% of it"
            else:
                text += ", from the guard checks timed in the run)"
        else:
            text += f"; the run's own saving {step['why']}"
        lines.append(text)
    if not (s.get("levers") or {}).get("use_stance"):
        counted = "  counted          every call with full guards (the stance is off)"
    else:
        counted = (
            f"  counted          steady calls: {step.get('full_guard_calls', 0)} with full guards"
        )
        if (s.get("direct_dispatch") or {}).get("on"):
            counted += f", {step.get('direct_calls', 0)} dispatched directly"
        counted += ", the others under the stance"
        if step.get("generate_calls_served"):
            counted += f" ({step['generate_calls_served']} of generate() served)"
    counted += f"; a call with full guards evaluates {step.get('guards_per_call', 0)} guards"
    if step.get("bench_guard_share") is not None:
        counted += (
            f"; the bench measured {s['preset']}'s guard and pre-graph time per call at "
            f"{100 * step['bench_guard_share']:.1f}% of plain compile's (docs/bench.md)"
        )
    lines.append(counted)
    return lines


def _direct_lines(direct: dict[str, Any]) -> list[str]:
    """The table's lines on direct dispatch (turbo), when it was asked for."""
    if not direct.get("requested"):
        return []
    if direct.get("on"):
        lines = [
            f"  direct dispatch  on: {direct.get('calls', 0)} calls ran a harvested entry "
            "directly (their own checks, a few µs a call, are not in the profiled guard µs)"
        ]
    else:
        lines = [f"  direct dispatch  refused: {direct.get('refused')}"]
    for t in direct.get("refused_targets", []):
        lines.append(f"    not for {t['target']}: {t['why']}")
    return lines


def _optimizer_lines(optimizers: list[dict[str, Any]]) -> list[str]:
    """The table's lines on compiled optimizer steps (``compile_optimizer=True``)."""
    lines = []
    for i, o in enumerate(optimizers):
        if o["eager"]:
            lines.append(f"  optimizer {i}      {o['optimizer']}: uncompiled ({o['eager']})")
            continue
        changed = ", ".join(f"{k} {n}" for k, n in o["changes"].items()) or "none"
        lines.append(
            f"  optimizer {i}      {o['optimizer']}: {o['direct_steps']} steps direct, "
            f"{o['full_guard_steps']} with full guards, {o['compiles']} compiles; "
            f"changes: {changed}"
        )
    return lines


def _code_lines(s: dict[str, Any]) -> list[str]:
    """The table's lines on graph breaks, shared code and targets compiled alone."""
    lines = []
    for b in s.get("graph_breaks", []):
        where = f" at {b['where']}" if b.get("where") else ""
        lines.append(
            f"  graph break      {b['target']}: {b['reason']}{where}; "
            f"compiled its parts {', '.join(b['regions'])}"
        )
    for m in s.get("mixed_targets", []):
        lines.append(f"  graph break      {m['target']}: {m['reason']}; kept whole: {m['answer']}")
    for group in s.get("shared_code", []):
        names = group["targets"]
        lines.append(
            f"  shared code      {len(names)} {group['class']} targets: {names[0]} ... {names[-1]}"
        )
    for own in s.get("own_code", []):
        lines.append(f"  own code         {own['target']}: {own['why']}")
    return lines


def _state_lines(s: dict[str, Any]) -> list[str]:
    """The table's lines on levers switched off, take-overs, idle targets, the cache."""
    lines = [f"  switched off     {off['lever']}: {off['why']}" for off in s["switched_off"]]
    if s.get("took_over"):
        lines.append(f"  took over        {', '.join(s['took_over'])}")
    if s["uncompiled_targets"]:
        lines.append(f"  ran uncompiled   {', '.join(s['uncompiled_targets'])}")
    if s["stance_blocked"]:
        lines.append(f"  stance blocked   {s['stance_blocked']}")
    if s.get("compile_cache"):
        lines.append(f"  compile cache    {warmstart.describe(s['compile_cache'])}")
    return lines


def auto_note(levers: Levers) -> str | None:
    """What the ``auto`` preset chose, for the setup line, where it is not turbo's direct
    dispatch (its usual choice, said in the summary); None then."""
    if not levers.use_stance:
        return "preset auto: the stance is off in this run"
    if not levers.direct_dispatch:
        return (
            "preset auto chose aggressive's stance: direct dispatch (turbo) is refused: "
            f"{levers.direct_refused}"
        )
    return None


def setup_line(notes: list[str | None]) -> str | None:
    """The run's one line at setup: its ``notes`` that are set, or None when none is.

    >>> setup_line([None, "preset auto: the stance is off in this run"])
    'guardtrain: preset auto: the stance is off in this run.'
    >>> setup_line([None, None]) is None
    True
    """
    said = [note for note in notes if note]
    return f"guardtrain: {'; '.join(said)}." if said else None
