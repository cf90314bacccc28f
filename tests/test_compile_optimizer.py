"""``compile_optimizer=True``: the optimizer step compiled as one frame and run directly
while nothing its guards read changed (H49, :mod:`guardtrain.compile.optimizer`).

Each run is compared step by step with the same loop whose step is compiled the plain way
(``torch.compile(opt.step)``), bitwise with ``aot_eager``, and with the eager optimizer
within Dynamo's rounding: the weights after every step. The changes full guards would
refuse are made mid-run: a scheduled float ``lr`` (which the step then serves directly),
a frozen parameter, gradients ``None`` on some steps, a new param group, a checkpoint
resume (``load_state_dict``), the state the first step creates, clipping. Lightning runs
with automatic and manual optimization.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import lightning as L
import pytest
import torch
from helpers import assert_restored, guard, guard_tuner, make_trainer
from torch import nn

from guardtrain.errors import GuardTrainValueError

AOT = {"backend": "aot_eager"}
STEPS = 14
WARMUP = {"warmup_steps": 2, "stable_steps": 1, "measure_lookup": False}
"""A short warm-up; no lookup window (its batches run the step with full guards too,
:func:`test_the_lookup_windows_hold_the_steps_saving`)."""


class Net(nn.Module):
    """Two branches: ``side`` is used on even steps only (its gradients are ``None`` on odd
    steps after ``zero_grad()``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.side = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        out = self.body(x)
        return out + self.side(x) if use_side else out


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01)
    return torch.optim.Adam(params, lr=0.01)


def make_schedule(name: str | None, opt: torch.optim.Optimizer) -> Any:
    if name == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if name == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.05, total_steps=STEPS + 2, cycle_momentum=False
        )
    return None


def loop(
    how: str,
    optimizer: str = "adam",
    schedule: str | None = None,
    change: Callable[[int, Net, torch.optim.Optimizer], None] | None = None,
    side_every: int = 1,
    clip: bool = False,
    scaler: bool = False,
    **tuner_kwargs: Any,
) -> tuple[list[list[torch.Tensor]], dict[str, Any] | None]:
    """``how``: ``"eager"``, ``"plain"`` (``torch.compile(opt.step)``, aot_eager) or a
    preset with ``compile_optimizer=True``. The weights after every step, the summary."""
    torch._dynamo.reset()
    model = Net()
    opt = make_optimizer(optimizer, model.parameters())
    sched = make_schedule(schedule, opt)
    step = torch.compile(opt.step, **AOT) if how == "plain" else opt.step
    scale = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    if scale is not None and how == "plain":
        opt.step = step  # type: ignore[method-assign]  # what the scaler calls
    tuner = None
    if how not in ("eager", "plain"):
        tuner = guard_tuner(
            model,
            how,
            compile_kwargs=AOT,
            compile_optimizer=True,
            optimizers=[opt],
            **{**WARMUP, **tuner_kwargs},
        )
    g = torch.Generator().manual_seed(1)
    weights = []
    with tuner if tuner is not None else torch.enable_grad():
        for i in range(STEPS):
            x = torch.randn(4, 8, generator=g)
            with tuner.step((x,)) if tuner is not None else torch.enable_grad():
                loss = model(x, use_side=i % side_every == 0).square().mean()
                (scale.scale(loss) if scale is not None else loss).backward()
                if scale is not None:
                    scale.unscale_(opt)
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                if scale is not None:
                    scale.step(opt)
                    scale.update()
                else:
                    step() if how == "plain" else opt.step()
                opt.zero_grad()
            if sched is not None:
                sched.step()
            if change is not None:
                change(i, model, opt)
            weights.append([p.detach().clone() for p in model.parameters()])
    return weights, tuner.summary() if tuner is not None else None


def assert_same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]], exact: bool) -> None:
    assert len(a) == len(b)
    for i, (wa, wb) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(wa, wb)):
            if exact:
                assert torch.equal(x, y), f"step {i}, parameter {j}: not bitwise equal"
            else:
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=f"step {i}, {j}")


def compare(preset: str = "aggressive", **kwargs: Any) -> dict[str, Any]:
    """The preset's run against plain compile (bitwise) and eager (allclose); its
    optimizer's summary."""
    plain, _ = loop("plain", **kwargs)
    eager, _ = loop("eager", **kwargs)
    got, s = loop(preset, **kwargs)
    assert s is not None
    assert_same(plain, got, exact=True)
    assert_same(eager, got, exact=False)
    assert_restored()
    (o,) = s["optimizers"]
    assert o["eager"] is None, o
    return o  # type: ignore[no-any-return]


def test_steps_run_directly_again_after_an_audit() -> None:
    """An audit's batch runs the step with full guards; the batches after it run it
    directly again (the full guards are put back at the next training batch)."""
    o = compare("aggressive", audit_every=4)
    audits = o["full_guard_steps"] - 2  # the first two steps: no state, then its creation
    assert audits >= 2, o
    assert o["direct_steps"] == STEPS - o["full_guard_steps"], o
    assert o["direct_steps"] >= STEPS - 2 - audits and o["direct_steps"] >= STEPS // 2, o


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
def test_steady_steps_run_directly(optimizer: str, preset: str) -> None:
    o = compare(preset, optimizer=optimizer)
    # The first step has no state, the second creates it (SGD's momentum buffer): then
    # every step runs the harvested entry directly.
    assert o["direct_steps"] >= STEPS - 2, o
    assert o["full_guard_steps"] <= 2 and o["compiles"] <= 2, o


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("schedule", ["lambda", "onecycle"])
def test_a_scheduled_float_lr_costs_one_recompile_and_runs_with_full_guards(
    optimizer: str, schedule: str
) -> None:
    """Dynamo recompiles at the second value and takes the lr as an input from then on. A
    step whose lr moved runs with Dynamo's full guards (no entry is harvested while the lr
    moves every step); it costs less than checking the moved value against the harvested
    entry and then running it directly."""
    o = compare(optimizer=optimizer, schedule=schedule)
    assert o["compiles"] <= 2, o
    assert o["full_guard_steps"] == STEPS and o["direct_steps"] == 0, o
    assert o["changes"].get("hyperparameters", 0) >= STEPS - 2, o  # the reason, told


def _warm_up_lr(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
    if i < 5:  # a warm-up that moves the lr after each of the first steps, then holds it
        for group in opt.param_groups:
            group["lr"] = 0.002 * (i + 2)


def test_steps_run_directly_again_once_the_lr_stops_moving() -> None:
    """A warm-up that stops moving the lr: the first step after it (nothing written since
    the step before) harvests the entry, and the steps after it run directly."""
    o = compare(change=_warm_up_lr)
    assert o["compiles"] <= 2, o
    assert o["direct_steps"] >= STEPS - 8, o
    assert o["full_guard_steps"] == STEPS - o["direct_steps"], o


def test_sgd_with_a_scheduled_float_lr_is_pinned_by_each_value() -> None:
    """SGD's update specialises on the float lr (``add_(alpha=-lr)``): every new value is
    a change that full guards refuse, as with plain compile, until Dynamo's recompile
    limit, where the step runs uncompiled, as plain compile then runs it. Never stale."""
    plain, _ = loop("plain", optimizer="sgd", schedule="lambda")
    got, s = loop("aggressive", optimizer="sgd", schedule="lambda")
    assert s is not None
    assert_same(plain, got, exact=True)
    (o,) = s["optimizers"]
    assert o["direct_steps"] == 0, o


def _freeze(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
    if i == 5:
        model.body[0].weight.requires_grad_(False)
    if i == 9:
        model.body[0].weight.requires_grad_(True)


def _add_group(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
    if i == 4:  # `side` trained with its own lr from now on
        side = set(map(id, model.side.parameters()))
        opt.param_groups[0]["params"] = [p for p in model.parameters() if id(p) not in side]
        opt.add_param_group({"params": list(model.side.parameters()), "lr": 0.003})


def _reload(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
    if i == 6:  # a checkpoint resume: the same values in new state tensors
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _hyper(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
    if i == 5:
        opt.param_groups[0]["betas"] = (0.8, 0.99)
    if i == 8:
        opt.param_groups[0]["weight_decay"] = 0.1


@pytest.mark.parametrize(
    ("change", "seen"),
    [
        (_freeze, "gradients None"),
        (_add_group, "param_groups"),
        (_reload, "param_groups"),
        (_hyper, "hyperparameters"),
    ],
)
def test_a_change_full_guards_refuse_runs_with_full_guards(
    change: Callable[..., None], seen: str
) -> None:
    o = compare(change=change)
    assert o["changes"].get(seen, 0) >= 1, o
    assert o["direct_steps"] >= STEPS - 6, o


def _state_by_hand(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
    if i == 6:  # a moment replaced by hand: zeros, in the transposed layout
        p = model.body[0].weight
        opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"].t()).t()


def test_a_state_tensor_assigned_by_hand_is_seen() -> None:
    """A write into ``opt.state[p]`` moves that parameter's state version: the step runs
    with full guards (Dynamo recompiles for the new strides), as plain compile."""
    o = compare(change=_state_by_hand)
    assert o["changes"].get("state", 0) >= 1, o


def _state_with_scheduled_lr(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
    if i == 6:  # a moment replaced by hand in the same layout, beside the schedule's lr
        p = model.body[0].weight
        opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])


def test_a_state_tensor_replaced_beside_a_scheduled_lr_is_never_served() -> None:
    """The lr moves every step, so every step runs with Dynamo's full guards; a state
    tensor replaced in the same step fails them (Dynamo holds state tensors by identity)
    and Dynamo recompiles, as plain compile does (``compare`` asserts it bitwise)."""
    o = compare(schedule="lambda", change=_state_with_scheduled_lr)
    assert o["direct_steps"] == 0 and o["compiles"] >= 3, o


def _same_lr(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:  # a scheduler that writes an unchanged lr every step:
        group["lr"] = float.fromhex((0.01).hex())  # a new float object (a new dict version)


def test_an_unchanged_lr_written_every_step_still_runs_directly() -> None:
    """A write that leaves every hyperparameter's value as it was (a constant schedule, a
    warm-up's end) is no change: the steps run the harvested entry directly."""
    o = compare(change=_same_lr)
    assert o["direct_steps"] >= STEPS - 3 and o["compiles"] <= 2, o
    assert "hyperparameters" not in o["changes"], o


def _state_beside_one_lr_write(lr: float) -> Callable[[int, Net, torch.optim.Optimizer], None]:
    def change(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
        if i == 6:  # one lr write and a moment replaced by hand, in the same step
            opt.param_groups[0]["lr"] = float.fromhex(lr.hex())  # a new object
            p = model.body[0].weight
            opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])

    return change


@pytest.mark.parametrize(("lr", "seen"), [(0.01, "state"), (0.02, "hyperparameters")])
def test_a_state_tensor_replaced_beside_an_lr_write_is_never_run_directly(
    lr: float, seen: str
) -> None:
    """The steps run directly before and after; the one after the write takes full guards
    whether the lr kept its value (the state is then what the check finds) or not, and
    Dynamo recompiles for the new state tensor, as plain compile does (``compare`` asserts
    it bitwise)."""
    o = compare(change=_state_beside_one_lr_write(lr))
    assert o["changes"].get(seen, 0) >= 1, o
    assert o["direct_steps"] >= STEPS - 6, o


def test_a_global_the_update_reads_changed_between_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module-level function of ``torch.optim.adam`` that the update calls
    (``_to_scalar``) replaced mid-run by one that doubles the lr: its namespace's version
    moves, the step takes full guards and Dynamo recompiles (its guard on the function
    fails), so the weights follow the new function, as under plain compile and eager."""
    import torch.optim.adam as adam

    original = adam._to_scalar

    def doubled(x: Any) -> Any:
        value = original(x)
        return value * 2 if isinstance(value, float) and value < 0.5 else value

    def change(i: int, model: Net, opt: torch.optim.Optimizer) -> None:
        if i == 6:
            monkeypatch.setattr(adam, "_to_scalar", doubled)

    def run(how: str, **kwargs: Any) -> tuple[list[list[torch.Tensor]], dict[str, Any] | None]:
        monkeypatch.undo()  # each run starts with torch's own function
        return loop(how, **kwargs)

    unchanged, _ = run("eager")
    eager, _ = run("eager", change=change)
    assert not any(torch.equal(a, b) for a, b in zip(eager[-1], unchanged[-1]))
    plain, _ = run("plain", change=change)
    got, s = run("aggressive", change=change)
    assert s is not None
    assert_same(plain, got, exact=True)
    assert_same(eager, got, exact=False)
    (o,) = s["optimizers"]
    assert o["changes"].get("globals", 0) >= 1, o


def test_the_step_is_a_target_of_the_run() -> None:
    """Installed and put back by ``PROCESS`` (listed while installed), its compiles counted
    with the targets' (``summary()["compiles"]``, the compile events), and in the lookup
    window's batches with full guards it runs with full guards too, so the window's
    lookups hold it."""
    from guardtrain.engine.process import PROCESS

    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tuner = guard_tuner(
        model,
        "turbo",
        compile_kwargs=AOT,
        compile_optimizer=True,
        optimizers=opt,
        measure_lookup=True,
    )
    g = torch.Generator().manual_seed(1)
    with tuner:
        assert any("compiled step of a Adam" in c for c in PROCESS.changed()), PROCESS.changed()
        for _ in range(STEPS):
            x = torch.randn(4, 8, generator=g)
            with tuner.step((x,)):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    assert_restored()
    s = tuner.summary()
    steps = [e for e in s["compile_events"] if e["target"] == "Adam.step"]
    assert steps and s["compiles"] >= len(steps) + 1, s["compile_events"]
    (o,) = s["optimizers"]
    # The first step, then the lookup window's batches with full guards (3 by default).
    assert o["full_guard_steps"] >= 1 + 3, o
    calls = s["lookup_calls"]
    # The window with full guards looked the step's frame up once a batch beside the
    # model's; the direct window looked up neither.
    assert calls["full_guards"]["lookups"] >= 2 * calls["full_guards"]["steps"], calls
    assert calls["steady"]["lookups"] == 0, calls


def test_gradients_none_on_some_steps_and_clipping() -> None:
    o = compare(side_every=2, clip=True)
    # Each switch between "side has gradients" and "side has none" is a change; both
    # entries are compiled once, and the step after each switch runs with full guards.
    assert o["changes"].get("gradients None", 0) >= STEPS // 2 - 2, o
    assert o["compiles"] <= 3, o


def test_grad_scaler_with_clipping() -> None:
    """``GradScaler``: scaled backward, ``unscale_`` in place, clipping, then the scaler
    calls ``opt.step()`` (when no gradient is inf), which runs directly."""
    o = compare(scaler=True, clip=True)
    assert o["direct_steps"] >= STEPS - 2, o


def test_resumed_from_a_checkpoint_gives_the_eager_weights(tmp_path: Any) -> None:
    """Two runs: the second loads the model and optimizer saved by the first, each with
    the step compiled; the weights match an eager run of all the steps."""
    eager, _ = loop("eager", schedule="lambda")
    torch._dynamo.reset()
    model = Net()
    opt = make_optimizer("adam", model.parameters())
    sched = make_schedule("lambda", opt)
    g = torch.Generator().manual_seed(1)
    got = []
    for part in (range(0, 7), range(7, STEPS)):
        if part.start:
            saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
            model = Net()
            opt = make_optimizer("adam", model.parameters())
            sched = make_schedule("lambda", opt)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
        tuner = guard_tuner(
            model,
            "aggressive",
            compile_kwargs=AOT,
            compile_optimizer=True,
            optimizers=opt,
            measure_lookup=False,
        )
        with tuner:
            for _ in part:
                x = torch.randn(4, 8, generator=g)
                with tuner.step((x,)):
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                sched.step()
                got.append([p.detach().clone() for p in model.parameters()])
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
            tmp_path / "ckpt.pt",
        )
        # The schedule moves the lr every step: full guards, the lr an input (no compile
        # per step), in the resumed run too.
        (o,) = tuner.summary()["optimizers"]
        assert o["full_guard_steps"] == len(part) and o["compiles"] <= 2, o
    assert_same(eager, got, exact=False)


def test_refused_optimizers_and_missing_optimizers() -> None:
    model = Net()
    lbfgs = torch.optim.LBFGS(model.parameters())
    refused = pytest.raises(GuardTrainValueError, match=r"cannot compile optimizer 0 \(LBFGS")
    with refused, guard_tuner(model, compile_optimizer=True, optimizers=[lbfgs]):
        pass
    assert "step" not in lbfgs.__dict__
    assert_restored()
    with pytest.raises(GuardTrainValueError, match=re.escape("needs `optimizers=`")):
        guard_tuner(model, compile_optimizer=True)
    opt = torch.optim.Adam(model.parameters())
    twice = pytest.raises(GuardTrainValueError, match="given twice")
    with twice, guard_tuner(model, compile_optimizer=True, optimizers=[opt, opt]):
        pass
    assert "step" not in opt.__dict__


def test_off_by_default_and_put_back_after_an_error() -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    with guard_tuner(model, optimizers=[opt]) as tuner:
        assert "step" not in opt.__dict__  # compile_optimizer=False: untouched
    assert tuner.summary()["optimizers"] == []
    boom = pytest.raises(RuntimeError, match="boom")
    with boom, guard_tuner(model, compile_optimizer=True, optimizers=[opt]):
        assert "step" in opt.__dict__
        raise RuntimeError("boom")
    assert "step" not in opt.__dict__
    assert_restored()


# -- Lightning -------------------------------------------------------------------------------


class LitNet(L.LightningModule):
    def __init__(
        self,
        manual: bool = False,
        change: Callable[..., None] | None = None,
        interval: str = "step",
    ) -> None:
        super().__init__()
        self.net = Net()
        self.automatic_optimization = not manual
        self.change = change
        self.interval = interval
        self.seen: list[list[torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (x,) = batch
        loss = self.net(x).square().mean()
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            opt.step()  # type: ignore[union-attr]
            if self.interval == "step":
                self.lr_schedulers().step()  # type: ignore[union-attr]
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append([p.detach().clone() for p in self.net.parameters()])
        if self.change is not None:
            self.change(batch_idx, self.net, self.trainer.optimizers[0])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


def lightning_run(
    manual: bool, preset: str | None, change: Callable[..., None] | None = None
) -> tuple[list[Any], dict[str, Any] | None]:
    """A one-epoch fit; with a ``change``, the lr is scheduled per epoch (it holds in the
    epoch, so the steps run directly and the change is what the check must see)."""
    torch._dynamo.reset()
    model = LitNet(manual, change, interval="step" if change is None else "epoch")
    callbacks = []
    if preset is not None:
        callbacks = [guard(preset, compile_kwargs=AOT, compile_optimizer=True, **WARMUP)]
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(4 * STEPS, 8, generator=g))
    L.seed_everything(0, verbose=False)
    make_trainer(callbacks, max_epochs=1).fit(
        model, torch.utils.data.DataLoader(data, batch_size=4)
    )
    return model.seen, callbacks[0].summary() if callbacks else None


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize(
    ("change", "seen"),
    [(None, None), (_freeze, "gradients None"), (_reload, "param_groups"), (_hyper, None)],
    ids=["scheduled-lr", "freeze", "load_state_dict", "hyperparameters"],
)
def test_lightning_optimization(
    manual: bool, change: Callable[..., None] | None, seen: str | None
) -> None:
    """A scheduled float lr (``interval="step"``: every step with full guards), and the
    changes of the loop tests made in ``on_train_batch_end`` (the lr scheduled per epoch:
    the steps run directly until the change): weights as eager's after every step."""
    eager, _ = lightning_run(manual, None, change)
    got, s = lightning_run(manual, "aggressive", change)
    assert s is not None
    assert_same(eager, got, exact=False)
    (o,) = s["optimizers"]
    assert o["optimizer"] == "Adam" and o["eager"] is None, o
    if change is None:
        assert o["direct_steps"] == 0 and o["compiles"] <= 2, o
    else:
        assert o["direct_steps"] >= STEPS - 6, o
    if seen is not None:
        assert o["changes"].get(seen, 0) >= 1, o
    assert_restored()


# -- the Hugging Face Trainer ----------------------------------------------------------------


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_hf_trainer_optimizer(tmp_path: Any, optim: str) -> None:
    """The Trainer's AdamW under its linear schedule (a float lr, a new value every step),
    through accelerate's optimizer wrapper: weights as eager's, every step with full
    guards (the lr moves every step) and the lr an input after one recompile. The
    fused AdamW (the Trainer's default) is one kernel that Dynamo will not trace: it runs
    uncompiled, and the summary says why."""
    pytest.importorskip("transformers")
    from hf_helpers import assert_same_weights, run_pair
    from hf_helpers import guard as hf_guard

    cb = hf_guard(compile_optimizer=True)
    eager, guarded = run_pair(tmp_path, cb, optim=optim)
    assert_same_weights(eager.model, guarded.model, atol=1e-4)
    (o,) = cb.summary()["optimizers"]
    assert o["optimizer"] == "AdamW", o
    if optim == "adamw_torch_fused":
        assert "fused" in (o["eager"] or ""), o
    else:
        assert o["eager"] is None and o["compiles"] <= 2 and o["direct_steps"] == 0, o
    inner = guarded.optimizer.optimizer  # accelerate's wrapper: its step is the class's again
    assert "step" not in inner.__dict__ or inner.__dict__["step"].__func__ is not _installed()
    assert_restored()


def _installed() -> Any:
    from guardtrain.compile import optimizer

    return optimizer._step


def test_one_live_run_at_a_time_compiles_an_optimizer() -> None:
    from guardtrain.errors import GuardTrainRuntimeError

    opt = torch.optim.Adam(Net().parameters())
    with guard_tuner(Net(), compile_optimizer=True, optimizers=[opt]):
        step = opt.__dict__["step"]
        second = guard_tuner(Net(), compile_optimizer=True, optimizers=[opt])
        taken = pytest.raises(GuardTrainRuntimeError, match="already compiled by another live")
        with taken, second:
            pass
        assert opt.__dict__["step"] is step  # the first run's, untouched
    assert "step" not in opt.__dict__
    assert_restored()


@pytest.mark.slow  # the bench's optimizer column: about 25 s here
def test_bench_optimizer_step(tmp_path: Any) -> None:
    """``guardtrain bench --optimizer-step``: the four configurations interleaved, their
    ratios to plain compile, and the compiled steps' summaries (timing is not tested). With
    a constant lr (``--no-schedule``) the steps run directly and the check is timed; with
    the default schedule every step runs with full guards and there is no check to time."""
    import json

    from guardtrain.bench.command import main
    from guardtrain.bench.optimizer import CONFIGS

    out = tmp_path / "opt.json"
    argv = ["--optimizer-step", "--tiny", "--backend", "aot_eager", "--steps", "3"]
    for scheduled in (False, True):
        extra = [] if scheduled else ["--no-schedule"]
        assert main([*argv, *extra, "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["clock"] == "cpu"  # one thread: the thread's CPU time decides
        assert [s["parameters"] for s in data["sizes"]] == [26, 50]  # 2 and 4 blocks
        for size in data["sizes"]:
            assert list(size["rows"]) == list(CONFIGS)
            assert size["rows"]["plain compile"]["ratio"] == 1.0
            assert all(row["median_us"] > 0 for row in size["rows"].values())
            assert size["plain_lookup_us"] > 0, size
            (direct,) = size["optimizers"]["guardtrain"]
            (full,) = size["optimizers"]["guardtrain, full guards"]
            assert full["direct_steps"] == 0, size["optimizers"]
            # Warm-up steps, one per round, and the check's and lookup's own gradients.
            assert full["full_guard_steps"] == 6 + 3 * 1, full
            if scheduled:
                assert size["check_us"] is None and size["check_share"] is None, size
                assert direct["direct_steps"] == 0, size["optimizers"]
            else:
                assert size["check_us"] > 0 and size["check_share"] > 0, size
                assert direct["direct_steps"] > 0, size["optimizers"]
    assert_restored()


class CountingSGD(torch.optim.Optimizer):
    """A custom optimizer whose state holds a Python counter that its update reads: Dynamo
    pins its value at first (an entry that never runs directly: the snapshot does not
    compare state values), then takes it as an input."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["count"] = state.get("count", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] / state["count"])
        return None


def test_a_custom_optimizer_with_plain_state_values_gives_the_eager_weights() -> None:
    def run(how: str) -> list[torch.Tensor]:
        torch._dynamo.reset()
        model = Net()
        opt = CountingSGD(model.parameters())
        tuner = None
        if how == "guard":
            tuner = guard_tuner(model, compile_kwargs=AOT, compile_optimizer=True, optimizers=opt)
        g = torch.Generator().manual_seed(1)
        with tuner if tuner is not None else torch.enable_grad():
            for _ in range(8):
                x = torch.randn(4, 8, generator=g)
                with tuner.step((x,)) if tuner is not None else torch.enable_grad():
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
        if tuner is not None:
            (o,) = tuner.summary()["optimizers"]
            assert o["full_guard_steps"] >= 3, o  # the entry that pinned count=1 never ran directly
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run("eager"), run("guard")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
