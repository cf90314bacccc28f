"""The phase machine, without a Trainer."""

from __future__ import annotations

import pytest

from guardtrain.engine.phases import PhaseMachine


def test_training_needs_warmup_and_stable_batches() -> None:
    m = PhaseMachine(warmup_steps=4, stable_steps=2, use_stance=True)
    for compiled in (True, False, True, False):
        m.batch_done("train", compiled)
    assert not m.ready("train")  # 4 batches, but the 3rd compiled: only 1 stable batch
    m.batch_done("train", False)
    assert m.ready("train")
    m.enter("train")
    assert m.steady("train") and not m.ready("train")
    assert m.warmup_steps_taken == 5
    m.batch_done("train", False)
    assert m.steady_steps == 1


def test_rearm_needs_only_stable_steps_again() -> None:
    m = PhaseMachine(warmup_steps=3, stable_steps=2, use_stance=True)
    for _ in range(3):
        m.batch_done("train", False)
    m.enter("train")
    m.rearm("train", step=3, reason="x")
    assert m.phase("train") == "warmup"
    assert m.rearms == [{"step": 3, "reason": "x", "loop": "train"}]
    m.batch_done("train", True)
    m.batch_done("train", False)
    assert not m.ready("train")
    m.batch_done("train", False)
    assert m.ready("train")


def test_eval_loops_need_a_complete_clean_pass() -> None:
    m = PhaseMachine(warmup_steps=0, stable_steps=1, use_stance=True)
    m.pass_started("validate")
    m.batch_done("validate", True)
    m.pass_done("validate", complete=True)
    assert not m.ready("validate")
    m.pass_started("validate")
    m.batch_done("validate", False)
    m.pass_done("validate", complete=False)  # the sanity check does not count
    assert not m.ready("validate")
    m.pass_started("validate")
    m.batch_done("validate", False)
    m.pass_done("validate", complete=True)
    assert m.ready("validate")


def test_rearm_all_loops() -> None:
    m = PhaseMachine(warmup_steps=0, stable_steps=1, use_stance=True)
    m.enter("train")
    m.enter("validate")
    m.rearm(None, step=7, reason="parameter replaced")
    assert m.phase("train") == m.phase("validate") == "warmup"
    assert m.rearms == [{"step": 7, "reason": "parameter replaced"}]


def test_off_without_stance() -> None:
    m = PhaseMachine(warmup_steps=0, stable_steps=1, use_stance=False)
    m.batch_done("train", False)
    assert m.phase("train") == "off" and not m.ready("train")


@pytest.mark.parametrize(
    ("batches", "expected"), [(3, False), (4, True), (5, False), (6, True), (8, True)]
)
def test_collective_decision_points(batches: int, expected: bool) -> None:
    m = PhaseMachine(warmup_steps=4, stable_steps=2, use_stance=True, collective=True)
    for _ in range(batches):
        m.batch_done("train", False)
    assert m.is_decision_point("train") is expected
    assert m.is_decision_point("validate")


def test_signatures() -> None:
    m = PhaseMachine(warmup_steps=0, stable_steps=1, use_stance=True)
    assert m.new_signature("train", ("a",))
    assert not m.new_signature("train", ("a",))
    assert m.new_signature("validate", ("a",))
