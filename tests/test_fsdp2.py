"""FSDP2 (``fully_shard``) on the CPU under GuardTuner: 2 processes over gloo (H37).

Each run is ``tests/ddp_scripts/fsdp2_run.py``, started once per session with
``subprocess.run(..., timeout=...)``: ``plain`` shards by hand over
``init_device_mesh("cpu", (2,))`` under ``torch.distributed.run``; ``fabric``
uses Fabric's ``ModelParallelStrategy`` (which starts rank 1 itself). Every run
trains a guarded net beside an uncompiled twin and gives rank 1 a batch 3 rows
short at step 12 (an uneven shard). Fabric's ``FSDPStrategy`` (FSDP1) is not run:
it refuses the CPU (``ValueError: ... FSDP is only available on GPU``), as
Lightning's does (tests/test_distributed.py, ``FSDP_NEEDS_CUDA``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_distributed import _env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "ddp_scripts" / "fsdp2_run.py"
REPO = SCRIPT.parents[2]
TIMEOUT = 240
"""Seconds for one run; each collective times out after 60 s (``--timeout``)."""
SHORT = ("--short-batch", "12")
REGIONAL = ("--targets", "blocks.0,blocks.1")

CONFIGS: dict[str, tuple[str, ...]] = {
    "plain_aggressive": ("plain", "--guard", "aggressive", *SHORT),
    "plain_auto_regional": ("plain", "--guard", "auto", *REGIONAL, *SHORT),
    "fabric_aggressive": ("fabric", "--guard", "aggressive", *SHORT),
    "fabric_turbo_regional": ("fabric", "--guard", "turbo", *REGIONAL, *SHORT),
    # A forward hook added mid-run, in the steady state: seen before the next call, as
    # without FSDP (only the fingerprint's hooks count under it).
    "plain_auto_hook": ("plain", "--guard", "auto", "--hook-at", "14"),
}
_results: dict[str, list[dict[str, Any]]] = {}


def run(name: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results of one configuration (run once per session)."""
    if name in _results:
        return _results[name]
    out = tmp_path_factory.mktemp(name)
    mode, *args = CONFIGS[name]
    launcher = [sys.executable]
    if mode == "plain":
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*launcher, str(SCRIPT), str(out), mode, *args]
    try:
        done = subprocess.run(
            command,
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{name}: timed out after {TIMEOUT} s (a hang?)\n{err.output}", pytrace=False)
    errors = "".join(p.read_text()[-3000:] for p in sorted(out.glob("rank*.error.txt")))
    if done.returncode != 0:
        pytest.fail(
            f"{name}: exited with {done.returncode}\n{done.stdout[-4000:]}\n"
            f"{done.stderr[-4000:]}{errors}",
            pytrace=False,
        )
    _results[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return _results[name]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_and_weights_equal_eager_on_both_ranks(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Bitwise the eager FSDP2 twin's losses at every step and weights at the end; steady."""
    for info in run(name, tmp_path_factory):
        assert info["steps"] == 24, info
        assert info["equal_losses"], info["losses"]
        assert info["equal_weights"], info["rank"]
        s = info["summary"]
        assert s["phase"] == "steady" and s["steady_steps"] > 0, s


@pytest.mark.parametrize("name", list(CONFIGS))
def test_install_free_tensors_switched_off(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    who = "FSDP2's fully_shard on FSDPNet" if name.startswith("plain") else "ModelParallelStrategy"
    for info in run(name, tmp_path_factory):
        s = info["summary"]
        assert s["levers"]["install_free_tensors"] is False, s["levers"]
        (off,) = [o for o in s["switched_off"] if o["lever"] == "install_free_tensors"]
        assert off["why"].startswith(who), off


def test_turbo_refused_per_sharded_target(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Plain fully_shard under ``auto`` (turbo's levers): each sharded target is refused by
    name; with all of them refused, direct dispatch is not on, no call ran directly, and
    ``auto`` says it chose aggressive's stance for them."""
    for info in run("plain_auto_regional", tmp_path_factory):
        d = info["summary"]["direct_dispatch"]
        assert d["requested"] is True and d["on"] is False, d
        assert [t["target"] for t in d["refused_targets"]] == ["blocks.0", "blocks.1"], d
        assert all("fully_shard" in t["why"] for t in d["refused_targets"]), d
        assert d["calls"] == 0
        auto = info["summary"]["auto"]
        assert auto["chose"] == "aggressive" and "fully_shard" in auto["why"], auto
        assert sorted(auto["targets"]) == ["blocks.0", "blocks.1"], auto


def test_turbo_refused_under_model_parallel(tmp_path_factory: pytest.TempPathFactory) -> None:
    for info in run("fabric_turbo_regional", tmp_path_factory):
        d = info["summary"]["direct_dispatch"]
        assert d["on"] is False and d["calls"] == 0, d
        assert "ModelParallelStrategy" in (d["refused"] or ""), d


def test_default_target_is_split_at_fsdp_hooks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The sharded root's forward breaks the graph at FSDP2's hooks: its parts compile."""
    for info in run("plain_aggressive", tmp_path_factory):
        assert info["summary"]["targets"] == ["inp", "blocks.0", "blocks.1", "out"], info


@pytest.mark.parametrize("name", [n for n, args in CONFIGS.items() if SHORT[0] in args])
def test_rank_specific_short_batch_does_not_hang(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Rank 1 alone gets a short batch at step 12: it leaves the stance for that batch and
    comes back; rank 0 stays in the stance; both ranks finish every step."""
    r0, r1 = run(name, tmp_path_factory)
    assert r0["steps"] == r1["steps"] == 24
    assert r1["stance"][11] == "1" and r1["stance"][12] == "0", r1["stance"]
    assert "1" in r1["stance"][13:], r1["stance"]
    assert r0["stance"][11:] == "1" * 13, r0["stance"]
    short = [r for r in r1["summary"]["rearms"] if r.get("step") == 12]
    assert short and "unseen batch signature ((5, 8)" in short[0]["reason"], short
