"""The run's report: ``summary()``, ``state_dict()``, the summary table and ``guard/*`` metrics.

:func:`build` reads a run's parts (:class:`~guardtrain.engine.run.Run`) into a plain dict
(``str``, ``int``, ``float``, lists and dicts of those), so checkpoints holding
its values load with ``torch.load(weights_only=True)``. Everything else here is
a pure function of that dict, or a small record of what was logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from guardtrain.compile import CompiledTarget
from guardtrain.engine import warmstart
from guardtrain.engine.host import Host
from guardtrain.engine.levers import Levers
from guardtrain.engine.phases import PHASE_NUMBERS
from guardtrain.engine.run import Run
from guardtrain.engine.steps import bottom_line
from guardtrain.engine.targets import TargetSet, label

__all__ = [
    "MetricsLog",
    "auto_line",
    "build",
    "carried",
    "format_summary",
    "gather_rearms",
    "loaded",
    "metrics",
    "state_dict",
]

_CARRIED = ("compiles", "rearms", "warmup_steps_taken", "steady_steps")
"""Counters that a later run, or a restored checkpoint, goes on from."""


def build(e: Run, phase: str, compile_cache: dict[str, Any] | None) -> dict[str, Any]:
    """Counters and history of the runs so far, as a plain dict (``summary()``): the run's
    parts, the training loop's ``phase`` as the engine reports it, the warm start."""
    r, m, run, ts = e.restored, e.machine, e.state, e.targets
    root = e.host.root_label
    lookup = e.lookup.lookup or r.get("lookup_us", {})
    return {
        "preset": e.config.preset,
        "phase": phase,
        "phases": {str(loop): str(m.phase(loop)) for loop in m.loops},
        "compiles": e.monitor.compiles + r.get("compiles", 0),
        "rearms": list(r.get("rearms", []))
        + list(m.rearms if run.all_rearms is None else run.all_rearms),
        "warmup_steps_taken": m.warmup_steps_taken + r.get("warmup_steps_taken", 0),
        "steady_steps": m.steady_steps + r.get("steady_steps", 0),
        "targets": list(ts.names),
        "compile_events": (list(r.get("compile_events", [])) + e.monitor.events)[:100],
        "levers": {
            "recursive_dict_tags": e.levers.recursive_dict_tags,
            "install_free_tensors": e.levers.install_free_tensors,
            "guard_filter": e.config.filter_name,
            "soundness_floor": not e.config.unsafe_drop_floor,
            "use_stance": e.levers.use_stance,
        },
        "switched_off": list(e.levers.switched_off),
        "stance_blocked": m.blocked,
        "uncompiled_targets": list(run.uncompiled),
        "lookup_us": dict(lookup),
        "lookup_calls": dict(e.lookup.lookup_calls or r.get("lookup_calls", {})),
        "took_over": list(ts.adapter_took_over) + list(ts.took_over),
        "shared_code": _shared_code(ts.kept, root),
        "own_code": [{"target": label(t, root), "why": t.own_code} for t in ts.kept if t.own_code],
        "direct_dispatch": _direct(e),
        "auto": _auto(e),
        "step": bottom_line(e.steps, lookup, e.levers.direct_dispatch),
        "caught_changes": _caught(e),
        "state_swaps": ts.swaps + sum(t.kept.swaps for t in ts.kept),
        "full_guard_targets": [dict(h) for h in e.ledger.handed_over],
        "full_guard_calls": ts.full_guard_calls + sum(t.full_guard_calls for t in ts.kept),
        "decode_calls": _decode(e),
        "checked_batches": e.checks.checked_batches + r.get("checked_batches", 0),
        "checked_calls": e.checks.checked_calls + r.get("checked_calls", 0),
        "graph_breaks": [dict(b) for b in ts.graph_breaks],
        "disabled": e.config.disabled,
        "compile_cache": warmstart.summary(compile_cache),
        "optimizers": e.optimizers.summary(),
    }


def _caught(e: Run) -> dict[str, dict[str, Any]]:
    """Changes caught before a call by kind; a ``requires_grad`` flip back to a known state
    (H46) counts as one, as when it was checked."""
    caught = e.state.caught.summary()
    swaps = e.targets.grad_swaps + sum(t.kept.grad_swaps for t in e.targets.kept)
    if swaps:
        row = caught.setdefault(
            "requires_grad", {"count": 0, "first": "a flip back to a known state"}
        )
        row["count"] += swaps
    return caught


def gather_rearms(run: Run) -> None:
    """With several processes, collect every rank's re-arms for rank zero's summary."""
    if not run.machine.collective or run.config.disabled:
        return
    gathered = run.host.agreement.gather(list(run.machine.rearms))
    merged = [x for rearms in gathered for x in (rearms or [])]
    run.state.all_rearms = sorted(merged, key=lambda x: (x["step"], x.get("rank", 0)))


def _direct(e: Run) -> dict[str, Any]:
    """Direct dispatch (turbo): whether it is on, why not, and how many calls used it."""
    ts, root = e.targets, e.host.root_label
    refusals = _direct_refusals(ts, root) if e.levers.direct_dispatch else []
    return {
        "requested": e.config.levers.direct_dispatch,
        "on": e.levers.direct_dispatch
        and not _every_target_refused([label(t, root) for t in ts.kept], refusals),
        "refused": e.levers.direct_refused,
        "refused_targets": refusals,
        "calls": ts.direct_calls
        + sum(t.direct_calls for t in ts.kept)
        + e.restored.get("direct_calls", 0),
    }


def _decode(e: Run) -> dict[str, int]:
    """The calls that carried a transformers cache (``generate()``'s prefill and decode
    calls, H53): ``served`` under the stance or directly, and with ``full_guards`` (in
    warm-up, in audits, or where no entry's check let them through)."""
    ts, restored = e.targets, e.restored.get("decode_calls", {})
    return {
        "served": ts.decode_calls
        + sum(t.decode_calls for t in ts.kept)
        + restored.get("served", 0),
        "full_guards": ts.decode_full_guards
        + sum(t.decode_full_guards for t in ts.kept)
        + restored.get("full_guards", 0),
    }


def _auto(e: Run) -> dict[str, Any] | None:
    """What the ``auto`` preset chose: turbo's direct dispatch, or aggressive's stance (the
    run, or some targets), and why; None under a named preset."""
    if e.config.preset != "auto":
        return None
    direct = _direct(e)
    if not e.levers.use_stance:
        return {"chose": "off", "why": "the stance is off in this run", "targets": {}}
    refused = {t["target"]: t["why"] for t in direct["refused_targets"]}
    if not direct["on"]:
        why = direct["refused"] or "; ".join(sorted(set(refused.values())))
        return {"chose": "aggressive", "why": why, "targets": refused}
    if refused:
        return {
            "chose": "turbo, aggressive for some targets",
            "why": "their direct dispatch is refused",
            "targets": refused,
        }
    return {"chose": "turbo", "why": "direct dispatch is refused nowhere", "targets": {}}


def _direct_refusals(ts: TargetSet, root: str) -> list[dict[str, str]]:
    """Targets that may not run directly: refused at activation (FSDP's
    ``fully_shard``), or with graph breaks (their resume frames would run eagerly;
    they keep every guard and never use the stance)."""
    found = list(ts.direct_refused_targets)
    named = {t["target"] for t in found}
    for t in ts.kept:
        if t.graph_breaks and label(t, root) not in named:
            found.append(
                {
                    "target": label(t, root),
                    "why": "graph breaks: the frames after a break would run eagerly",
                }
            )
    return found


def _every_target_refused(targets: list[str], refusals: list[dict[str, str]]) -> bool:
    """Whether direct dispatch refused each of ``targets`` (so no call can run directly)."""
    refused = {r["target"] for r in refusals}
    return bool(targets) and all(t in refused for t in targets)


def _shared_code(kept: list[CompiledTarget], root: str) -> list[dict[str, Any]]:
    """Groups of targets that share one compiled code object (H24)."""
    groups: dict[int, list[CompiledTarget]] = {}
    for t in kept:
        if t.code.shared:
            groups.setdefault(id(t.code), []).append(t)
    return [
        {"class": type(g[0].module).__name__, "targets": [label(t, root) for t in g]}
        for g in groups.values()
        if len(g) > 1
    ]


# -- checkpoints and later runs ------------------------------------------------------------


def state_dict(s: dict[str, Any], train_batches: int) -> dict[str, Any]:
    """What a checkpoint keeps of summary ``s`` (see :func:`loaded`)."""
    return {"preset": s["preset"], **{k: s[k] for k in _CARRIED}, "train_batches": train_batches}


def loaded(state: dict[str, Any]) -> dict[str, Any]:
    """The counters that a run restored from the checkpoint ``state`` goes on from."""
    return {
        "compiles": int(state.get("compiles", 0)),
        "rearms": list(state.get("rearms", [])),
        "warmup_steps_taken": int(state.get("warmup_steps_taken", 0)),
        "steady_steps": int(state.get("steady_steps", 0)),
        "train_batches": int(state.get("train_batches", 0)),
    }


def carried(s: dict[str, Any], train_batches: int) -> dict[str, Any]:
    """What the next run of the same engine goes on from, after summary ``s``."""
    restored = {key: s[key] for key in _CARRIED}
    restored.update(
        train_batches=train_batches,
        lookup_us=s["lookup_us"],
        lookup_calls=s["lookup_calls"],
        compile_events=s["compile_events"],
        checked_batches=s["checked_batches"],
        checked_calls=s["checked_calls"],
        direct_calls=s["direct_dispatch"]["calls"],
        decode_calls=s["decode_calls"],
    )
    return restored


# -- metrics -------------------------------------------------------------------------------


def metrics(phase: str, compiles: int, rearms: int) -> dict[str, float]:
    """The ``guard/*`` metrics: phase number (0 off, 1 warm-up, 2 steady), counts."""
    return {
        "guard/phase": float(PHASE_NUMBERS[phase]),
        "guard/compiles": float(compiles),
        "guard/rearms": float(rearms),
    }


@dataclass(slots=True)
class MetricsLog:
    """What one run last gave the loggers: each value is logged when it moves."""

    logged: tuple[int, int, int] | None = None
    lookup_logged: bool = False

    def log(
        self,
        host: Host,
        current: tuple[str, int, int],
        lookup: dict[str, float],
        step: Callable[[], int],
    ) -> None:
        """Log ``(phase, compiles, rearms)`` and the steady lookup time, if either moved.

        Rank zero only; ``step`` gives the training step the values belong to.
        """
        key = (PHASE_NUMBERS[current[0]], current[1], current[2])
        if key == self.logged and ("steady" not in lookup or self.lookup_logged):
            return
        self.logged = key
        if host.agreement.rank != 0:
            return
        values = metrics(*current)
        if "steady" in lookup and not self.lookup_logged:
            self.lookup_logged = True
            values["guard/lookup_us"] = lookup["steady"]
        if host.log_metrics is not None:
            host.log_metrics(values, step())


# -- the table -----------------------------------------------------------------------------


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
    lines += _step_lines(s)
    lines += _direct_lines(s.get("direct_dispatch") or {})
    lines += _optimizer_lines(s.get("optimizers") or [])
    lines += _code_lines(s)
    lines += _state_lines(s)
    return "\n".join(lines)


def _step_lines(s: dict[str, Any]) -> list[str]:
    """The bottom line: the steady step, the saving and its share; what ``auto`` chose."""
    lines = []
    auto = s.get("auto")
    if auto:
        lines.append(f"  auto chose       {auto['chose']} ({auto['why']})")
    step = s.get("step") or {}
    if step.get("median_us") is None:
        return lines
    text = f"  step (steady)    {step['median_us'] / 1e3:.2f} ms median of {step['steady_steps']}"
    if step.get("saved_us") is not None:
        text += (
            f"; guardtrain saved {step['saved_us']:.1f} µs/step "
            f"({100 * step['saved_share']:.1f}% of the step with full guards), "
            f"guards take {100 * step['guards_share']:.1f}% of it"
        )
    else:
        text += f"; saving {step['why']}"
    lines.append(text)
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


def auto_line(levers: Levers) -> str:
    """The one line at setup that says what the ``auto`` preset chose, and why."""
    if not levers.use_stance:
        return "guardtrain: preset auto: the stance is off in this run."
    if not levers.direct_dispatch:
        return (
            f"guardtrain: preset auto chose aggressive's stance: direct dispatch (turbo) is "
            f"refused: {levers.direct_refused}."
        )
    return (
        "guardtrain: preset auto chose turbo's direct dispatch; a target refused it (graph "
        "breaks, FSDP's fully_shard) runs under aggressive's stance, as summary()['auto'] "
        "lists."
    )
