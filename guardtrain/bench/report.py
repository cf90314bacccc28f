"""The bench's results as a terminal table, JSON and a PNG chart. Results only: the
targets are checked by :mod:`guardtrain.bench.goals` (``--check``)."""

from __future__ import annotations

import json
from typing import Any

from guardtrain.bench.timing import describe
from guardtrain.errors import GuardTrainValueError

__all__ = ["format_table", "plot", "require_matplotlib", "write_json"]

HEADER = (
    "model",
    "config",
    "guard µs",
    "pregraph µs",
    "g+p /compile",
    "call µs",
    "/compile",
    "/floor",
    "/aot",
    "call-floor µs/frame",
    "step µs",
    "/compile",
    "/floor",
    "/aot",
    "compiles",
    "eval ok",
)


def _us(result: dict[str, Any], metric: str) -> str:
    """A median in µs and its spread: ``12.3 ±4%`` (``-``: not measured)."""
    value, s = result[metric], result.get("spread", {}).get(metric)
    if value is None:
        return "-"
    text = f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"
    if not s or not s["median"]:
        return text
    return text + f" ±{(s['max'] - s['min']) / 2 / s['median'] * 100:.0f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio_range(r: dict[str, Any], name: str) -> str:
    """A paired ratio with its range over the repeats: ``0.91 [0.89-0.95]``."""
    value = r.get("ratios", {}).get(name)
    s = r.get("ratio_spread", {}).get(name)
    if value is None or not s:
        return _ratio(value)
    return f"{value:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def _per_frame(r: dict[str, Any]) -> str:
    """Call minus floor's call per compiled frame (paired per repeat), with its range."""
    s = r.get("per_frame_spread")
    if not s or r["config"] == "floor":
        return "-"
    return f"{s['median']:+.1f} [{s['min']:+.1f}, {s['max']:+.1f}]"


UNSOUND = ("aot", "floor")
"""The references that skip every guard: their wrong ``eval()`` result is shown."""


def _eval_ok(r: dict[str, Any]) -> str:
    if r["matches_eager"] is None:  # the configuration could not serve the model
        return "-"
    return ("yes" if r["matches_eager"] else "NO") + (
        " (unsound)" if r["config"] in UNSOUND else ""
    )


def _row(r: dict[str, Any]) -> list[str]:
    ratios = r.get("ratios", {})
    return [
        r["model"],
        r["config"],
        _us(r, "guard_us"),
        _us(r, "pregraph_us"),
        _ratio(ratios.get("lookup_vs_compile")),
        _us(r, "call_us"),
        _ratio(ratios.get("call_vs_compile")),
        _ratio_range(r, "call_vs_floor"),
        _ratio_range(r, "call_vs_aot"),
        _per_frame(r),
        _us(r, "step_us"),
        _ratio(ratios.get("step_vs_compile")),
        _ratio_range(r, "step_vs_floor"),
        _ratio_range(r, "step_vs_aot"),
        str(r["compiles"]),
        _eval_ok(r),
    ]


def _markdown(rows: list[list[str]]) -> list[str]:
    """A Markdown table: the first two columns left-aligned, the numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("| " + " | ".join(cells) + " |")
        if n == 0:
            rule = ("-" * (w + 1) + ":" if i >= 2 else "-" * (w + 2) for i, w in enumerate(widths))
            lines.append("|" + "|".join(rule) + "|")
    return lines


def _notes(data: dict[str, Any]) -> list[str]:
    opts = data.get("options", {})
    machine = data["machine"]
    notes = [
        f"torch {data['torch']}, backend {opts.get('backend')}, {opts.get('repeats')} repeats, "
        f"{machine.get('torch_threads')} thread(s), load "
        f"{machine.get('loadavg_start')} -> {machine.get('loadavg_end')}; call and step "
        f"timed by {describe(data.get('clock', 'wall'))} (the wall clock beside it in the JSON)",
        "µs: median over repeats, ± half the range in % of the median; ratios: median of "
        "per-repeat ratios, [min-max] over the repeats; guard/pregraph: per model call (all "
        "compiled frames); call/step: median call of each window; call-floor µs/frame: "
        "(call - floor's call) / compiled frames per call, paired per repeat, [min, max]; "
        "/aot: against the anchor aot (aot_compile with its guard check disabled).",
    ]
    for r in data["results"]:
        extra = []
        if r.get("steady_compiles"):
            extra.append(f"{r['steady_compiles']} compile(s) while measuring")
        if r.get("stance_blocked"):
            extra.append(f"stance blocked: {r['stance_blocked']}")
        if r.get("misses"):
            extra.append(f"stance misses: {r['misses'][0]}")
        anchor = r.get("anchor", {})
        if anchor.get("unavailable"):
            extra.append(f"not measured: {anchor['unavailable']}")
        if anchor.get("step_unavailable"):
            extra.append(f"no training step: {anchor['step_unavailable']}")
        for off in r.get("switched_off", []):
            extra.append(f"{off['lever']} switched off: {off['why']}")
        if r.get("driver") == "engine":
            seen = r.get("engine", {})
            shared = seen.get("shared_code") or []
            extra.append(
                f"run by the engine's phases ({seen.get('phase_while_measuring')} while "
                f"measuring, after {seen.get('warmup_batches')} warm-up batches"
                + (f"; {len(shared[0]['targets'])} targets share code" if shared else "")
                + ")"
            )
        if extra:
            notes.append(f"{r['model']}/{r['config']}: " + "; ".join(extra))
    cost = data.get("lookup_window_cost_us")
    if cost:
        notes.append(
            f"LookupWindow own cost (start+stop+parse): median {cost['median']:.0f} µs "
            f"(min {cost['min']:.0f}, max {cost['max']:.0f})"
        )
    return notes


def format_table(data: dict[str, Any]) -> str:
    """The terminal table: medians, spread (± half range in % of the median), ratios."""
    rows = [list(HEADER), *(_row(r) for r in data["results"])]
    return "\n".join(_markdown(rows)) + "\n\n" + "\n".join(_notes(data))


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


def require_matplotlib() -> None:
    """Fail early, naming the install, when ``--plot`` cannot work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GuardTrainValueError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            '(or pip install "guardtrain[bench]").'
        ) from None


def _bars(ax: Any, rows: list[dict[str, Any]], metric: str | None) -> None:
    """One panel: guard + pre-graph stacked (``metric`` None), or a metric with its spread."""
    xs = list(range(len(rows)))
    if metric is None:
        guard = [r["guard_us"] or 0.0 for r in rows]
        pre = [r["pregraph_us"] or 0.0 for r in rows]
        ax.bar(xs, guard, label="guards", color="#c44e52")
        ax.bar(xs, pre, bottom=guard, label="pre-graph", color="#dd8452")
        ax.legend(fontsize=8)
    elif all(r[metric] is None for r in rows):
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    else:
        vals = [r[metric] or 0.0 for r in rows]
        err_lo, err_hi = [], []
        for r, v in zip(rows, vals):
            s = r.get("spread", {}).get(metric)
            err_lo.append(v - s["min"] if s else 0.0)
            err_hi.append(s["max"] - v if s else 0.0)
        ax.bar(xs, vals, yerr=[err_lo, err_hi], capsize=3, color="#4c72b0")
    ax.set_xticks(xs)
    ax.set_xticklabels([r["config"] for r in rows], rotation=30, ha="right", fontsize=8)


def plot(data: dict[str, Any], path: str) -> None:
    """A PNG bar chart: per model, guard + pre-graph µs, call µs and step µs per configuration."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in data["results"]))
    panels = (
        ("guard + pre-graph µs per call", None),
        ("call µs", "call_us"),
        ("step µs", "step_us"),
    )
    fig, axes = plt.subplots(
        len(models), 3, figsize=(15, 3.6 * len(models)), squeeze=False, constrained_layout=True
    )
    for i, model in enumerate(models):
        rows = [r for r in data["results"] if r["model"] == model]
        for j, (title, metric) in enumerate(panels):
            _bars(axes[i][j], rows, metric)
            axes[i][j].set_title(f"{model}: {title}", fontsize=10)
    fig.suptitle(
        f"guardtrain bench (torch {data['torch']}, {data['options']['backend']}, "
        f"median of {data['options']['repeats']})"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
