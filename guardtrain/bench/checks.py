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

CALLBACK_COST_TARGET_US = 2.0
"""The steady-state hooks' µs per training step (``--callback-cost``)."""


def check_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets per model, where both sides were measured."""
    by_key = {(r["model"], r["config"]): r for r in results}
    out = []
    for model in dict.fromkeys(r["model"] for r in results):
        for config, what, bound in TARGETS:
            r = by_key.get((model, config))
            value = None if r is None else r["ratios"].get(what)
            if value is None:
                continue
            out.append(
                {
                    "model": model,
                    "config": config,
                    "what": what,
                    "bound": bound,
                    "value": value,
                    "met": value <= bound,
                }
            )
    return out


def format_checks(checks: list[dict[str, Any]]) -> str:
    """One line per checked target, ``met`` or ``NOT met``."""
    if not checks:
        return "targets: none could be checked (a configuration they compare was not run)"
    return "\n".join(
        f"target {t['model']}/{t['config']} {t['what']} <= {t['bound']}: "
        f"{t['value']:.3f} {'met' if t['met'] else 'NOT met'}"
        for t in checks
    )


def check_callback_cost(data: dict[str, Any]) -> tuple[bool, str]:
    """Whether the hooks met :data:`CALLBACK_COST_TARGET_US`, and the line saying so."""
    total = next(iter(data["us_per_step"].values()))
    met = total <= CALLBACK_COST_TARGET_US
    verdict = "met" if met else "NOT met"
    return met, f"target <= {CALLBACK_COST_TARGET_US} µs per step: {total:.2f} µs, {verdict}"
