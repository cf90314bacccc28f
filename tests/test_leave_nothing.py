"""Leave nothing behind (H45): a run that ends without its events, a second run on the same
model, take-overs reported and put back.

Every sequence runs twice, once without guardtrain, and the second run's losses are compared
bitwise (``aot_eager``) with the eager sequence's. What guardtrain may change in the process
(Dynamo's config and stance, the patched classes, the model's ``forward``s and hooks,
accelerate's dynamo plugin) is compared field by field with how the user left it.
"""

from __future__ import annotations

import dataclasses
import signal
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from helpers import Net, TinyModule, fit, guard, guard_tuner
from torch import nn
from torch.utils import hooks as torch_hooks

from guardtrain import GuardTuner
from guardtrain.engine import holders as runs
from guardtrain.errors import GuardTrainRuntimeError, GuardTrainTypeError

# -- what guardtrain may change, field by field ------------------------------------------------


def _hooks(module: nn.Module) -> dict[str, Any]:
    return {k: dict(v) for k, v in vars(module).items() if "hook" in k and isinstance(v, dict)}


def model_state(model: nn.Module) -> dict[str, Any]:
    """Each submodule's instance attributes that are not tensors or flags, and its hooks."""
    state: dict[str, Any] = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key == "training" or isinstance(value, (torch.Tensor, dict)):
                continue
            state[f"{name or '<root>'}.{key}"] = value
        state[f"{name or '<root>'}.<hooks>"] = _hooks(module)
    return state


def process_state() -> dict[str, Any]:
    """Dynamo's config and stance, and the classes and functions guardtrain patches."""
    from torch.nn.modules import module as module_module

    state: dict[str, Any] = {
        f"config.{k}": v for k, v in torch._dynamo.config.get_config_copy().items()
    }
    stance = torch._dynamo.eval_frame._stance
    state.update({f"stance.{k}": v for k, v in dataclasses.asdict(stance).items()})
    for owner in (nn.Module, nn.Parameter, torch_hooks.RemovableHandle):
        # Methods and descriptors (not torch's counters, such as RemovableHandle.next_id).
        state.update(
            {f"{owner.__name__}.{k}": v for k, v in vars(owner).items() if not isinstance(v, int)}
        )
    state.update(
        {f"nn.modules.module.{k}": v for k, v in vars(module_module).items() if callable(v)}
    )
    return state


def primed_state() -> dict[str, Any]:
    """:func:`process_state` after Dynamo's own first compile of a module: Dynamo adds
    attributes to ``nn.Module`` once per process, which no run puts back."""
    torch.compile(nn.Linear(2, 2), backend="eager")(torch.randn(1, 2))
    torch._dynamo.reset()
    return process_state()


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# -- the registry, without a framework -----------------------------------------------------------


class FakeRun:
    def __init__(self, owner: str, modules: list[nn.Module], live: bool) -> None:
        self.owner = owner
        self.modules = modules
        self.is_live = live
        self.released = 0

    def held_modules(self) -> list[nn.Module]:
        return self.modules

    def live(self) -> bool:
        return self.is_live

    def described(self) -> str:
        return f"{len(self.modules)} modules"

    def release_dead(self) -> None:
        self.released += 1
        self.modules = []


def test_a_dead_holder_is_released_and_a_live_one_refuses() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    registry = runs.Runs()
    dead = FakeRun("GuardTrainerCallback", [net[0]], live=False)
    live = FakeRun("GuardTuner", [net[1][0]], live=True)
    registry.hold(dead)
    registry.hold(live)
    me = FakeRun("GuardTuner", [], live=True)
    other_model = FakeRun("GuardTuneCallback", [nn.Linear(2, 2)], live=False)
    registry.hold(other_model)
    # Every run that is not live is released, on any model (its config is process-wide).
    released = registry.release_dead(me)
    assert sorted(released) == [
        ("GuardTrainerCallback", "1 modules"),
        ("GuardTuneCallback", "1 modules"),
    ]
    assert dead.released == other_model.released == 1 and live.released == 0
    assert registry.release_dead(me) == []  # released once
    # A live run on another part of the model is left alone.
    registry.refuse_live(me, net, ["0"], "GuardTuner", str)
    # The same module, one around it, or the root: refused, naming the adapter and the module.
    for names in (["1.0"], ["1"], [""]):
        with pytest.raises(GuardTrainRuntimeError, match=r"1\.0 is compiled by a GuardTuner"):
            registry.refuse_live(me, net, names, "GuardTuner", str)
    # Not the run itself, nor a live run's modules outside this root.
    registry.refuse_live(live, net, ["1.0"], "GuardTuner", str)
    registry.refuse_live(me, nn.Linear(2, 2), [""], "GuardTuner", str)


def test_the_registry_forgets_a_run_whose_engine_is_gone() -> None:
    import gc

    registry = runs.Runs()
    registry.hold(FakeRun("GuardTuner", [nn.Linear(2, 2)], live=False))
    gc.collect()
    assert list(registry._runs) == []


# -- GuardTuner ----------------------------------------------------------------------------------


def _tuner_steps(model: nn.Module, tuner: GuardTuner | None, n: int, stop_at: int = -1) -> list:
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(n):
        x = torch.randn(8, 8)
        if i == stop_at:
            raise KeyboardInterrupt
        if tuner is None:
            loss = model(x).square().mean()
        else:
            with tuner.step((x,)):
                loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.detach())
    return out


def _tuner_sequence(guarded: bool, same: bool) -> tuple[list, Net, list[GuardTuner]]:
    torch.manual_seed(0)
    model = Net()
    tuners = [guard_tuner(model, "aggressive") for _ in range(2)] if guarded else []
    first = tuners[0] if guarded else None
    with pytest.raises(KeyboardInterrupt):
        if first is None:
            _tuner_steps(model, None, 20, stop_at=9)
        else:
            with first:
                _tuner_steps(model, first, 20, stop_at=9)
    if first is not None:  # leaving the `with` block ended the run: nothing is left held
        assert not first.engine.active and "forward" not in vars(model)
    second = (tuners[0] if same else tuners[1]) if guarded else None
    if second is None:
        return _tuner_steps(model, None, 16), model, tuners
    with second:
        losses = _tuner_steps(model, second, 16)
    return losses, model, tuners


@pytest.mark.parametrize("same", [True, False], ids=["same-tuner", "new-tuner"])
def test_tuner_interrupted_then_run_again(same: bool) -> None:
    before = primed_state()
    eager, _, _ = _tuner_sequence(False, same)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, model, tuners = _tuner_sequence(True, same)
    assert not [w for w in caught if "ended without its end event" in str(w.message)]
    assert [x.item() for x in got] == [x.item() for x in eager]
    second = tuners[0] if same else tuners[1]
    assert second.summary()["phases"]["train"] == "steady"
    assert differences(before, process_state()) == []
    assert "forward" not in vars(model)


def test_two_live_tuners_on_one_model_are_refused() -> None:
    model = Net()
    with guard_tuner(model, "aggressive"):
        inner = guard_tuner(model, "aggressive")
        with pytest.raises(GuardTrainRuntimeError, match="the model is compiled by a GuardTuner"):
            inner.__enter__()
        model.eval()  # the live run is untouched: still eager-equal
        x = torch.randn(4, 8)
        with torch.no_grad():
            assert torch.equal(model(x), Net.forward(model, x))
        model.train()
    assert "forward" not in vars(model)


# -- Lightning -------------------------------------------------------------------------------------


class _StopAt(L.Callback):
    def __init__(self, batch: int, error: BaseException, in_exception: bool = False) -> None:
        self.batch = batch
        self.error = error
        self.in_exception = in_exception

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self.batch and not self.in_exception:
            raise self.error

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.in_exception:  # the callbacks after this one get no on_exception
            raise RuntimeError("on_exception of another callback") from exception

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self.in_exception and trainer.global_step == self.batch:
            raise self.error


@pytest.fixture
def _sigint_back() -> Any:
    """Lightning ignores SIGINT after a KeyboardInterrupt: put the handler back."""
    saved = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, saved)


def _lightning_sequence(kind: str, guarded: bool) -> tuple[list[float], TinyModule, list[Any]]:
    L.seed_everything(0, verbose=False)
    model = TinyModule()
    cbs = [guard("aggressive") for _ in range(2)] if guarded else []
    errors = {
        "interrupt": (KeyboardInterrupt(), False, SystemExit),
        "no-on-exception": (ValueError("boom"), True, RuntimeError),
    }
    error, in_exception, raised = errors[kind]
    stop = _StopAt(8, error, in_exception)
    with pytest.raises(raised):  # Lightning exits on a KeyboardInterrupt
        fit(model, [stop, *cbs[:1]], max_epochs=2)
    model.train_losses = []
    fit(model, cbs[1:], max_epochs=1)
    return [x.item() for x in model.train_losses], model, cbs


@pytest.mark.usefixtures("_sigint_back")
@pytest.mark.parametrize("kind", ["interrupt", "no-on-exception"])
def test_lightning_interrupted_then_fit_again(kind: str) -> None:
    before = primed_state()
    eager, _, _ = _lightning_sequence(kind, guarded=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, model, cbs = _lightning_sequence(kind, guarded=True)
    assert got == eager
    released = [str(w.message) for w in caught if "ended without its end event" in str(w.message)]
    # Lightning's on_exception restores its run; a callback that raised there before ours
    # left it holding the model, and the next run released it.
    assert len(released) == (kind == "no-on-exception"), released
    assert not cbs[0].engine.active
    assert cbs[1].summary()["phases"]["train"] == "steady"
    assert differences(before, process_state()) == []
    assert "forward" not in vars(model.backbone)


@pytest.mark.parametrize("adapter", ["lightning", "tuner"])
def test_errors_name_the_adapter_and_the_module(adapter: str) -> None:
    import functools

    model = TinyModule()
    model.head.forward = functools.partial(model.head.forward)  # type: ignore[method-assign]
    if adapter == "tuner":
        tuner = guard_tuner(model, targets=["head"])
        with pytest.raises(
            GuardTrainTypeError, match=r"Target `model\.head` has an instance attribute"
        ):
            tuner.__enter__()
        return
    with pytest.raises(
        GuardTrainTypeError, match=r"Target the LightningModule's `head` has an instance"
    ):
        fit(model, [guard(targets=["head"])], max_epochs=1)


@pytest.mark.usefixtures("_sigint_back")
def test_a_dead_run_whose_callback_was_dropped_is_still_released() -> None:
    """The model keeps a dead run's engine alive (its compiled ``forward``), so the registry
    still finds it when the callback and the Trainer are gone."""
    import gc

    L.seed_everything(0, verbose=False)
    model = TinyModule()
    stop = _StopAt(8, ValueError("boom"), in_exception=True)
    with pytest.raises(RuntimeError):
        fit(model, [stop, guard("aggressive")], max_epochs=2)
    assert "forward" in vars(model)  # the dead run still holds the LightningModule
    del stop
    gc.collect()
    with pytest.warns(UserWarning, match="GuardTuneCallback run that ended without its end"):
        fit(model, [guard("aggressive")], max_epochs=1)
    assert "forward" not in vars(model)
