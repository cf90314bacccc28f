"""The run's report, ``summary()``: :func:`build` reads a run's parts into a plain dict.

The dict holds ``str``, ``int``, ``float`` and lists and dicts of those; its counters are
the training's (:func:`totals`: :class:`~guardtrain.engine.counters.Counters`). The table
(:mod:`guardtrain.engine.table`) is read from it.
"""

from __future__ import annotations

import statistics
from typing import Any

from guardtrain.compile import CompiledTarget
from guardtrain.engine import warmstart
from guardtrain.engine.counters import Counters
from guardtrain.engine.run import TRAIN, Run
from guardtrain.engine.steps import bottom_line
from guardtrain.engine.targets import label
from guardtrain.presets import AUTO, BENCH_GUARD_SHARE

__all__ = ["build", "totals"]


def build(e: Run, phase: str, compile_cache: dict[str, Any] | None) -> dict[str, Any]:
    """Counters and history of the runs so far, as a plain dict (``summary()``): the run's
    parts, the training loop's ``phase`` as the engine reports it, the warm start."""
    c, m, ts, root = totals(e), e.machine, e.targets, e.host.root_label
    direct = _direct(e, c)
    return {
        "preset": e.config.preset,
        "phase": phase,
        "phases": {str(loop): str(m.phase(loop)) for loop in m.loops},
        "compiles": c.compiles,
        "compiles_by_target": c.compiles_by_target,
        "compiled_again": c.compiled_again,
        "compile_seconds": round(c.compile_seconds, 3),
        "graphs": c.graphs,
        "rearms": c.rearms,
        "warmup_steps_taken": c.warmup_steps_taken,
        "steady_steps": c.steady_steps,
        "targets": list(ts.names),
        "compile_events": c.compile_events,
        "levers": {
            "recursive_dict_tags": e.levers.recursive_dict_tags,
            "install_free_tensors": e.levers.install_free_tensors,
            "guard_filter": e.config.filter_name,
            "soundness_floor": not e.config.unsafe_drop_floor,
            "use_stance": e.levers.use_stance,
        },
        "switched_off": list(e.levers.switched_off),
        "stance_blocked": m.blocked,
        "uncompiled_targets": list(e.state.uncompiled),
        "lookup_us": c.lookup_us,
        "lookup_calls": c.lookup_calls,
        "took_over": list(ts.adapter_took_over) + list(ts.took_over),
        "shared_code": _shared_code(ts.kept, root),
        "own_code": [{"target": label(t, root), "why": t.own_code} for t in ts.kept if t.own_code],
        "direct_dispatch": direct,
        "auto": _auto(e, direct),
        "step": bottom_line(
            e.steps, c.lookup_us, e.levers.direct_dispatch, _counts(e, c), _guard_estimate(e)
        ),
        "caught_changes": _caught(e),
        "state_swaps": c.state_swaps,
        "full_guard_targets": [dict(h) for h in e.ledger.handed_over],
        "full_guard_calls": c.full_guard_calls,
        "decode_calls": {"served": c.decode_served, "full_guards": c.decode_full_guards},
        "checked_batches": c.checked_batches,
        "checked_calls": c.checked_calls,
        "graph_breaks": [dict(b) for b in ts.graph_breaks],
        "mixed_targets": [dict(m) for m in ts.mixed],
        "disabled": e.config.disabled,
        "compile_cache": warmstart.summary(compile_cache),
        "optimizers": e.optimizers.summary(),
    }


def totals(e: Run) -> Counters:
    """The training's counters: the earlier runs' (:attr:`Run.earlier`) and this run's,
    read from its parts once."""
    m, mon, calls = e.machine, e.monitor, e.targets.counts
    seconds, graphs = mon.spent()
    return e.earlier + Counters(
        compiles=mon.compiles,
        rearms=list(m.rearms if e.state.all_rearms is None else e.state.all_rearms),
        warmup_steps_taken=m.warmup_steps_taken,
        steady_steps=m.steady_steps,
        full_guard_calls=calls.full_guard_calls,
        state_swaps=calls.swaps,
        train_batches=m.loops[TRAIN].batches,
        direct_calls=calls.direct_calls,
        decode_served=calls.decode_calls,
        decode_full_guards=calls.decode_full_guards,
        checked_batches=e.checks.checked_batches,
        checked_calls=e.checks.checked_calls,
        graphs=graphs,
        compile_seconds=seconds,
        compiles_by_target=dict(mon.by_target),
        compiled_again=dict(e.ledger.spent),
        compile_events=mon.events,
        lookup_us=e.lookup.lookup,
        lookup_calls=e.lookup.lookup_calls,
    )


def _counts(e: Run, c: Counters) -> dict[str, Any]:
    """The bottom line from counters, on every run: the steady state's calls dispatched
    directly (turbo) and with full guards (the others ran under the stance, uncounted: a
    counter would cost every call), the ``generate()`` calls served, the guards a call of
    the targets evaluates with full guards (what the steady state skips), and the bench's
    own figure for the preset, named as the bench's
    (:data:`~guardtrain.presets.BENCH_GUARD_SHARE`)."""
    preset = "turbo" if e.config.preset == AUTO else e.config.preset
    return {
        "direct_calls": c.direct_calls,
        "full_guard_calls": c.full_guard_calls,
        "generate_calls_served": c.decode_served,
        "guards_per_call": sum(t.code.guard_count for t in e.targets.kept),
        "bench_guard_share": BENCH_GUARD_SHARE.get(preset) if e.levers.use_stance else None,
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


def _direct(e: Run, c: Counters) -> dict[str, Any]:
    """Direct dispatch (turbo): whether it is on, why not, and how many calls used it."""
    ts, root, on = e.targets, e.host.root_label, e.levers.direct_dispatch
    refusals = list(ts.direct_refused_targets) if on else []
    # Graph breaks under direct dispatch: a call whose entry breaks runs with full guards,
    # the others directly (H4).
    broken = [label(t, root) for t in ts.kept if on and t.graph_breaks and t.direct_allowed]
    return {
        "requested": e.config.levers.direct_dispatch,
        "on": on and not _every_target_refused([label(t, root) for t in ts.kept], refusals),
        "refused": e.levers.direct_refused,
        "refused_targets": refusals,
        "broken_targets": broken,
        "calls": c.direct_calls,
    }


def _auto(e: Run, direct: dict[str, Any]) -> dict[str, Any] | None:
    """What the ``auto`` preset chose: turbo's direct dispatch, or aggressive's stance (the
    run, or some targets), and why (``direct``: :func:`_direct`); None under a named preset."""
    if e.config.preset != "auto":
        return None
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
