"""The run's report, ``summary()``: :func:`build` reads a run's parts into a plain dict.

The dict holds ``str``, ``int``, ``float`` and lists and dicts of those, so checkpoints
holding its values load with ``torch.load(weights_only=True)``
(:mod:`guardtrain.engine.checkpoint`); the table (:mod:`guardtrain.engine.table`) and the
``guard/*`` metrics (:mod:`guardtrain.engine.metrics`) are read from it.
"""

from __future__ import annotations

import statistics
from typing import Any

from guardtrain.compile import CompiledTarget
from guardtrain.engine import warmstart
from guardtrain.engine.run import Run
from guardtrain.engine.steps import bottom_line
from guardtrain.engine.targets import TargetSet, label
from guardtrain.presets import AUTO, BENCH_GUARD_SHARE

__all__ = ["build", "gather_rearms"]


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
        "compiles_by_target": _added(r.get("compiles_by_target", {}), e.monitor.by_target),
        "compiled_again": _added(r.get("compiled_again", {}), e.ledger.spent),
        "compile_seconds": round(r.get("compile_seconds", 0.0) + e.monitor.run_seconds(), 3),
        "graphs": r.get("graphs", 0) + e.monitor.run_graphs(),
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
        "step": bottom_line(
            e.steps, lookup, e.levers.direct_dispatch, _counts(e), _guard_estimate(e)
        ),
        "caught_changes": _caught(e),
        "state_swaps": ts.counts.swaps + r.get("state_swaps", 0),
        "full_guard_targets": [dict(h) for h in e.ledger.handed_over],
        "full_guard_calls": _full_guard_calls(e),
        "decode_calls": _decode(e),
        "checked_batches": e.checks.checked_batches + r.get("checked_batches", 0),
        "checked_calls": e.checks.checked_calls + r.get("checked_calls", 0),
        "graph_breaks": [dict(b) for b in ts.graph_breaks],
        "mixed_targets": [dict(m) for m in ts.mixed],
        "disabled": e.config.disabled,
        "compile_cache": warmstart.summary(compile_cache),
        "optimizers": e.optimizers.summary(),
    }


def _counts(e: Run) -> dict[str, Any]:
    """The bottom line from counters, on every run: the steady state's calls dispatched
    directly (turbo) and with full guards (the others ran under the stance, uncounted: a
    counter would cost every call), the ``generate()`` calls served, the guards a call of
    the targets evaluates with full guards (what the steady state skips), and the bench's
    own figure for the preset, named as the bench's
    (:data:`~guardtrain.presets.BENCH_GUARD_SHARE`)."""
    ts = e.targets
    preset = "turbo" if e.config.preset == AUTO else e.config.preset
    share = BENCH_GUARD_SHARE.get(preset) if e.levers.use_stance else None
    return {
        "direct_calls": _direct(e)["calls"],
        "full_guard_calls": _full_guard_calls(e),
        "generate_calls_served": _decode(e)["served"],
        "guards_per_call": sum(t.code.guard_count for t in ts.kept),
        "bench_guard_share": share,
    }


def _guard_estimate(e: Run) -> float | None:
    """µs per training step that full guards would spend, estimated without a profiler:
    for each target, the median of its timed full guard checks times its calls in a
    warm-up training step (every call is counted there); None where no check was timed
    or the stance is off. Reported, never decided on."""
    if not e.levers.use_stance:
        return None
    timed = [t for t in e.targets.kept if t.guard_ns and t.step_calls]
    if not timed:
        return None
    return sum(statistics.median(t.guard_ns) / 1e3 * t.step_calls for t in timed)


def _full_guard_calls(e: Run) -> int:
    """The steady state's calls with full guards, the earlier runs' (a checkpoint's) with them."""
    return e.targets.counts.full_guard_calls + e.restored.get("full_guard_calls", 0)


def _added(earlier: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    """Counts per name: an earlier run's and this run's, added."""
    total = dict(earlier)
    for name, n in now.items():
        total[name] = total.get(name, 0) + n
    return total


def _caught(e: Run) -> dict[str, dict[str, Any]]:
    """Changes caught before a call by kind; a ``requires_grad`` flip back to a known state
    (H46) counts as one, as when it was checked."""
    caught = e.state.caught.summary()
    swaps = e.targets.counts.grad_swaps
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
        "broken_targets": _broken(ts, root) if e.levers.direct_dispatch else [],
        "calls": ts.counts.direct_calls + e.restored.get("direct_calls", 0),
    }


def _decode(e: Run) -> dict[str, int]:
    """The calls that carried a transformers cache (``generate()``'s prefill and decode
    calls, H53): ``served`` under the stance or directly, and with ``full_guards`` (in
    warm-up, in audits, or where no entry's check let them through)."""
    counts, restored = e.targets.counts, e.restored.get("decode_calls", {})
    return {
        "served": counts.decode_calls + restored.get("served", 0),
        "full_guards": counts.decode_full_guards + restored.get("full_guards", 0),
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
    """Targets that may not run directly: refused at activation (FSDP's ``fully_shard``)."""
    return list(ts.direct_refused_targets)


def _broken(ts: TargetSet, root: str) -> list[str]:
    """Targets with graph breaks under direct dispatch: a call whose entry breaks runs with
    full guards, the others directly (H4)."""
    return [label(t, root) for t in ts.kept if t.graph_breaks and t.direct_allowed]


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
