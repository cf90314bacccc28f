"""The project's performance targets, checked only when asked (``--check``).

Default output shows results only. With ``--check`` the command prints one line
per target and exits with status 1 when one is missed; the JSON then carries
the checks (``targets`` for a run, ``target_us`` and ``target_met`` for
``--callback-cost``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CALLBACK_COST_TARGET_US",
    "MODEL_TARGETS",
    "TARGETS",
    "check_callback_cost",
    "check_targets",
    "format_checks",
]

#: (config, what, bound): guard + pre-graph as a fraction of compile's; whole call vs floor.
TARGETS = (
    ("aggressive", "lookup_vs_compile", 0.05),
    ("balanced", "lookup_vs_compile", 0.25),
    ("safe", "lookup_vs_compile", 0.50),
    ("aggressive", "call_vs_floor", 1.03),
)

#: (model or None for every model, config, what, bound): ``turbo``'s and ``auto``'s goals
#: (the same: ``auto`` runs turbo's levers on the bench's models) against the
#: unsound floor and against the anchor ``aot`` (PyTorch's ``aot_compile()`` with its guard
#: check disabled), as paired ratios; ``matches_eager`` is the ``eval()`` check (bound:
#: True). A ratio goal holds when the median of the per-repeat ratios (each taken within
#: one repeat, the two configurations timed in turns) is at or below the bound: the
#: tolerance for a shared machine's noise is that median, not a margin on the bound, so
#: single repeats may lie above it (their range is printed beside the verdict).
MODEL_TARGETS: tuple[tuple[str | None, str, str, float | bool], ...] = tuple(
    (model, config, what, bound)
    for config in ("turbo", "auto")  # auto: the default, what users run
    for model, what, bound in (
        ("regional", "call_vs_floor", 0.92),
        ("transformer", "call_vs_floor", 1.00),
        ("regional", "call_vs_aot", 1.00),
        ("transformer", "call_vs_aot", 1.00),
        (None, "step_vs_floor", 1.0),
        (None, "matches_eager", True),
    )
)

CALLBACK_COST_TARGET_US = 1.5
"""The steady-state µs per training step of the callback's hooks and of
``GuardTuner.step`` (``--callback-cost``)."""


def check_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets per model, where both sides were measured (none against the anchor
    where it could not serve the model)."""
    by_key = {(r["model"], r["config"]): r for r in results}
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        goals = [(config, what, bound) for config, what, bound in TARGETS]
        goals += [(c, w, b) for m, c, w, b in MODEL_TARGETS if m is None or m == model]
        for config, what, bound in goals:
            r = by_key.get((model, config))
            if r is None:
                continue
            row: dict[str, Any] = {"model": model, "config": config, "what": what, "bound": bound}
            if what == "matches_eager":
                value = bool(r["matches_eager"])
                out.append({**row, "value": value, "met": value is bound})
                continue
            ratio = r["ratios"].get(what)
            if ratio is None:
                continue
            spread = r.get("ratio_spread", {}).get(what) or {}
            out.append(
                {
                    **row,
                    "value": ratio,
                    "met": ratio <= bound,
                    "min": spread.get("min"),
                    "max": spread.get("max"),
                }
            )
    return out


def format_checks(checks: list[dict[str, Any]]) -> str:
    """One line per checked target, ``met`` or ``NOT met`` (a ratio with its range)."""
    if not checks:
        return "targets: none could be checked (a configuration they compare was not run)"
    lines = []
    for t in checks:
        verdict = "met" if t["met"] else "NOT met"
        head = f"target {t['model']}/{t['config']} {t['what']}"
        if isinstance(t["value"], bool):
            lines.append(f"{head}: {'yes' if t['value'] else 'no'} {verdict}")
            continue
        spread = ""
        if t.get("min") is not None and t.get("max") is not None:
            spread = f" [{t['min']:.3f}-{t['max']:.3f}]"
        lines.append(f"{head} <= {t['bound']}: {t['value']:.3f}{spread} {verdict}")
    return "\n".join(lines)


def check_callback_cost(data: dict[str, Any]) -> tuple[bool, str]:
    """Whether the hooks (and ``GuardTuner.step``, where measured) met
    :data:`CALLBACK_COST_TARGET_US`, and the line saying so."""
    from guardtrain.bench.cost import TUNER_STEP

    us = data["us_per_step"]
    measured = [("hooks", next(iter(us.values())))]
    if us.get(TUNER_STEP) is not None:
        measured.append(("GuardTuner.step", us[TUNER_STEP]))
    verdicts = [(n, v, v <= CALLBACK_COST_TARGET_US) for n, v in measured]
    met = all(ok for _, _, ok in verdicts)
    parts = [
        (f"{n} " if len(verdicts) > 1 else "") + f"{v:.2f} µs, {'met' if ok else 'NOT met'}"
        for n, v, ok in verdicts
    ]
    return met, f"target <= {CALLBACK_COST_TARGET_US} µs per step: " + "; ".join(parts)
