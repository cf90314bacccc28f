"""The engine's decisions, session and report, without a Trainer."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch
from helpers import Net, assert_restored
from torch import nn

from guardtrain.compile.stances import NO_STANCE
from guardtrain.engine import decisions, summary
from guardtrain.engine.agreement import ReduceAgreement, SingleProcess, TorchDistributed
from guardtrain.engine.config import make_config
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import LOOPS, Loop, Phase, PhaseMachine
from guardtrain.engine.process import PROCESS, stance_is_unsafe
from guardtrain.errors import GuardTrainRuntimeError


def test_next_and_due_checks() -> None:
    assert decisions.next_check(0, 4, None) == 4
    assert decisions.next_check(4, 4, 6) == 6
    assert decisions.next_check(7, None, None) == 1 << 62
    assert decisions.due_check(0, 4, 2) is None  # never before the first batch
    assert decisions.due_check(4, 4, 2) == decisions.CHECK_AUDIT  # an audit wins
    assert decisions.due_check(6, 4, 2) == decisions.CHECK_VERIFY
    assert decisions.due_check(5, 4, 2) is None
    assert decisions.due_check(8, None, None) is None


def test_audit_verdict() -> None:
    """H26: a compile in an audit batch with an unseen signature is for its new inputs."""
    assert decisions.audit_verdict(False, False) == decisions.AUDIT_CLEAN
    assert decisions.audit_verdict(False, True) == decisions.AUDIT_CLEAN
    assert decisions.audit_verdict(True, False) == decisions.AUDIT_REARM
    assert decisions.audit_verdict(True, True) == decisions.AUDIT_AGAIN
    # A compile that leaves a target unfit for the stance re-arms as before (H4, H5, H20).
    assert decisions.audit_verdict(True, True, "target 'net' has graph breaks") == (
        decisions.AUDIT_REARM
    )


def test_leave_reason() -> None:
    assert decisions.leave_reason("train", None, True) is None
    assert decisions.leave_reason("validate", None, False) is None
    assert decisions.leave_reason("train", "(4, 8) float32 cpu", True) == (
        "unseen batch signature (4, 8) float32 cpu"
    )
    assert decisions.leave_reason("train", None, False) == (
        "module.training is False in the train loop"
    )
    assert decisions.leave_reason("validate", None, True) == (
        "module.training is True in the validate loop"
    )
    # A plain loop compares with the flag the loop warmed up with.
    assert decisions.leave_reason("validate", None, True, warmed_training=True) is None
    assert decisions.leave_reason("train", None, True, warmed_training=False) is not None


class FakeTarget:
    def __init__(self, name: str, calls: int, breaks: bool, entries: int) -> None:
        self.name, self.calls, self.graph_breaks, self._entries = name, calls, breaks, entries

    def cache_entries(self) -> int:
        return self._entries


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        ([FakeTarget("a", 3, False, 1)], None),
        ([FakeTarget("a", 3, False, 0)], "no target has compiled code"),
        ([FakeTarget("a", 3, False, 1), FakeTarget("b", 2, False, 0)], "'b' ran uncompiled"),
        ([FakeTarget("a", 3, False, 1), FakeTarget("b", 0, False, 0)], None),  # never called
        ([FakeTarget("a", 3, True, 2)], "'a' has graph breaks"),
        ([FakeTarget("", 3, False, 8)], "'<model>' reached recompile_limit=8"),
        ([], None),
    ],
)
def test_blocker(targets: list[FakeTarget], expected: str | None) -> None:
    got = decisions.blocker(targets, recompile_limit=8)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got


def test_loop_and_phase_enums_are_their_strings() -> None:
    assert LOOPS == ("train", "validate", "test", "predict")
    assert Loop.TRAIN == "train" and str(Loop.VALIDATE) == "validate"
    assert {"train": 1}[Loop.TRAIN] == 1 and Loop.TEST in {"test"}
    assert Phase.STEADY == "steady"
    m = PhaseMachine(warmup_steps=1, stable_steps=1, use_stance=True)
    m.rearm(Loop.TRAIN, step=1, reason="x")
    assert type(m.rearms[0]["loop"]) is str
    pickle.loads(pickle.dumps(m.rearms))


def test_session_saves_sets_and_restores() -> None:
    cfg = torch._dynamo.config
    before = cfg.install_free_tensors
    plain = torch._dynamo.eval_frame._stance
    session = PROCESS.start_run("test")
    session.begin()
    session.set_config("install_free_tensors", not before)
    # The session hands out the stance values; it never sets the stance itself (H41).
    assert session.stances.plain is plain and not stance_is_unsafe()
    assert session.stances.unsafe.skip_guard_eval_unsafe
    assert session.stances.unsafe.stance == plain.stance
    session.restore()
    assert not stance_is_unsafe() and cfg.install_free_tensors is before
    torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    try:
        with pytest.raises(GuardTrainRuntimeError, match="already set when the run starts"):
            PROCESS.start_run("test").begin()
    finally:
        torch.compiler.set_stance("default")


def test_a_stance_the_user_set_is_never_replaced() -> None:
    """Under ``force_eager`` or ``fail_on_recompile`` the session has no stance to replace:
    steady calls run under the user's stance (NO_STANCE never matches torch's)."""
    for name in ("force_eager", "fail_on_recompile"):
        with torch.compiler.set_stance(name):
            session = PROCESS.start_run("test")
            session.begin()
            assert session.stances.plain is NO_STANCE and session.stances.unsafe is None
            session.restore()


def test_agreements() -> None:
    one = SingleProcess()
    assert one.all(True) and not one.any(False) and one.gather(3) == [3]
    assert isinstance(TorchDistributed.if_initialized(), SingleProcess)
    calls: list[tuple[bool, bool]] = []

    def reduce(flag: bool, all: bool = True) -> bool:
        calls.append((flag, all))
        return not flag if all else flag

    two = ReduceAgreement(reduce, world_size=2, rank=1, gather=lambda v: [v, v])
    assert two.all(True) is False and two.any(True) is True
    assert calls == [(True, True), (True, False)]
    assert two.gather("r") == ["r", "r"]


def test_report() -> None:
    assert summary.metrics("steady", 3, 1) == {
        "guard/phase": 2.0,
        "guard/compiles": 3.0,
        "guard/rearms": 1.0,
    }


def drive(engine: GuardEngine, net: nn.Module, batches: list[torch.Tensor], loop: str) -> list[Any]:
    outs = []
    engine.loop_start(loop)
    for x in batches:
        engine.batch_start(loop, (x,), net.training)
        outs.append(net(x))
        engine.batch_end(loop)
    engine.loop_end(loop)
    return outs


def test_engine_without_a_trainer() -> None:
    """The engine runs a training loop on its own: warm-up, stance, re-arm, restore."""
    messages: list[str] = []
    config = make_config(
        "aggressive",
        warmup_steps=2,
        stable_steps=1,
        compile_kwargs={"backend": "eager"},
        measure_lookup=False,  # a lookup window's steps run with full guards: not steady
    )
    engine = GuardEngine(config, Host(info=messages.append, warn=messages.append))
    net = Net()
    reference = Net()
    reference.load_state_dict(net.state_dict())
    engine.setup()
    engine.activate(net, root_by_default=True)
    xs = [torch.randn(3, 8) for _ in range(6)] + [torch.randn(2, 8)]
    with torch.no_grad():
        torch.manual_seed(0)
        got = drive(engine, net, xs, "train")
        torch.manual_seed(0)
        want = [reference(x) for x in xs]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    s = engine.summary()
    assert s["targets"] == ["<model>"] and s["steady_steps"] >= 3
    assert [r["reason"] for r in s["rearms"]] == [
        "unseen batch signature ((2, 8) float32 cpu): "
        "no compiled entry of '<model>' accepts its inputs"
    ]
    engine.finish()
    assert_restored(net)
    assert any("guardtrain summary" in m for m in messages)
    # The checkpointed state is plain: it loads with weights_only=True.
    buffer = io.BytesIO()
    torch.save({"guard": engine.state_dict(), "summary": engine.summary()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["guard"] == engine.state_dict()
    assert loaded["guard"]["rearms"][0]["loop"] == "train"


def test_setup_takes_the_runs_compile_options() -> None:
    """An adapter that takes over a framework's compile passes its options to ``setup``:
    that run compiles with them; the next run without them goes back to the arguments'."""
    config = make_config(
        "aggressive", warmup_steps=2, stable_steps=1, compile_kwargs={"backend": "inductor"}
    )
    engine = GuardEngine(config, Host(info=lambda m: None, warn=lambda m: None))
    net = Net()
    engine.setup(compile_kwargs={"backend": "eager", "dynamic": False})
    assert engine.config.compile_kwargs == {"backend": "eager", "dynamic": False}
    assert engine.config.preset == config.preset and engine.config is not config
    engine.activate(net, root_by_default=True)
    (target,) = engine.targets.installed
    assert target.code.compile_kwargs["backend"] == "eager"
    with torch.no_grad():
        drive(engine, net, [torch.randn(3, 8) for _ in range(4)], "train")
    engine.finish()
    assert_restored(net)
    engine.setup()
    assert engine.config is config  # the adapter's arguments again
    assert config.compile_kwargs == {"backend": "inductor"}  # never written


def test_direct_dispatch_is_off_when_every_target_is_refused() -> None:
    """H37: with each target refused (FSDP2's fully_shard), ``direct_dispatch["on"]`` is
    False; one target left is enough for True."""
    from guardtrain.engine.summary import _every_target_refused

    refused = [{"target": "blocks.0", "why": "sharded"}, {"target": "blocks.1", "why": "sharded"}]
    assert _every_target_refused(["blocks.0", "blocks.1"], refused) is True
    assert _every_target_refused(["blocks.0", "blocks.1", "head"], refused) is False
    assert _every_target_refused(["head"], []) is False
    assert _every_target_refused([], refused) is False  # nothing compiled yet
