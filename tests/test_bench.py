"""The benchmark (``python -m guardtrain.bench``) and the in-run lookup window, on tiny models."""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from guardtrain import bench
from guardtrain.profiling import LookupWindow, profiler_active

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--backend", "eager", "--repeats", "2", "--calls", "4", "--steps", "2", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One eager-backend run of every configuration on the tiny mlp (shared by several tests)."""
    torch._dynamo.reset()
    path = tmp_path_factory.mktemp("bench") / "out.json"
    code = bench.main([*FAST, "--model", "mlp", "--tiny", "--json", str(path)])
    assert code == 0
    data = json.loads(path.read_text())
    table = bench.format_table(data)
    return data, table


def test_json_has_the_documented_shape(tiny_run: tuple[dict[str, Any], str]) -> None:
    data, _ = tiny_run
    assert data["torch"] == torch.__version__
    assert isinstance(data["machine"], dict) and data["machine"]["cores"]
    assert len(data["results"]) == len(bench.CONFIGS)
    for r in data["results"]:
        for key in (
            "model",
            "config",
            "guard_us",
            "pregraph_us",
            "call_us",
            "step_us",
            "compiles",
            "matches_eager",
            "repeats",
        ):
            assert key in r, key
        assert r["model"] == "mlp"
        assert len(r["repeats"]) == 2
        assert r["call_us"] > 0 and r["step_us"] > 0
        assert isinstance(r["matches_eager"], bool)
        assert r["steady_compiles"] == 0, r
    assert [r["config"] for r in data["results"]] == list(bench.CONFIGS)


def test_every_config_measured_and_compiled_as_expected(
    tiny_run: tuple[dict[str, Any], str],
) -> None:
    data, _ = tiny_run
    by = {r["config"]: r for r in data["results"]}
    assert by["eager"]["compiles"] == 0 and by["eager"]["guard_us"] is None
    for config in ("compile", "off", "safe", "balanced", "aggressive", "turbo", "auto", "floor"):
        assert by[config]["compiles"] >= 1, config
        assert by[config]["guard_us"] is not None, config
    # Only the stance presets enter the stance, and nothing misses while measuring.
    steady = {c for c, r in by.items() if r["stance"]}
    assert steady == {"balanced", "aggressive", "turbo", "auto"}
    assert all(not r["misses"] for r in by.values())


def test_floor_is_stale_after_eval_and_presets_are_not(
    tiny_run: tuple[dict[str, Any], str],
) -> None:
    data, _ = tiny_run
    by = {r["config"]: r for r in data["results"]}
    assert by["floor"]["matches_eager"] is False
    for config in ("eager", "compile", "off", "safe", "balanced", "aggressive", "turbo", "auto"):
        assert by[config]["matches_eager"] is True, (config, by[config]["max_abs_diff"])
    # The stance presets left the stance on the training-flag change and recompiled.
    assert by["aggressive"]["eval_check_compiles"] == 1
    assert by["turbo"]["eval_check_compiles"] == 1
    assert by["auto"]["eval_check_compiles"] == 1
    assert by["floor"]["eval_check_compiles"] == 0


def test_table_prints(tiny_run: tuple[dict[str, Any], str]) -> None:
    _, table = tiny_run
    lines = table.splitlines()
    assert lines[0].startswith("| model") and "guard µs" in lines[0] and "/floor" in lines[0]
    for config in bench.CONFIGS:
        assert any(f"| {config} " in line for line in lines), config
    assert "NO (unsound)" in table
    # Results only: the project's targets are checked with --check.
    assert "target " not in table and "NOT met" not in table


def test_json_has_no_targets_without_check(tiny_run: tuple[dict[str, Any], str]) -> None:
    data, _ = tiny_run
    assert "targets" not in data


def test_check_targets_lines(tiny_run: tuple[dict[str, Any], str]) -> None:
    data, _ = tiny_run
    checked = bench.check_targets(data["results"])
    assert {(t["config"], t["what"]) for t in checked} == {
        (config, what) for config, what, _ in bench.TARGETS
    } | {(config, what) for model, config, what, _ in bench.MODEL_TARGETS if model in (None, "mlp")}
    for t in checked:
        if t["what"] == "matches_eager":
            assert t["met"] is t["value"] is True
        else:
            assert t["met"] is (t["value"] <= t["bound"])
            assert t["min"] <= t["value"] <= t["max"]
    text = bench.format_checks(checked)
    assert "target mlp/aggressive lookup_vs_compile" in text
    assert "target mlp/turbo matches_eager: yes met" in text
    assert "target mlp/turbo step_vs_floor <= 1.0: " in text
    # The regional and whole-transformer call goals apply to those models only.
    assert "turbo call_vs_floor" not in text


@pytest.mark.parametrize("met", [True, False])
def test_check_flag_prints_targets_and_sets_the_exit_status(
    tiny_run: tuple[dict[str, Any], str],
    met: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    data, _ = tiny_run
    ran = copy.deepcopy(data)
    for r in ran["results"]:  # every target met, or every one missed
        r["ratios"] = {k: (0.0 if met else 9.0) for k in r["ratios"]}
        if r["config"] in ("turbo", "auto"):
            r["matches_eager"] = met
    ran.pop("wall_s", None)
    monkeypatch.setattr(bench.measure, "run_bench", lambda options: copy.deepcopy(ran))
    out = tmp_path / "check.json"
    code = bench.main([*FAST, "--model", "mlp", "--tiny", "--check", "--json", str(out)])
    assert code == (0 if met else 1)
    printed = capsys.readouterr().out
    assert "target mlp/aggressive lookup_vs_compile <= 0.05" in printed
    assert ("NOT met" in printed) is not met
    targets = json.loads(out.read_text())["targets"]
    mlp_goals = [m for m, *_ in bench.MODEL_TARGETS if m in (None, "mlp")]
    assert len(targets) == len(bench.TARGETS) + len(mlp_goals)
    assert all(t["met"] is met for t in targets)


def test_check_flag_fails_when_nothing_could_be_checked(
    tiny_run: tuple[dict[str, Any], str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data, _ = tiny_run
    ran = copy.deepcopy(data)
    ran["results"] = [r for r in ran["results"] if r["config"] == "eager"]
    monkeypatch.setattr(bench.measure, "run_bench", lambda options: copy.deepcopy(ran))
    assert bench.main([*FAST, "--model", "mlp", "--configs", "eager", "--check"]) == 1
    assert "none could be checked" in capsys.readouterr().out


def test_callback_cost_output_is_results_only() -> None:
    data = {
        "torch": torch.__version__,
        "preset": "aggressive",
        "iterations": 10,
        "repeats": 1,
        "us_per_step": {"hooks (on_train_batch_start + on_train_batch_end)": 2.5, "x": 1.0},
        "audit_every": 200,
    }
    text = bench.format_callback_cost(data)
    assert "2.50 µs" in text and "target" not in text
    assert bench.check_callback_cost(data) == (False, "target <= 1.5 µs per step: 2.50 µs, NOT met")
    data["us_per_step"] = {"hooks": 1.5}
    assert bench.check_callback_cost(data)[0] is True
    # GuardTuner.step has the same target.
    data["us_per_step"] = {"hooks": 1.4, bench.cost.TUNER_STEP: 1.6}
    assert bench.check_callback_cost(data) == (
        False,
        "target <= 1.5 µs per step: hooks 1.40 µs, met; GuardTuner.step 1.60 µs, NOT met",
    )


def test_python_dash_m_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "guardtrain.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "python -m guardtrain.bench" in done.stdout
    for option in ("--check", "--callback-cost", "--quick", "--configs", "--plot"):
        assert option in done.stdout, option


def test_user_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "benchpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.lin = nn.Linear(4, 4)
                    self.drop = nn.Dropout(0.5)

                def forward(self, x, scale):
                    return self.drop(self.lin(x)) * scale

            def make():
                return Net(), (torch.randn(3, 4), torch.tensor(2.0))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "user.json"
    code = bench.main(
        [
            *FAST,
            "--model",
            "benchpkg.models:make",
            "--configs",
            "compile,aggressive,floor",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    by = {r["config"]: r for r in data["results"]}
    assert set(by) == {"compile", "aggressive", "floor"}
    assert all(r["model"] == "benchpkg.models:make" for r in data["results"])
    assert by["aggressive"]["matches_eager"] is True
    assert by["floor"]["matches_eager"] is False
    sys.modules.pop("benchpkg.models", None)
    sys.modules.pop("benchpkg", None)


@pytest.mark.parametrize(
    ("argv", "named", "allowed"),
    [
        (["--model", "resnet"], "'resnet'", "mlp, transformer, regional"),
        (
            ["--model", "nosuchpkg_xyz.mod:make"],
            "'nosuchpkg_xyz.mod:make'",
            "package.module:factory",
        ),
        (
            ["--configs", "eager,fast"],
            "'fast'",
            "eager, compile, off, safe, balanced, aggressive, turbo, auto, aot, floor",
        ),
    ],
)
def test_bad_values_name_the_value_and_the_allowed_ones(
    argv: list[str], named: str, allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main([*FAST, *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and allowed in err, err


def test_factory_returning_something_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "badfactory_mod.py").write_text("def make():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"badfactory_mod:make.*not \(module, example_input\)"):
        bench.build_model("badfactory_mod:make")
    sys.modules.pop("badfactory_mod", None)


def test_console_script_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.cli(["nope"]) == 2
    assert "allowed: bench" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        bench.cli(["bench", "--help"])
    assert info.value.code == 0
    assert "guardtrain bench" in capsys.readouterr().out


def test_plot_without_matplotlib_names_the_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(SystemExit):
        bench.main([*FAST, "--model", "mlp", "--tiny", "--plot", str(tmp_path / "x.png")])
    assert "pip install matplotlib" in capsys.readouterr().err


def test_progress_falls_back_to_plain_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    progress = bench.Progress(2, enabled=True)
    progress.update("one")
    progress.update("two")
    progress.close()
    err = capsys.readouterr().err
    assert "[1/2]" in err and "[2/2]" in err and "two" in err


def test_lookup_window_counts_one_lookup_per_compiled_call() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    fn = torch.compile(net, backend="eager")
    x = torch.randn(2, 4)
    fn(x)
    window = LookupWindow()
    assert window.start()
    assert profiler_active()
    for _ in range(5):
        fn(x)
    stats = window.stop(calls=5)
    assert not profiler_active()
    assert stats is not None
    assert stats.lookups == 5 and len(stats.pregraph_durations_us) == 5
    assert stats.guard_us > 0 and stats.guard_us_per_call is not None
    assert stats.cost_us > 0
    assert window.stop() is None  # not started


def test_lookup_window_stays_out_of_another_profiler() -> None:
    window = LookupWindow()
    with torch.autograd.profiler.profile(use_cpu=True):
        assert window.start() is False
        assert window.stop() is None
    assert not profiler_active()


def test_callback_cost_runs_in_the_steady_state() -> None:
    data = bench.callback_cost(iterations=200, repeats=2, profile=False)
    assert data["steady"] is True
    us = data["us_per_step"]
    assert set(us) >= {
        "hooks (on_train_batch_start + on_train_batch_end)",
        "batch_signature",
        "GuardTuner.step (with tuner.step(batch): pass)",
    }
    assert all(v > 0 for v in us.values())


def test_plot_writes_a_png(tiny_run: tuple[dict[str, Any], str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    data, _ = tiny_run
    path = tmp_path / "bench.png"
    bench.plot(data, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_turbo_row_is_run_by_the_engine(tiny_run: tuple[dict[str, Any], str]) -> None:
    """The turbo row goes through the engine's phases: warm-up, entry, the steady state."""
    data, table = tiny_run
    turbo = next(r for r in data["results"] if r["config"] == "turbo")
    assert turbo["driver"] == "engine"
    engine = turbo["engine"]
    assert engine["phase_while_measuring"] == "steady", engine
    assert engine["warmup_batches"] >= bench.EngineRunner.WARMUP_STEPS
    assert engine["steady_steps"] > 0 and not engine["warmup_rearms"]
    assert turbo["stance"] is True and not turbo["misses"] and turbo["steady_compiles"] == 0
    # eval() after training: the per-call check left the steady state and recompiled.
    assert turbo["matches_eager"] is True and turbo["eval_check_compiles"] == 1
    # Left by the mode check, or before it by the change tracking (eval() assigned
    # `training` on every submodule, H33).
    miss = turbo["eval_check_misses"][0] if turbo["eval_check_misses"] else ""
    assert "training=False" in miss or "training: True -> False" in miss, miss
    assert engine["phase_after_eval_check"] == "warmup"
    assert "mlp/turbo: run by the engine's phases (steady while measuring" in table
    engine_rows = bench.ENGINE_CONFIGS  # every preset
    assert all("driver" not in r for r in data["results"] if r["config"] not in engine_rows)
    assert all(r["driver"] == "engine" for r in data["results"] if r["config"] in engine_rows)


def test_ratio_spread_and_per_frame_column(tiny_run: tuple[dict[str, Any], str]) -> None:
    data, table = tiny_run
    by = {r["config"]: r for r in data["results"]}
    floor = by["floor"]["repeats"]
    for config, r in by.items():
        assert r["frames_per_call"] == 1  # the mlp is compiled whole
        for name, value in r["ratios"].items():
            if value is None:  # eager has no guard time
                assert name not in r["ratio_spread"]
                continue
            spread = r["ratio_spread"][name]
            assert spread["min"] <= value <= spread["max"], (config, name)
        diffs = sorted(s["call_us"] - f["call_us"] for s, f in zip(r["repeats"], floor))
        assert r["per_frame_spread"]["min"] == pytest.approx(diffs[0])
        assert r["per_frame_spread"]["max"] == pytest.approx(diffs[-1])
        assert r["per_frame_us"] == pytest.approx(sum(diffs) / 2)  # median of 2
    assert by["floor"]["per_frame_us"] == 0.0
    header = table.splitlines()[0]
    assert "call-floor µs/frame" in header
    turbo_line = next(line for line in table.splitlines() if "| turbo " in line)
    assert "[" in turbo_line  # ratios and the per-frame column come with their range


def test_regional_turbo_shares_code_and_divides_by_frames() -> None:
    """Regional: the per-frame column divides by the compiled blocks; the engine's blocks
    share one code object (H24), and turbo reaches the steady state and matches eager."""
    torch._dynamo.reset()
    options = bench.BenchOptions(
        models=["regional"],
        configs=["turbo", "aot", "floor"],
        repeats=2,
        backend="eager",
        calls=4,
        steps=2,
        tiny=True,
        progress=False,
    )
    data = bench.run_bench(options)
    by = {r["config"]: r for r in data["results"]}
    turbo, floor = by["turbo"], by["floor"]
    assert turbo["frames_per_call"] == floor["frames_per_call"] == 2  # tiny: 2 blocks
    diffs = sorted(
        (s["call_us"] - f["call_us"]) / 2 for s, f in zip(turbo["repeats"], floor["repeats"])
    )
    assert turbo["per_frame_us"] == pytest.approx(sum(diffs) / 2)
    assert turbo["engine"]["phase_while_measuring"] == "steady"
    shared = turbo["engine"]["shared_code"]
    assert shared and shared[0]["targets"] == ["blocks.0", "blocks.1"]
    assert turbo["matches_eager"] is True and floor["matches_eager"] is False
    checked = bench.check_targets(data["results"])
    goals = {(t["config"], t["what"]) for t in checked}
    assert ("turbo", "call_vs_floor") in goals and ("turbo", "matches_eager") in goals
    # The anchor serves each block through its `_compiled_call_impl`: the two blocks share
    # one function per kind of call, and turbo's call is checked against it.
    aot = by["aot"]
    assert aot["compiles"] == 2 and aot["call_us"] > 0 and aot["step_us"] > 0
    assert aot["guard_us"] == 0.0 and aot["matches_eager"] is False
    assert ("turbo", "call_vs_aot") in goals


def test_anchor_row_and_columns(tiny_run: tuple[dict[str, Any], str]) -> None:
    """The anchor ``aot`` is measured in the same windows: no guard evaluated, one function
    per kind of call, the training graph reused after ``eval()``; every row has its paired
    ratios to it, and the table its two ``/aot`` columns."""
    data, table = tiny_run
    by = {r["config"]: r for r in data["results"]}
    aot = by["aot"]
    assert aot["guard_us"] == 0.0 and aot["pregraph_us"] is not None
    assert aot["call_us"] > 0 and aot["step_us"] > 0
    assert aot["compiles"] == 2  # one function under no_grad, one for the training step
    assert aot["matches_eager"] is False and aot["eval_check_compiles"] == 0
    assert aot["anchor"] == {"functions": 2}
    for config, r in by.items():
        for metric in ("call", "step"):
            ratios = [
                s[f"{metric}_us"] / a[f"{metric}_us"] for s, a in zip(r["repeats"], aot["repeats"])
            ]
            assert r["ratios"][f"{metric}_vs_aot"] == pytest.approx(statistics.median(ratios)), (
                config
            )
    header, _, *lines = table.splitlines()
    columns = [c.strip() for c in header.split("|")[1:-1]]
    assert columns.count("/aot") == 2  # call and step
    aot_line = next(line for line in lines if "| aot " in line)
    assert "NO (unsound)" in aot_line and "1.00 [1.00-1.00]" in aot_line
    turbo_line = next(line for line in lines if "| turbo " in line)
    cells = [c.strip() for c in turbo_line.split("|")[1:-1]]
    call_vs_aot = cells[columns.index("/aot")]
    assert call_vs_aot.startswith(f"{by['turbo']['ratios']['call_vs_aot']:.2f} [")


GRAPH_BREAK = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)

def make():
    return Net(), torch.randn(3, 4)
"""


def test_anchor_shows_a_dash_where_it_cannot_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A graph break: ``aot_compile`` needs ``fullgraph=True``, so the row is ``-`` with the
    reason, no ratio to it is reported and the checks have no goal against it."""
    (tmp_path / "gb_anchor_mod.py").write_text(GRAPH_BREAK)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "gb.json"
    argv = [*FAST, "--model", "gb_anchor_mod:make", "--configs", "compile,turbo,aot,floor"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    by = {r["config"]: r for r in data["results"]}
    aot = by["aot"]
    for metric in ("guard_us", "pregraph_us", "call_us", "step_us", "matches_eager"):
        assert aot[metric] is None, metric
    assert aot["compiles"] == 0
    assert "graph break" in aot["anchor"]["unavailable"]
    assert "fullgraph=True" in aot["anchor"]["unavailable"]
    for r in by.values():
        assert r["ratios"]["call_vs_aot"] is None and "call_vs_aot" not in r["ratio_spread"]
    aot_line = next(line for line in printed.splitlines() if "| aot " in line)
    cells = [c.strip() for c in aot_line.split("|")[1:-1]]
    assert cells[:2] == ["gb_anchor_mod:make", "aot"]
    assert set(cells[2:]) - {"0"} == {"-"}  # the compiles column: none
    assert "gb_anchor_mod:make/aot: not measured: graph break" in printed
    # Had it been the regional model: its goals against floor, none against the anchor.
    as_regional = [{**r, "model": "regional"} for r in data["results"]]
    goals = {t["what"] for t in bench.check_targets(as_regional)}
    assert "call_vs_floor" in goals and "call_vs_aot" not in goals
    sys.modules.pop("gb_anchor_mod", None)


def test_anchor_missing_from_torch_is_a_dash(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench.anchor, "anchor_missing", lambda: "torch 2.0 has no aot_compile")
    assert bench.main([*FAST, "--model", "mlp", "--tiny", "--configs", "aot"]) == 0
    printed = capsys.readouterr().out
    assert "mlp/aot: not measured: torch 2.0 has no aot_compile" in printed


def _turbo_vs_anchor(model: str, ratio: float, low: float, high: float) -> dict[str, Any]:
    return {
        "model": model,
        "config": "turbo",
        "matches_eager": True,
        "ratios": {"call_vs_aot": ratio},
        "ratio_spread": {"call_vs_aot": {"median": ratio, "min": low, "max": high}},
    }


@pytest.mark.parametrize(
    ("ratio", "met"), [(0.97, True), (1.0, True), (1.004, False), (1.2, False)]
)
def test_check_holds_turbo_at_or_below_the_anchor(ratio: float, met: bool) -> None:
    """Synthetic numbers: the goal compares the median of turbo's paired per-repeat call
    ratios to the anchor with 1.00, on the transformer and the regional model only."""
    results = [
        _turbo_vs_anchor("transformer", ratio, ratio - 0.05, ratio + 0.05),
        _turbo_vs_anchor("regional", ratio, 0.9, 1.1),
        _turbo_vs_anchor("mlp", 5.0, 5.0, 5.0),
    ]
    checked = [t for t in bench.check_targets(results) if t["what"] == "call_vs_aot"]
    assert [(t["model"], t["bound"], t["met"]) for t in checked] == [
        ("transformer", 1.0, met),
        ("regional", 1.0, met),
    ]
    text = bench.format_checks(checked)
    verdict = "met" if met else "NOT met"
    assert f"target regional/turbo call_vs_aot <= 1.0: {ratio:.3f} [0.900-1.100] {verdict}" in text


def test_ratios_to_the_anchor_are_paired_per_repeat() -> None:
    """Synthetic repeats: each repeat's call over the anchor's call in the same repeat; the
    median of those, with their range (not a ratio of medians)."""
    rows = [
        {"call_us": 90.0, "step_us": None},
        {"call_us": 220.0, "step_us": None},
        {"call_us": 99.0, "step_us": None},
    ]
    anchor = [
        {"call_us": 100.0, "step_us": None},
        {"call_us": 200.0, "step_us": None},
        {"call_us": 100.0, "step_us": None},
    ]
    ratios, spread = bench.measure._ratios(rows, None, None, anchor)
    assert ratios["call_vs_aot"] == pytest.approx(0.99)  # of 0.90, 1.10, 0.99
    assert spread["call_vs_aot"]["min"] == pytest.approx(0.9)
    assert spread["call_vs_aot"]["max"] == pytest.approx(1.1)
    assert ratios["step_vs_aot"] is None and "step_vs_aot" not in spread


FACTORY = """
import torch
from torch import nn

def make():
    return nn.Linear(4, 4), torch.randn(2, 4)
"""

#: What pip writes for ``[project.scripts] guardtrain = "guardtrain.bench:cli"``: run as
#: a file, so ``sys.path[0]`` is the script's folder, not the working directory.
CONSOLE_SCRIPT = """
import sys
from guardtrain.bench import cli
if __name__ == "__main__":
    sys.exit(cli())
"""


def _console_script(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run the console script from ``tmp_path / "work"``, with only this checkout added to
    the import path (no empty entry, which would stand for the working directory)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "guardtrain"
    script.write_text(CONSOLE_SCRIPT)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *paths])}
    return subprocess.run(
        [sys.executable, str(script), "bench", *argv],
        cwd=tmp_path / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_console_script_keeps_the_profilers_own_lines_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch profiler's ``USDT ... profiler_start/stop`` lines stay out of the terminal
    (without redirecting a file descriptor); a level the caller set is left as it is (and
    shows that this run profiles)."""
    (tmp_path / "work").mkdir()
    argv = ["--model", "mlp", "--configs", "compile", "--backend", "eager", "--repeats", "1"]
    argv += ["--calls", "2", "--no-step", "--no-progress"]
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    quiet = _console_script(tmp_path, *argv)
    assert quiet.returncode == 0, quiet.stderr
    assert "USDT" not in quiet.stdout + quiet.stderr
    monkeypatch.setenv("KINETO_LOG_LEVEL", "1")
    loud = _console_script(tmp_path, *argv)
    assert loud.returncode == 0, loud.stderr
    assert "profiler_start" in loud.stdout + loud.stderr


def test_console_script_imports_a_factory_from_the_working_directory(tmp_path: Path) -> None:
    """``guardtrain bench --model mymodule:factory`` run beside ``mymodule.py``: the module
    is found in the working directory, as with ``python -m``; a bad spec names the value,
    what is allowed and the working directory."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "gt_cwd_factory.py").write_text(FACTORY)
    out = tmp_path / "out.json"
    common = ["--configs", "eager", "--repeats", "1", "--calls", "2", "--no-step", "--no-progress"]
    done = _console_script(tmp_path, "--model", "gt_cwd_factory:make", *common, "--json", str(out))
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert [r["model"] for r in data["results"]] == ["gt_cwd_factory:make"]
    assert data["results"][0]["call_us"] > 0
    bad = _console_script(tmp_path, "--model", "gt_no_such_module:make", *common)
    assert bad.returncode == 2
    assert "'gt_no_such_module:make'" in bad.stderr and "package.module:factory" in bad.stderr
    assert f"working directory {work.resolve()}" in bad.stderr
    missing = _console_script(tmp_path, "--model", "gt_cwd_factory:nothing", *common)
    assert missing.returncode == 2
    assert (
        "'gt_cwd_factory:nothing'" in missing.stderr and "no callable 'nothing'" in missing.stderr
    )


def test_the_reference_runner_refuses_a_preset() -> None:
    """A preset runs in an ``EngineRunner``; the references' ``Runner`` names it rather than
    measure plain compile under the preset's label."""
    from guardtrain.bench.models import build_model
    from guardtrain.bench.runner import Runner
    from guardtrain.errors import GuardTrainValueError

    with pytest.raises(GuardTrainValueError, match="'aggressive'.*EngineRunner"):
        Runner(build_model("mlp", tiny=True), "aggressive", "eager")
