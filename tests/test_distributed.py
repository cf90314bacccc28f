"""Multi-process runs: rank-consistent guard decisions under DDP, FSDP and ModelParallel (H7).

Each run is ``tests/ddp_scripts/run.py`` started with ``subprocess`` (Lightning's
``ddp`` strategy re-runs the command line for the other ranks, which cannot
happen inside pytest). A run is made once per session and shared by the tests
that read it; every guarded run is compared with an uncompiled run of the same
command line (``backend="eager"``: bitwise). All runs are 2 processes on the
CPU (gloo), 30-40 steps of a tiny model, except ``test_gpu_sharded_strategy``
(FSDPStrategy needs CUDA, see :data:`FSDP_NEEDS_CUDA`, and ModelParallelStrategy
on NCCL), which ``scripts/gpu_check.sh`` runs on a GPU machine.

The rank-specific perturbations, all on rank 1 only (``PERTURB``):

* step 13: ``training_step`` cuts its batch (the per-batch check cannot see
  it; the compiled call under the stance misses and is retried);
* step 21: the dataloader yields a short batch (an uneven shard): an unseen
  signature. Rank 1's entry, made dynamic by the recompile after step 13,
  accepts it, so rank 1 stays in the stance on its own (H26); with guard
  collectives it costs rank 1 one batch with full guards instead;
* step 33: a callback switches the module to ``eval()`` for one step.

Each run's rank 1 is back in the stance between these steps, so each one hits
a rank in steady state while the other rank stays in it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
RUN = Path(__file__).resolve().parent / "ddp_scripts" / "run.py"
SUBPROCESS_TIMEOUT = 240
"""Seconds for one run; every collective in a run also times out (``--timeout``)."""

GUARD = ("--guard", "aggressive")
PERTURB = ("--slice", "1:13", "--short-batch", "1:21", "--eval", "1:33", "--max-steps", "40")
PERTURBED_STEPS = {13: "stance miss", 33: "training"}
MODEL_PARALLEL = ("--strategy", "model_parallel")

CONFIGS: dict[str, tuple[str, ...]] = {
    "ddp_eager": (),
    "ddp_guarded": GUARD,
    "ddp_eager_perturbed": PERTURB,
    "ddp_guarded_perturbed": GUARD + PERTURB,
    "ddp_collectives": (*GUARD, "--guard-collectives"),
    # A hang here must fail fast: every collective times out after 20 s.
    "ddp_collectives_perturbed": (*GUARD, *PERTURB, "--guard-collectives", "--timeout", "20"),
    "mp_eager": MODEL_PARALLEL,
    "mp_guarded_regional": (*MODEL_PARALLEL, *GUARD, "--targets", "backbone,head"),
    "mp_guarded_default": MODEL_PARALLEL + GUARD,
    "ddp_turbo_perturbed": ("--guard", "turbo", *PERTURB),
    "ddp_turbo_collectives": ("--guard", "turbo", "--guard-collectives"),
    "mp_turbo_regional": (*MODEL_PARALLEL, "--guard", "turbo", "--targets", "backbone,head"),
}

FSDP_NEEDS_CUDA = (
    "FSDPStrategy needs CUDA: Lightning refuses it with accelerator='cpu' (ValueError 'The "
    "strategy `fsdp` requires a GPU accelerator'), and torch's FSDP1 itself raises 'FSDP needs a "
    "non-CPU accelerator device' on a CPU-only machine. Run scripts/gpu_check.sh on a GPU machine."
)
REQUIRE_GPU = os.environ.get("GUARDTRAIN_GPU") == "1"

_CLUSTER_VARS = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "GUARDTRAIN_DISABLE",
)


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _CLUSTER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_", "PYTEST_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONHASHSEED"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks on two cores
    return env


@dataclass
class Run:
    """One finished (or killed) multi-process run and its result files."""

    name: str
    args: tuple[str, ...]
    out: Path
    returncode: int | None
    output: str
    seconds: float

    def ok(self) -> Run:
        if self.returncode == 0:
            return self
        errors = "".join(
            f"\n--- {p.name} ---\n{p.read_text()[-3000:]}"
            for p in sorted(self.out.glob("rank*.error.txt"))
        )
        what = "timed out" if self.returncode is None else f"exited with {self.returncode}"
        pytest.fail(
            f"run {self.name!r} {what} after {self.seconds:.0f} s\n"
            f"command: {RUN.name} OUT {' '.join(self.args)}\n"
            f"--- output (tail) ---\n{self.output[-6000:]}{errors}",
            pytrace=False,
        )

    def rank(self, r: int) -> dict[str, Any]:
        return json.loads((self.out / f"rank{r}.json").read_text())

    def weights(self, r: int) -> dict[str, Any]:
        return torch.load(self.out / f"rank{r}.pt")


class Runner:
    """Starts each named configuration once and keeps its result."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.runs: dict[str, Run] = {}

    def __call__(self, name: str, *extra: str) -> Run:
        key = " ".join((name, *extra))
        if key not in self.runs:
            self.runs[key] = self._start(key.replace(" ", "_"), (*CONFIGS[name], *extra))
        return self.runs[key]

    def _start(self, name: str, args: tuple[str, ...]) -> Run:
        out = self.base / name
        t0 = time.monotonic()
        # A session of our own: on a timeout the whole group (rank 0 and the
        # ranks Lightning started) is killed, not only rank 0.
        proc = subprocess.Popen(
            [sys.executable, str(RUN), str(out), *args],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            code = None
        return Run(name, args, out, code, output or "", time.monotonic() - t0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(tmp_path_factory.mktemp("distributed"))


def assert_same_run(eager: Run, guarded: Run, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Same losses on every rank at every step and the same final weights, bitwise."""
    for r in ranks:
        a, b = eager.weights(r), guarded.weights(r)
        for kind in ("train_losses", "val_losses"):
            assert len(a[kind]) == len(b[kind]), f"rank {r}: {kind} counts differ"
            for i, (x, y) in enumerate(zip(a[kind], b[kind])):
                assert torch.equal(x, y), f"rank {r}: {kind}[{i}] eager {x} vs guarded {y}"
        sa, sb = a["state_dict"], b["state_dict"]
        assert list(sa) == list(sb), f"rank {r}: state_dict keys differ"
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"rank {r}: weights differ at {key}"
    assert eager.weights(0)["state_dict"], "rank 0 saved no weights"


def own_rearms(info: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's re-arms, as its callback recorded them before the end of fit."""
    return [r for r in info["rearms_local"] if r.get("rank", info["rank"]) == info["rank"]]


# -- DDP: steady state, equality with an uncompiled run, the summary ------------------------------
# One guarded run (with rank 1's perturbations) answers these: before step 13 it is a plain run.


def test_ddp_both_ranks_reach_steady_state_together(runs: Runner) -> None:
    run = runs("ddp_guarded_perturbed").ok()
    infos = [run.rank(r) for r in (0, 1)]
    for info in infos:
        s = info["summary"]
        assert info["world_size"] == 2 and info["global_step"] == 40
        assert info["phase"] == "steady" and s["phase"] == "steady", s
        assert s["steady_steps"] > 0
        assert s["phases"]["validate"] == "steady"
        assert not info["stance_after_fit"], "the stance outlived fit"
        assert "1" not in info["collectives"], "guard collectives were on without being asked"
    # Entry is decided collectively: the stance starts at the same batch on every rank (H7).
    first = [info["first_stance_step"] for info in infos]
    assert first[0] is not None and first[0] == first[1] and first[0] < 13, first
    assert infos[0]["stance"][:13] == infos[1]["stance"][:13]


@pytest.mark.parametrize("perturbed", [False, True], ids=["plain", "perturbed"])
def test_ddp_weights_equal_an_uncompiled_run(runs: Runner, perturbed: bool) -> None:
    """The same losses and weights on both ranks, bitwise; also with rank 1's perturbations."""
    suffix = "_perturbed" if perturbed else ""
    eager, guarded = runs("ddp_eager" + suffix).ok(), runs("ddp_guarded" + suffix).ok()
    assert_same_run(eager, guarded)
    # DDP kept the ranks' parameters equal (buffers are per rank: plain BatchNorm).
    w0, w1 = guarded.weights(0)["state_dict"], guarded.weights(1)["state_dict"]
    for key in ("backbone.0.weight", "backbone.1.weight", "head.weight", "head.bias"):
        assert torch.equal(w0[key], w1[key]), key


@pytest.mark.parametrize("name", ["ddp_guarded", "ddp_guarded_perturbed"])
def test_ddp_summary_logged_once(runs: Runner, name: str) -> None:
    """Both ranks' output is captured: rank zero alone logs the summary, once."""
    run = runs(name).ok()
    assert run.output.count("guardtrain summary") == 1, run.output[-4000:]


# -- DDP: one rank changes alone ------------------------------------------------------------------


def test_ddp_rank_local_batch_shape_change(runs: Runner) -> None:
    """Rank 1 alone cuts a batch (step 13) and gets a short batch (step 21): no hang; a
    re-arm for the cut, none for the short batch that its dynamic entry accepts."""
    run = runs("ddp_guarded_perturbed").ok()
    r0, r1 = run.rank(0), run.rank(1)
    assert r0["global_step"] == r1["global_step"] == 40
    steps = {r["step"]: r["reason"] for r in own_rearms(r1)}
    # Dynamo's miss under the stance, or (turbo) its own guard evaluation, before the call.
    assert any(t in steps.get(13, "") for t in ("stance miss", "direct dispatch: no compiled")), (
        own_rearms(r1)
    )
    assert 21 not in steps, own_rearms(r1)
    assert own_rearms(r0) == [], "rank 0 saw no change and must not re-arm"
    # Rank 1 was in the stance at step 13 (or the check proved nothing), left it, came back.
    assert r1["stance"][13] == "1" and r1["stance"][14] == "0"
    # The short batch at step 21 stayed in the stance: the dynamic entry accepted it.
    assert r1["stance"][20] == "1" and r1["stance"][21] == "1" and r1["stance"][22] == "1"
    assert r1["summary"]["checked_batches"] >= 1, r1["summary"]
    # Rank 0 stayed in the stance through rank 1's re-arms.
    first = r0["first_stance_step"]
    assert set(r0["stance"][first:]) == {"1"}, r0["stance"]
    for info in (r0, r1):
        assert info["phase"] == "steady", info["summary"]


def test_ddp_rank_local_eval_step(runs: Runner) -> None:
    """Rank 1 alone runs one training step in eval mode (step 33): no hang, re-arm on rank 1."""
    run = runs("ddp_guarded_perturbed").ok()
    r0, r1 = run.rank(0), run.rank(1)
    assert r1["eval_fired"] and not r0["eval_fired"]
    steps = {r["step"]: r["reason"] for r in own_rearms(r1)}
    assert "training" in steps.get(33, ""), own_rearms(r1)
    assert r1["stance"][32] == "1" and r1["stance"][33] == "0"
    assert "1" in r1["stance"][34:], "rank 1 never went back to the stance"
    assert own_rearms(r0) == []


def test_ddp_rank_zero_summary_lists_every_ranks_rearms(runs: Runner) -> None:
    """(a) After fit, rank zero's summary holds rank 1's re-arms, each with its rank."""
    run = runs("ddp_guarded_perturbed").ok()
    rearms = run.rank(0)["summary"]["rearms"]
    assert all("rank" in r for r in rearms), rearms
    from_rank1 = {r["step"] for r in rearms if r["rank"] == 1}
    assert set(PERTURBED_STEPS) <= from_rank1, rearms
    assert not [r for r in rearms if r["rank"] == 0], rearms


# -- DDP: guard collectives ------------------------------------------------------------------------


def test_ddp_guard_collectives_same_weights(runs: Runner) -> None:
    """(b) guard_collectives=True: the same run; the hook is on at the same steps on both ranks,
    from the first collective entry on."""
    eager, run = runs("ddp_eager").ok(), runs("ddp_collectives").ok()
    assert_same_run(eager, run)
    assert run.rank(0)["collectives"] == run.rank(1)["collectives"]
    for r in (0, 1):
        info = run.rank(r)
        assert info["phase"] == "steady" and info["summary"]["steady_steps"] > 0
        assert "1" in info["collectives"], "guard collectives were never on"
        # On from the first collective entry (the lookup window before the stance
        # runs with full guards), and on whenever the stance is on.
        assert info["collectives"].index("1") <= info["stance"].index("1")
        assert all(c == "1" for c, st in zip(info["collectives"], info["stance"]) if st == "1")
        assert not info["collectives_after_fit"], "guard collectives outlived fit"


def test_ddp_guard_collectives_with_rank_local_changes(runs: Runner) -> None:
    """(b) guard_collectives=True and rank 1 changing alone: no hang, same weights as eager."""
    run = runs("ddp_collectives_perturbed").ok()
    assert_same_run(runs("ddp_eager_perturbed").ok(), run)
    assert run.rank(0)["collectives"] == run.rank(1)["collectives"]
    for r in (0, 1):
        assert not run.rank(r)["collectives_after_fit"]
        assert run.rank(r)["summary"]["steady_steps"] > 0


# -- turbo (H30) ----------------------------------------------------------------------------------


def test_ddp_turbo_runs_directly_and_equals_an_uncompiled_run(runs: Runner) -> None:
    """Turbo under DDP with rank 1's perturbations: bitwise equal, direct calls on both ranks,
    rank 1's changes caught as under `aggressive` (the cut batch, the eval step)."""
    run = runs("ddp_turbo_perturbed").ok()
    assert_same_run(runs("ddp_eager_perturbed").ok(), run)
    for r in (0, 1):
        s = run.rank(r)["summary"]
        assert s["phase"] == "steady" and s["direct_dispatch"]["on"], s["direct_dispatch"]
        assert s["direct_dispatch"]["calls"] > 0
    steps = {r["step"]: r["reason"] for r in own_rearms(run.rank(1))}
    assert 13 in steps and "training" in steps.get(33, ""), own_rearms(run.rank(1))
    assert own_rearms(run.rank(0)) == []


def test_ddp_turbo_refused_with_guard_collectives(runs: Runner) -> None:
    run = runs("ddp_turbo_collectives").ok()
    assert_same_run(runs("ddp_eager").ok(), run)
    for r in (0, 1):
        d = run.rank(r)["summary"]["direct_dispatch"]
        assert d["requested"] and not d["on"] and d["calls"] == 0, d
        assert "guard_collectives=True" in d["refused"]
    warned = run.output.count("direct dispatch (turbo) is refused: guard_collectives=True")
    assert warned == 1, "warned once, on rank zero"


def test_model_parallel_turbo_refused(runs: Runner) -> None:
    run = runs("mp_turbo_regional").ok()
    assert_same_run(runs("mp_eager").ok(), run)
    for r in (0, 1):
        d = run.rank(r)["summary"]["direct_dispatch"]
        assert not d["on"] and d["calls"] == 0 and "ModelParallelStrategy" in d["refused"], d


# -- ModelParallelStrategy (fully_shard) on the CPU ----------------------------------------------


def _switched_off_ift(summary: dict[str, Any], strategy: str) -> bool:
    return any(
        o["lever"].startswith("install_free_tensors") and strategy in o["why"]
        for o in summary["switched_off"]
    )


def test_model_parallel_regional_targets(runs: Runner) -> None:
    """(c) fully_shard'ed blocks as targets: steady on both ranks, no free tensors, same weights.

    With install_free_tensors left on (guardtrain before the switch-off), this
    run's losses differed from the uncompiled run's from step 2 on: FSDP2 swaps
    the sharded and unsharded parameters around every forward (H3).
    """
    eager, run = runs("mp_eager").ok(), runs("mp_guarded_regional").ok()
    assert_same_run(eager, run)
    for r in (0, 1):
        s = run.rank(r)["summary"]
        assert s["targets"] == ["backbone", "head"]
        assert s["phase"] == "steady" and s["steady_steps"] > 0, s
        assert _switched_off_ift(s, "ModelParallelStrategy"), s["switched_off"]
        assert s["levers"]["install_free_tensors"] is False


def test_model_parallel_default_target(runs: Runner) -> None:
    """(c) The LightningModule as target (its forward calls FSDP2 hooks): correct, no free tensors."""
    eager, run = runs("mp_eager").ok(), runs("mp_guarded_default").ok()
    assert_same_run(eager, run)
    for r in (0, 1):
        s = run.rank(r)["summary"]
        assert _switched_off_ift(s, "ModelParallelStrategy"), s["switched_off"]


# -- CUDA only: FSDPStrategy, and ModelParallelStrategy with NCCL ---------------------------------


def _cuda_devices(strategy: str) -> int:
    n = torch.cuda.device_count()
    if n == 0:
        if REQUIRE_GPU:
            pytest.fail("GUARDTRAIN_GPU=1 but torch sees no CUDA device")
        if strategy == "fsdp":
            pytest.skip(FSDP_NEEDS_CUDA)
        pytest.skip(
            "the CUDA (NCCL) variant of the ModelParallelStrategy test; the CPU (gloo) one "
            "runs above. Run scripts/gpu_check.sh on a GPU machine."
        )
    return min(n, 2)


@pytest.mark.parametrize(
    ("strategy", "label"), [("fsdp", "FSDPStrategy"), ("model_parallel", "ModelParallelStrategy")]
)
def test_gpu_sharded_strategy(runs: Runner, strategy: str, label: str) -> None:
    """FSDPStrategy / ModelParallelStrategy on 1-2 GPUs: correct, steady, no free tensors."""
    n = _cuda_devices(strategy)
    common = ("--strategy", strategy, "--accelerator", "gpu", "--devices", str(n))
    eager = runs("ddp_eager", *common).ok()
    extra = ("--targets", "backbone,head") if strategy == "model_parallel" else ()
    guarded = runs("ddp_eager", *common, *GUARD, *extra).ok()
    ranks = tuple(range(n))
    # FSDPStrategy saves a full state dict on rank 0 only; the other ranks' dicts are empty.
    assert_same_run(eager, guarded, ranks)
    for r in ranks:
        s = guarded.rank(r)["summary"]
        assert _switched_off_ift(s, label), s["switched_off"]
        assert s["steady_steps"] > 0, s
