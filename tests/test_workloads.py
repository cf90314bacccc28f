"""``python -m benchmarks --workload``: the speed suite of real workloads, from the checkout.

Each workload runs tiny (``aot_eager``, one round of 2 timed steps) under plain compile
and ``turbo``: its results are there, every configuration ran the steps asked for, the
last loss is finite, and every step's loss equals plain compile's bitwise (the same
data, seeds and steps; ``aot_eager`` is deterministic on the CPU). The command line,
``--check`` and the report are tested on the cheapest workload and on made-up results;
``guardtrain bench --workload`` names the command that runs the suite.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import (
    WORKLOADS,
    SuiteOptions,
    check_suite,
    format_checks,
    format_suite,
    parse_suite_configs,
    parse_workloads,
    run_suite,
)
from benchmarks.command import main
from guardtrain import bench
from guardtrain.errors import GuardTrainValueError

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

STEPS = 2
CONFIGS = ["compile", "turbo"]


def run(name: str, configs: list[str] = CONFIGS) -> dict[str, Any]:
    data = run_suite(
        SuiteOptions(
            workloads=[name],
            configs=configs,
            repeats=1,
            steps=STEPS,
            backend="aot_eager",
            tiny=True,
            progress=False,
        )
    )
    (w,) = data["workloads"]
    assert "error" not in w, w.get("traceback", w.get("error"))
    assert "skipped" not in w, w["skipped"]
    return w


def assert_ran(w: dict[str, Any], configs: list[str] = CONFIGS, same_losses: bool = True) -> None:
    assert list(w["configs"]) == configs
    assert w["backend"] == "aot_eager"
    per_turn = w["settle_steps"] + STEPS
    for c, row in w["configs"].items():
        assert row["timed"] == STEPS, (c, row)
        assert row["steps_per_turn"] == [per_turn], (c, row)
        assert row["loss_finite"] and math.isfinite(row["last_loss"]), (c, row)
        assert row["median_ms"] > 0
        if c == "compile":
            assert "summary" not in row
            assert sum(row["dynamo_compiles"].values()) > 0, "plain compile compiled nothing"
            continue
        assert row["losses_vs_plain"]["equal"] or not same_losses, (c, row["losses_vs_plain"])
        assert row["losses_vs_plain"]["compared"] == per_turn
        assert row["ratio"] > 0 and row["ratio_min"] <= row["ratio_max"]
        s = row["summary"]
        assert s["compiles"] > 0 and s["steady_steps"] >= 0, s


FAST = ["gan-toggle", "autocast-alternate", "rl-alternate", "vit-checkpoint"]
SLOW = ["dpo-peft", "dpo-peft-lightning", "dpo-peft-hf"]


@pytest.mark.parametrize("name", FAST)
def test_workload(name: str) -> None:
    w = run(name)
    assert_ran(w)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_dpo_workload(name: str) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    w = run(name)
    assert_ran(w)
    # Each step flips the adapters' requires_grad (H46): guardtrain saw it.
    assert w["configs"]["turbo"]["summary"]["caught_changes"].get("requires_grad", 0) > 0


@pytest.mark.parametrize("name", ["litgpt-fabric", "litgpt-fabric-regional"])
def test_litgpt_fabric(name: str) -> None:
    pytest.importorskip("litgpt")
    w = run(name)
    assert_ran(w)
    targets = w["configs"]["turbo"]["summary"]["targets"]
    if name.endswith("regional"):
        assert targets == ["transformer.h.0", "transformer.h.1"], targets


@pytest.mark.parametrize(
    "name",
    ["rollout", pytest.param("grpo", marks=pytest.mark.slow)],  # grpo: 45 s here
)
def test_rollout_workloads(name: str) -> None:
    """``generate()`` inside the step, its calls served under turbo. ``rollout``: the losses
    (which the sampled rollouts feed) equal plain compile's bitwise. ``grpo``: two TRL GRPO
    trainers that alternate in one process do not repeat each other's samples (eager beside
    eager neither), so there only the run is checked; tests/test_trl.py compares GRPO's
    completions with eager, one trainer at a time."""
    pytest.importorskip("transformers")
    if name == "grpo":
        pytest.importorskip("trl")
    w = run(name)
    assert_ran(w, same_losses=name != "grpo")
    turbo = w["configs"]["turbo"]
    assert turbo["summary"]["decode_calls"]["served"] > 0, turbo["summary"]["decode_calls"]


@pytest.mark.slow
def test_dpo_trl() -> None:
    """``--tiny`` turns TRL's gradient checkpointing off: no hook a step (H47), so the
    presets steady as in ``dpo-peft-hf``."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    w = run("dpo-trl")
    assert_ran(w)
    notes = w["notes"]["compile"]
    assert any("gradient_checkpointing=False" in n for n in notes), notes
    assert any("input embeddings after the last turn: 0" in n for n in notes), notes
    turbo = w["configs"]["turbo"]
    assert turbo["steady_timed"] == STEPS, turbo


@pytest.mark.slow
def test_dpo_trl_with_gradient_checkpointing() -> None:
    """TRL's default, as in the full run: one more forward hook on the input embeddings
    every step (H47); guardtrain sees each one and never steadies, plain compile matches."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from benchmarks import Setting
    from benchmarks.trl_dpo import runner

    turns = {}
    for config in ("compile", "aggressive"):
        r = runner(Setting(config, "aot_eager", tiny=True, warmup_steps=1, stable_steps=1), True)
        try:
            turns[config] = (r.turn(settle=2, timed=1, seed=0), r.summary(), list(r.notes))
        finally:
            r.close()
    (plain, _, notes), (got, s, _) = turns["compile"], turns["aggressive"]
    assert got.losses == plain.losses
    assert any("gradient_checkpointing=True" in n for n in notes), notes
    (hooks,) = [int(n.rsplit(": ", 1)[1]) for n in notes if "input embeddings" in n]
    assert hooks >= 3, notes  # at least one more a step
    assert s is not None and s["steady_steps"] == 0 and got.steady == [False]
    assert s["caught_changes"]["hooks"]["count"] > 0, s["caught_changes"]


def test_vit_says_which_model_ran() -> None:
    w = run("vit-checkpoint", ["compile"])
    (note,) = w["notes"]["compile"]
    try:
        import timm  # noqa: F401
    except Exception:
        assert "built-in TinyViT" in note
    else:
        assert "timm VisionTransformer" in note


# -- the command line ----------------------------------------------------------------------------


def test_command_line_json_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.json"
    status = main(
        [
            "--workload",
            "rl-alternate",
            "--tiny",
            "--backend",
            "aot_eager",
            "--repeats",
            "2",
            "--steps",
            "3",
            "--no-progress",
            "--check",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    (w,) = data["workloads"]
    assert list(w["configs"]) == ["compile", "balanced", "aggressive", "turbo", "auto"]
    assert data["clock"] == "cpu"  # one thread: the thread's CPU time decides
    for row in w["configs"].values():
        assert row["timed"] == 6 and len(row["round_ms"]) == 2
        assert row["cpu_ms"] > 0 and row["wall_ms"] > 0
    assert [v["config"] for v in data["checks"]] == ["balanced", "aggressive", "turbo", "auto"]
    assert status == (0 if all(v["met"] for v in data["checks"]) else 1)
    for v in data["checks"]:
        verdict = "met" if v["met"] else "NOT met"
        assert f"rl-alternate {v['config']}: {v['ratio']:.3f}" in printed
        assert verdict in printed
    assert "rl-alternate" in printed and "ms/step" in printed
    assert "timed by the calling thread's CPU time" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--workload", "rl-alternate", "--configs", "floor"], "'floor' is not a configuration"),
        (["--workload", "rl-alternate", "--model", "mlp"], "--model does not apply"),
        (["--workload", "rl-alternate", "--check", "--configs", "turbo"], "add it to --configs"),
        (["--workload", "rl-alternate", "--repeats", "0"], "--repeats must be at least 1"),
    ],
)
def test_command_line_refuses(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_benchmarks_runs_from_the_checkout() -> None:
    """``python -m benchmarks`` from the checkout's root: ``guardtrain bench``'s options and
    the suite's."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "python -m benchmarks" in done.stdout
    for option in ("--workload", "--compile-optimizer", "--no-fallback", "--check", "--model"):
        assert option in done.stdout, option


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--workload", "all", "--check"], "python -m benchmarks --workload all --check"),
        (["--workload=rl-alternate"], "python -m benchmarks --workload=rl-alternate"),
        (["--compile-optimizer"], "python -m benchmarks --compile-optimizer --workload NAME"),
        (["--no-fallback"], "python -m benchmarks --no-fallback --workload NAME"),
    ],
)
def test_guardtrain_bench_names_the_suites_command(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The console script runs no workload: it names the command that does, from a
    checkout, with the options given."""
    with pytest.raises(SystemExit) as exc:
        bench.cli(["bench", *argv])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{argv[0].split('=')[0]}: the speed suite of real workloads" in err, err
    assert f"from a checkout of the guardtrain repository: {named} (the same options)" in err, err


def test_guardtrain_bench_help_points_to_the_suite(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.cli(["bench", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "runs from a checkout of the guardtrain repository: python -m benchmarks" in out
    assert "--compile-optimizer" not in out and "--no-fallback" not in out


def test_parsing() -> None:
    assert parse_workloads(["all"]) == list(WORKLOADS)
    assert parse_workloads(["rl-alternate,dpo-peft"]) == ["dpo-peft", "rl-alternate"]
    assert parse_suite_configs(None) == ["compile", "balanced", "aggressive", "turbo", "auto"]
    assert parse_suite_configs(["turbo,compile", "eager"]) == ["eager", "compile", "turbo"]
    with pytest.raises(GuardTrainValueError):
        parse_workloads([" , "])


def test_check_and_report_on_made_up_results() -> None:
    row = {
        "median_ms": 2.0,
        "round_ms": [2.0],
        "wall_ms": 2.5,
        "cpu_ms": 2.0,
        "timed": 4,
        "steady_timed": 4,
        "dynamo_compiles": {"warmup": 1, "rounds": 0},
    }
    slow = dict(row, median_ms=3.0, ratio=1.5, ratio_min=1.4, ratio_max=1.6)
    fast = dict(row, median_ms=1.8, ratio=0.9, ratio_min=0.85, ratio_max=0.95)
    data = {
        "torch": "x",
        "threads": 1,
        "date": "2026-12-03",
        "workloads": [
            {
                "workload": "a",
                "backend": "aot_eager",
                "configs": {"compile": row, "aggressive": slow, "turbo": fast},
            },
            {"workload": "b", "error": "RuntimeError: boom"},
            {"workload": "c", "skipped": "litgpt does not import"},
        ],
    }
    verdicts = check_suite(data)
    assert [(v["workload"], v["config"], v["met"]) for v in verdicts] == [
        ("a", "aggressive", False),
        ("a", "turbo", True),
        ("b", None, False),
    ]
    text = format_checks(verdicts)
    assert "a aggressive: 1.500 [1.400-1.600] x plain compile, limit 1.00: NOT met" in text
    assert "a turbo: 0.900 [0.850-0.950] x plain compile, limit 1.00: met" in text
    assert "b: NOT met (the workload raised)" in text
    table = format_suite(data)
    assert "b: error: RuntimeError: boom" in table
    assert "c: skipped: litgpt does not import" in table
