"""GuardTuner: plain PyTorch loops and Lightning Fabric, compared with uncompiled runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Net, assert_restored, guard_tuner, stance_on
from torch import nn

from guardtrain import GuardTuner
from guardtrain.errors import GuardTrainRuntimeError, GuardTrainValueError

ROOT = Path(__file__).resolve().parents[1]


def data(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 16 with a short last batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 0.5
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, n, 16)]


def train(model: nn.Module, tuner: GuardTuner | None, epochs: int = 3) -> list[torch.Tensor]:
    """A plain loop: training epochs and a validation pass after each; returns every loss."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train_data, val_data = data(100, 1), data(50, 2)
    losses: list[torch.Tensor] = []

    def step(batch: Any, fn: Any) -> None:
        if tuner is None:
            fn()
        else:
            with tuner.step(batch):
                fn()

    for _ in range(epochs):
        model.train()
        for batch in train_data:

            def fit_step(batch: Any = batch) -> None:
                loss = nn.functional.mse_loss(model(batch[0]), batch[1])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().clone())

            step(batch, fit_step)
        model.eval()
        with torch.no_grad():
            if tuner is not None:
                ctx = tuner.loop("validate")
                ctx.__enter__()
            for batch in val_data:

                def val_step(batch: Any = batch) -> None:
                    losses.append(nn.functional.mse_loss(model(batch[0]), batch[1]))

                step(batch, val_step)
            if tuner is not None:
                ctx.__exit__(None, None, None)
    model.train()
    return losses


def equal_runs(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"loss {i}: {x.item()} vs {y.item()}"


@pytest.mark.parametrize("preset", ["balanced", "aggressive", "turbo"])
def test_plain_loop_matches_eager_and_uses_the_stance(preset: str) -> None:
    torch.manual_seed(0)
    eager = Net()
    guarded = Net()
    guarded.load_state_dict(eager.state_dict())
    want = train(eager, None)
    with guard_tuner(guarded, preset) as tuner:
        got = train(guarded, tuner)
        assert tuner.phase == "steady"
    equal_runs(want, got)
    for (k, a), b in zip(eager.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), k
    s = tuner.summary()
    assert s["steady_steps"] > 0 and s["phases"]["validate"] == "steady"
    assert s["targets"] == ["<model>"]
    # The short last training batch left the stance at its first call, which no
    # compiled entry accepted (validation's short batch is seen in its first pass,
    # before validation may enter the stance).
    reasons = [r["reason"] for r in s["rearms"]]
    assert reasons == [
        "unseen batch signature ((4, 8) float32 cpu, (4, 1) float32 cpu): "
        "no compiled entry of '<model>' accepts its inputs"
    ]
    assert not any("stance miss" in r for r in reasons)
    assert_restored(guarded)


def test_nothing_left_changed_after_an_exception() -> None:
    net = Net()
    with pytest.raises(KeyError, match="boom"):  # noqa: SIM117 (the raise is the point)
        with guard_tuner(net, warmup_steps=1, stable_steps=1, measure_lookup=False) as t:
            for x, _ in data(64, 0):
                with t.step((x,)):
                    net(x)
            assert stance_on()
            raise KeyError("boom")
    assert_restored(net)


def test_misuse_raises() -> None:
    net = Net()
    tuner = guard_tuner(net)
    with pytest.raises(GuardTrainRuntimeError, match="outside `with GuardTuner"), tuner.step(None):
        pass
    with pytest.raises(GuardTrainValueError, match=r"`loop` must be one of \['train', "):
        tuner.loop("eval")
    with tuner:
        with pytest.raises(GuardTrainRuntimeError, match="steps do not nest"), tuner.step(None):  # noqa: SIM117
            with tuner.step(None):
                pass
        with pytest.raises(GuardTrainRuntimeError, match="loops do not nest"), tuner.loop("test"):  # noqa: SIM117
            with tuner.loop("validate"):
                pass
        with pytest.raises(GuardTrainRuntimeError, match="`with` blocks do not nest"), tuner:
            pass
    assert_restored(net)
    with pytest.raises(GuardTrainValueError, match="`preset` must be one of"):
        GuardTuner(net, "fast")  # type: ignore[arg-type]
    with pytest.raises(GuardTrainValueError, match="`model` must be an nn.Module"):
        GuardTuner("net")  # type: ignore[arg-type]


def test_an_eval_step_in_training_leaves_the_stance() -> None:
    """GuardTuner never calls eval(): a step whose flag differs from warm-up leaves first."""
    net = Net()
    with guard_tuner(net, warmup_steps=2, stable_steps=1) as t:
        batches = data(96, 0)
        for x, _ in batches[:4]:
            with t.step((x,)):
                net(x)
        assert t.phase == "steady"
        net.eval()
        x = batches[4][0]
        with t.step((x,)):
            got = net(x)
        net.train()
    net.eval()
    assert torch.equal(got, Net.forward(net, x))  # eval mode: no dropout, running stats
    reasons = [r["reason"] for r in t.summary()["rearms"]]
    assert "module.training is False in the train loop" in reasons


def test_fabric_single_process_matches_eager() -> None:
    lightning = pytest.importorskip("lightning")
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    eager = Net()
    net = Net()
    net.load_state_dict(eager.state_dict())
    want = train(eager, None)
    wrapped = fabric.setup(net)
    with guard_tuner(wrapped, fabric=fabric) as tuner:
        got = train(wrapped, tuner)
    equal_runs(want, got)
    s = tuner.summary()
    assert s["steady_steps"] > 0 and s["targets"] == ["<model>"]
    assert_restored(net)


@pytest.mark.distributed
def test_fabric_two_processes_enter_together(tmp_path: Path) -> None:
    out = tmp_path / "result"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "ddp_scripts" / "fabric_run.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result.{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert r["equal"], r
        assert r["steady_steps"] > 0 and r["phase"] == "steady"
    # Both ranks entered at the same step: their warm-up counts agree.
    assert results[0]["warmup_steps_taken"] == results[1]["warmup_steps_taken"]


@pytest.mark.parametrize("fabric", [False, True], ids=["plain", "fabric"])
def test_the_plain_loop_example_matches_the_run_without_guardtrain(fabric: bool) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("plain_loop", ROOT / "examples" / "plain_loop.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    extra = ["--fabric"] if fabric else []
    guarded = example.main(["--epochs", "2", *extra])
    plain = example.main(["--epochs", "2", "--no-guard", *extra])
    assert guarded == plain  # bitwise: the eager backend


def test_an_unseen_size_that_an_entry_accepts_stays_under_the_stance() -> None:
    """H26: once Dynamo made the batch dimension dynamic, a new size stays under the
    stance: its first call shows that the dynamic entry's guards accept it."""
    torch.manual_seed(0)
    net, twin = Net(), Net()
    twin.load_state_dict(net.state_dict())
    g = torch.Generator().manual_seed(3)
    sizes = [16] * 6 + [12] + [16] * 4 + [13, 16, 14, 16, 15, 16]
    batches = [torch.randn(n, 8, generator=g) for n in sizes]
    stance: list[bool] = []
    got: list[torch.Tensor] = []
    torch.manual_seed(1)
    with guard_tuner(net, measure_lookup=False) as tuner:
        for x in batches:
            with tuner.step((x,)):
                stance.append(stance_on())
                got.append(net(x).detach())
    torch.manual_seed(1)  # the same dropout masks: both runs draw in the same order
    for i, (a, x) in enumerate(zip(got, batches)):
        assert torch.equal(a, twin(x).detach()), f"batch {i}"
    s = tuner.summary()
    new_sizes = [i for i, n in enumerate(sizes) if n in (13, 14, 15)]
    assert [stance[i] for i in new_sizes] == [True, True, True]
    assert s["checked_batches"] == 3 and s["checked_calls"] == 3
    assert s["compiles"] == 2  # the first entry and the dynamic one for size 12
    reasons = [r["reason"] for r in s["rearms"]]
    assert reasons == [
        "unseen batch signature ((12, 8) float32 cpu): "
        "no compiled entry of '<model>' accepts its inputs"
    ]


def test_the_tuner_takes_the_callbacks_arguments() -> None:
    import inspect

    from guardtrain import GuardTuneCallback

    def params(fn: Any, skip: tuple[str, ...]) -> list[tuple[str, Any]]:
        return [
            (p.name, p.default)
            for p in inspect.signature(fn).parameters.values()
            if p.name not in skip
        ]

    assert params(GuardTuner.__init__, ("self", "model", "fabric", "optimizers")) == params(
        GuardTuneCallback.__init__, ("self",)
    )
