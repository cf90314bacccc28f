"""The engine's parts one by one, with fakes and without torch.compile: the phase machine's
transitions, :class:`Repairs` and :class:`BatchChecks` on a :class:`Run` of fakes."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch

from guardtrain.compile import Miss, MissReason, grads
from guardtrain.engine import batch_checks as batch_checks_module
from guardtrain.engine import levers as _levers
from guardtrain.engine import repairs as repairs_module
from guardtrain.engine.agreement import SingleProcess
from guardtrain.engine.batch_checks import BatchChecks
from guardtrain.engine.changes import Action, Change, Found
from guardtrain.engine.config import make_config
from guardtrain.engine.host import Host
from guardtrain.engine.phases import PhaseMachine
from guardtrain.engine.process import PROCESS
from guardtrain.engine.repairs import Repairs
from guardtrain.engine.run import Run
from guardtrain.fingerprints import module_fingerprint
from guardtrain.profiling import CompileMonitor


class FakeTarget:
    """What the parts call on a compiled target, recorded."""

    def __init__(self, name: str = "", entries: int = 1, breaks: bool = False) -> None:
        self.name, self.calls, self.graph_breaks, self._entries = name, 1, breaks, entries
        self.done: list[Any] = []
        self.params: tuple[Any, ...] = ()
        self.code = types.SimpleNamespace(
            shared=False, members=[self], pattern=grads.pattern(()), live_entries=lambda: entries
        )
        self.reference = None
        self.handed_over: str | None = None
        self.under_stance = True
        self.direct_allowed = False
        self.mixed = False

    def set_under_stance(self, on: bool, stances: Any, keep: bool = False) -> None:
        self.done.append(("steady", on))

    def start_checking(self) -> None:
        self.done.append("check")

    def stop_checking(self) -> int:
        self.done.append("stop")
        return 2

    def take_reference(self) -> None:
        self.done.append("retake")

    def forget_reference(self) -> None:
        self.done.append("forget")

    def rebuild(self) -> None:
        self.done.append("rebuild")

    def cache_entries(self) -> int:
        return self._entries


class FakeAgreement(SingleProcess):
    def __init__(self, votes: bool) -> None:
        self.votes, self.asked = votes, 0

    def all(self, flag: bool) -> bool:
        self.asked += 1
        return flag and self.votes


def _run(*targets: FakeTarget, collective: bool = False, votes: bool = True) -> Run:
    config = make_config("aggressive", warmup_steps=1, stable_steps=1, audit_every=None)
    warned: list[str] = []
    host = Host(info=lambda _: None, warn=warned.append, agreement=FakeAgreement(votes))
    lv = config.levers
    machine = PhaseMachine(lv.warmup_steps, lv.stable_steps, True, collective)
    run = Run(
        config=config,
        host=host,
        levers=_levers.requested(config),
        targets=types.SimpleNamespace(installed=list(targets)),  # type: ignore[arg-type]
        machine=machine,
        monitor=CompileMonitor(),
        dynamo=PROCESS.start_run("test"),
    )
    run.dynamo.active = True
    run.state.active = True
    return run


def _parts(run: Run) -> tuple[Repairs, BatchChecks]:
    repairs = Repairs(run)
    return repairs, BatchChecks(run, repairs)


# -- the phase machine ---------------------------------------------------------------------


def test_every_transition_counts_a_change() -> None:
    m = PhaseMachine(warmup_steps=1, stable_steps=1, use_stance=True)
    m.batch_done("train", compiled=False)
    assert m.changes == 0  # a batch is no change
    m.enter("train")
    m.rearm("train", step=1, reason="x")
    m.resume("train")
    assert m.block("graph breaks") and not m.block("again")  # told once
    assert m.changes == 4 and m.blocked == "graph breaks"


def test_a_steady_step_counts_only_under_the_stance_throughout() -> None:
    m = PhaseMachine(warmup_steps=1, stable_steps=1, use_stance=True)
    m.batch_done("train", compiled=True)
    m.enter("train")
    m.batch_done("train", compiled=False, under_stance=True)
    m.batch_done("train", compiled=False, under_stance=False)  # a lookup window's batch
    state = m.loops["train"]
    assert (m.warmup_steps_taken, m.steady_steps, state.batches, state.since_compile) == (
        1,
        1,
        3,
        2,
    )
    assert state.warmed_once and type(m.steady_steps) is int


def test_the_signature_matcher_is_made_when_a_signature_repeats() -> None:
    m = PhaseMachine(warmup_steps=1, stable_steps=1, use_stance=True)
    batch = torch.zeros(4, 8)
    assert m.unseen("train", batch)[0] is True
    assert m.loops["train"].same is None  # a change makes no matcher
    assert m.unseen("train", batch)[0] is False
    same = m.loops["train"].same
    assert same is not None and same.signature is m.loops["train"].last_signature
    assert m.unseen("train", torch.zeros(5, 8))[0] is True
    m.rearm(None, step=3, reason="rebuilt")  # every signature must be seen again
    assert m.unseen("train", batch)[0] is True


# -- Repairs -------------------------------------------------------------------------------


def test_rearm_leaves_the_stance_and_records_why() -> None:
    t = FakeTarget("net")
    run = _run(t)
    repairs, _ = _parts(run)
    run.machine.enter("train")
    repairs.set_steady(True)
    run.lookup.start(4)
    repairs.rearm("train", "net: changed")
    assert t.done == [("steady", True), ("steady", False)]
    assert run.machine.phase("train") == "warmup" and run.lookup.measure is None
    assert run.machine.rearms == [{"step": 0, "reason": "net: changed", "loop": "train"}]


def test_set_steady_waits_for_the_runs_settings() -> None:
    t = FakeTarget()
    run = _run(t)
    run.dynamo.active = False
    Repairs(run).set_steady(True)
    assert t.done == [] and not run.state.stance_on


def test_a_miss_counts_its_change_stops_the_checks_and_rearms() -> None:
    t = FakeTarget("net", breaks=True)
    run = _run(t)
    repairs, _ = _parts(run)
    repairs.start_checking("(x: 4)")
    run.state.loop = "train"
    full_guards = repairs.on_miss(t, Miss(MissReason.UNSEEN_ARGUMENTS, "a new int"))
    assert full_guards is False  # never in the stance with graph breaks
    assert run.checks.checking is None and run.checks.checked_calls == 2
    assert run.state.caught.summary()["arguments"]["count"] == 1
    assert run.machine.rearms[0]["reason"] == "net: a new int"


def test_a_swap_under_fsdp_is_no_change_before_a_call() -> None:
    """FSDP swaps the parameter objects around every forward: without install_free_tensors
    the check before a call compares the hooks only, and nothing is done or counted."""
    t = FakeTarget("net")
    t.module = torch.nn.Linear(2, 2)
    t.reference = module_fingerprint(t.module)
    t.code.install_free_tensors = False
    vars(t).update(under_stance=True, tensor_attribute=None, check_assertions=lambda: (None, None))
    run = _run(t)
    run.state.swaps_parameters = "accelerate's FSDP"
    t.module.weight = torch.nn.Parameter(t.module.weight.detach().clone())  # FSDP's swap
    Repairs(run).on_change(t, "a module write")
    assert t.done == [] and run.machine.rearms == []
    assert run.state.caught.summary() == {}
    run.state.swaps_parameters = None  # without FSDP the same swap rebuilds
    Repairs(run).on_change(t, "a module write")
    assert t.done == ["forget", "rebuild"], t.done
    assert run.state.caught.summary()["parameters"]["count"] == 1


def test_a_caught_rebuild_rebuilds_and_rearms_every_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    t = FakeTarget("net")
    run = _run(t)
    found = Found(Action.REBUILD, Change.HOOKS, "hooks of 'net' changed")
    monkeypatch.setattr(repairs_module, "revalidate", lambda target, under, swaps: found)
    Repairs(run).on_change(t, "a hook")
    assert t.done == ["forget", "rebuild"]
    assert run.machine.rearms[0]["reason"] == "net: hooks of 'net' changed; recompiling"
    assert "loop" not in run.machine.rearms[0]  # every loop


def test_rebuilds_count_against_the_compile_margin_then_the_target_is_confined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rebuild counts the entries it drops (``summary()["compiled_again"]``); a rebuild
    that would leave no room in the margin for a hand-over is not made (H51)."""
    from guardtrain.engine.handover import COMPILE_MARGIN

    t = FakeTarget("net", entries=1)
    run = _run(t)
    run.config = dataclasses.replace(run.config, targets=["net"])  # no split: a hand-over
    found = Found(Action.REBUILD, Change.HOOKS, "a forward hook was added to 'net'")
    monkeypatch.setattr(repairs_module, "revalidate", lambda target, under, swaps: found)
    handed: list[str] = []
    monkeypatch.setattr(
        Repairs, "hand_over", lambda self, target, why, change=None: handed.append(why)
    )
    repairs = Repairs(run)
    for _ in range(COMPILE_MARGIN + 2):
        repairs.on_change(t, "a hook")
    rebuilds = COMPILE_MARGIN - 1  # one entry each, and room for a hand-over of one
    assert t.done.count("rebuild") == rebuilds, t.done
    assert run.ledger.spent["net"] == rebuilds
    assert handed and "past the margin" in handed[0], handed


# -- BatchChecks ---------------------------------------------------------------------------


def _steady(run: Run) -> None:
    run.machine.batch_done("train", compiled=False)
    run.machine.enter("train")


def test_an_unseen_signature_stays_steady_and_checks_its_calls() -> None:
    m = PhaseMachine(warmup_steps=1, stable_steps=1, use_stance=True)
    m.batch_done("train", compiled=False)
    m.enter("train")
    m.unseen("train", torch.zeros(4, 8))  # seen with full guards
    assert m.steady_batch("train", torch.zeros(4, 8), True, None) == (True, None, None)
    steady, check, leave = m.steady_batch("train", torch.zeros(5, 8), True, None)
    assert steady and check is not None and "5" in check and leave is None
    assert m.steady_batch("train", torch.zeros(5, 8), False, None) == (
        False,
        None,
        "module.training is False in the train loop",
    )


def test_with_paired_calls_an_unseen_signature_probes_and_resumes_alone() -> None:
    run = _run(FakeTarget(), collective=True)
    repairs, _ = _parts(run)
    m = run.machine
    m.paired = True  # guard collectives (setup sets it)
    _steady(run)
    steady, check, leave = m.steady_batch("train", torch.zeros(5, 8), True, None)
    assert (steady, check, m.probe) == (False, None, "train")
    assert leave is not None and leave.startswith("unseen batch signature")
    repairs.rearm("train", leave)
    assert m.phase("train") == "warmup"
    m.batch_done("train", compiled=False)
    assert m.phase("train") == "steady" and m.probe is None
    assert run.host.agreement.asked == 0  # no vote: this rank's cache served it
    m.steady_batch("train", torch.zeros(6, 8), True, None)
    repairs.rearm("train", "probe")
    m.batch_done("train", compiled=True)  # the probe compiled: warm-up again
    assert m.phase("train") == "warmup" and m.probe is None


def test_entry_is_blocked_once_with_a_warning() -> None:
    run = _run(FakeTarget("net", breaks=True))
    _, batches = _parts(run)
    run.machine.batch_done("train", compiled=False)
    batches.decide("train")
    batches.decide("train")
    assert run.machine.phase("train") == "warmup" and "graph breaks" in (run.machine.blocked or "")
    assert len(run.host.warn.__self__) == 1  # type: ignore[attr-defined]  # the list warned to


def test_entry_with_several_processes_is_every_ranks_vote() -> None:
    run = _run(FakeTarget("net"), collective=True, votes=False)
    _, batches = _parts(run)
    run.machine.batch_done("train", compiled=False)
    batches.decide("train")
    assert run.machine.phase("train") == "warmup" and run.host.agreement.asked == 1
    run.host.agreement.votes = True
    batches.decide("train")
    assert run.machine.phase("train") == "steady" and run.state.entered_together


@pytest.mark.parametrize(
    ("found", "done", "phase"),
    [
        (Found(Action.LEAVE, Change.MODULE_STATE, "self.p == 2"), [("steady", False)], "warmup"),
        (
            Found(Action.REBUILD, Change.HOOKS, "a hook"),
            ["forget", "rebuild", ("steady", False)],
            "warmup",
        ),
        (None, [], "steady"),
    ],
)
def test_the_boundary_acts_on_what_the_check_found(
    monkeypatch: pytest.MonkeyPatch, found: Found | None, done: list[Any], phase: str
) -> None:
    seen: list[bool] = []

    def check(target: Any, under_stance: bool, swaps: Any) -> Found | None:
        seen.append(under_stance)
        return found

    monkeypatch.setattr(batch_checks_module, "revalidate", check)
    t = FakeTarget("net")
    run = _run(t)
    repairs, batches = _parts(run)
    _steady(run)
    repairs.set_steady(True)
    t.done.clear()
    batches.boundary("train")
    assert t.done == done and run.machine.phase("train") == phase
    assert seen == [True]  # a steady loop: an unmatched assertion leaves the stance
