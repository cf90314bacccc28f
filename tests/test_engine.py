"""The engine without a Trainer: its agreements, its report, a run by hand."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from helpers import Net, assert_restored
from torch import nn

from guardtrain.engine import metrics
from guardtrain.engine.agreement import ReduceAgreement, SingleProcess, TorchDistributed
from guardtrain.engine.config import make_config
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.host import Host
from guardtrain.engine.phases import LOOPS, Loop, Phase, PhaseMachine


def test_loop_and_phase_enums_are_their_strings() -> None:
    assert LOOPS == ("train", "validate", "test", "predict")
    assert Loop.TRAIN == "train" and str(Loop.VALIDATE) == "validate"
    assert {"train": 1}[Loop.TRAIN] == 1 and Loop.TEST in {"test"}
    assert Phase.STEADY == "steady"
    m = PhaseMachine(warmup_steps=1, stable_steps=1, use_stance=True)
    m.rearm(Loop.TRAIN, step=1, reason="x")
    assert type(m.rearms[0]["loop"]) is str
    pickle.loads(pickle.dumps(m.rearms))


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
    assert metrics.metrics("steady", 3, 1) == {
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


def test_a_checkpoint_keeps_its_keys_and_an_older_one_loads() -> None:
    """``state_dict()``'s keys are the checkpoint format; one written by 0.1.0 (without
    ``full_guard_calls`` and ``state_swaps``) loads, those two at 0, and a run goes on
    from its counters."""
    engine = GuardEngine(make_config("aggressive", warmup_steps=1, stable_steps=1), Host())
    keys = ["preset", "compiles", "rearms", "warmup_steps_taken", "steady_steps"]
    keys += ["full_guard_calls", "state_swaps", "train_batches"]
    assert list(engine.state_dict()) == keys
    rearm = {"step": 4, "reason": "r", "loop": "train", "rank": 0}
    v010 = {"preset": "aggressive", "compiles": 3, "rearms": [rearm]}
    v010 |= {"warmup_steps_taken": 5, "steady_steps": 7, "train_batches": 12}
    engine.load_state_dict(v010)
    s = engine.summary()
    assert (s["compiles"], s["rearms"], s["warmup_steps_taken"], s["steady_steps"]) == (
        3,
        [rearm],
        5,
        7,
    )
    assert (s["full_guard_calls"], s["state_swaps"], engine.train_batches()) == (0, 0, 12)
    assert engine.state_dict() == {**v010, "full_guard_calls": 0, "state_swaps": 0}
    engine.load_state_dict({})  # older still: nothing kept
    assert engine.state_dict() == dict.fromkeys(keys, 0) | {"preset": "aggressive", "rearms": []}


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
