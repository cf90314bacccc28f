"""Faults and bad input: exceptions anywhere leave no trace; every bad input fails clearly.

* an exception in a validation step, in another callback, or a
  ``KeyboardInterrupt`` while a loop runs under the stance: afterwards the
  stance, Dynamo's config and the modules' ``forward`` are as before ``fit``,
  and a second ``fit`` of the same model with the same callback equals an
  uncompiled run (``test_callback.py`` covers ``training_step`` and a
  ``KeyboardInterrupt`` in training);
* resuming from a checkpoint saved mid-epoch in the steady state;
* bad inputs, at construction and when the run starts, each with its error
  class and message (the table in the README lists them with these tests).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import conftest
import lightning as L
import pytest
import torch
from conftest import (
    EAGER,
    TinyModule,
    assert_restored,
    assert_same_run,
    compare,
    fit,
    loaders,
    make_trainer,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from guardtrain import (
    GuardTrainError,
    GuardTrainRuntimeError,
    GuardTrainTypeError,
    GuardTrainValueError,
    GuardTuneCallback,
)

guard = functools.partial(conftest.guard, measure_lookup=False)
"""The tests' callback, without the lookup window (its batches would shift the steps)."""


def stance_on() -> bool:
    return bool(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)


def refit_matches_eager(model: TinyModule, cb: GuardTuneCallback) -> None:
    """Fit the same model with the same callback again; it must equal an uncompiled twin."""
    twin = TinyModule()
    twin.load_state_dict(model.state_dict())
    model.train_losses.clear()
    model.val_losses.clear()
    model.train()  # Lightning leaves the model in eval mode after an exception in validation
    twin.train()
    fit(twin)
    fit(model, [cb])
    assert_same_run(twin, model)
    assert cb.summary()["steady_steps"] > 0
    assert_restored(model)


# -- exceptions ----------------------------------------------------------------------------


class ValidationBoom(TinyModule):
    """Raises in the first validation batch that runs under the stance."""

    def __init__(self, error: type[BaseException] = RuntimeError) -> None:
        super().__init__()
        self.armed = True
        self.error = error
        self.stance_at_raise: bool | None = None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.armed and not self.trainer.sanity_checking and stance_on():
            self.stance_at_raise = True
            self.armed = False
            raise self.error("boom in validation_step")
        super().validation_step(batch, batch_idx)


def test_exception_in_validation_step_under_the_stance() -> None:
    model = ValidationBoom()
    cb = guard()
    with pytest.raises(RuntimeError, match="boom in validation_step"):
        fit(model, [cb])
    assert model.stance_at_raise is True  # raised while validation ran under the stance
    assert cb.summary()["phases"]["validate"] == "steady"
    assert_restored(model)
    refit_matches_eager(model, cb)


def test_keyboard_interrupt_in_validation_under_the_stance() -> None:
    model = ValidationBoom(KeyboardInterrupt)
    cb = guard()
    with pytest.raises(SystemExit):  # Lightning 2.6 ends the run with exit code 1
        fit(model, [cb])
    assert model.stance_at_raise is True
    assert_restored(model)
    refit_matches_eager(model, cb)


class BatchEndBoom(L.Callback):
    """Another callback that raises in a hook, the first time training runs under the stance."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.stance_at_raise: bool | None = None

    def _maybe_raise(self, trainer: L.Trainer) -> None:
        if self.stance_at_raise is None and stance_on():
            self.stance_at_raise = True
            raise ValueError(f"boom in {self.hook}")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.hook == "on_train_batch_end":
            self._maybe_raise(trainer)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.hook == "on_train_batch_start":
            self._maybe_raise(trainer)


@pytest.mark.parametrize(
    ("hook", "before"),
    [("on_train_batch_end", False), ("on_train_batch_start", True)],
    ids=["batch_end_after_guard", "batch_start_before_guard"],
)
def test_exception_in_another_callback_under_the_stance(hook: str, before: bool) -> None:
    """Raised after the guard's batch-end hook, or before its batch-start hook (stance still on)."""
    model = TinyModule()
    cb = guard()
    boom = BatchEndBoom(hook)
    with pytest.raises(ValueError, match=f"boom in {hook}"):
        fit(model, [boom, cb] if before else [cb, boom])
    assert boom.stance_at_raise is True
    assert_restored(model)
    refit_matches_eager(model, cb)


def _profiling() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


class ProfilerBoom(L.Callback):
    """Raises in the first training batch that runs inside guardtrain's lookup window."""

    def __init__(self) -> None:
        self.raised = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.raised and _profiling():
            self.raised = True
            raise ValueError("boom in the lookup window")


def test_exception_inside_the_lookup_window_stops_the_profiler() -> None:
    assert not _profiling()
    model = TinyModule()
    cb = guard(measure_lookup=True)
    boom = ProfilerBoom()
    with pytest.raises(ValueError, match="boom in the lookup window"):
        fit(model, [cb, boom])
    assert boom.raised
    assert not _profiling()
    assert_restored(model)
    refit_matches_eager(model, cb)


class BadBatch(TinyModule):
    """In the first step under the stance the network gets an input of the wrong width."""

    stance_at_raise: bool | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if stance_on():
            x, y = batch
            self.stance_at_raise = True
            return nn.functional.mse_loss(self(torch.cat([x, x[:, :1]], dim=1)), y)
        return super().training_step(batch, batch_idx)


def test_wrong_input_under_the_stance_raises_what_torch_compile_raises() -> None:
    """Not Dynamo's stance error: the miss leaves the stance and tracing raises what plain
    ``torch.compile`` raises (a ``TorchRuntimeError`` naming the shapes)."""
    x = torch.randn(16, 9)
    with pytest.raises(RuntimeError) as plain:
        torch.compile(TinyModule(), backend="eager")(x)
    torch._dynamo.reset()
    model = BadBatch()
    cb = guard()
    with pytest.raises(RuntimeError) as info:
        fit(model, [cb])
    assert model.stance_at_raise is True
    assert type(info.value) is type(plain.value)
    assert "skip_guard_eval_unsafe" not in str(info.value)
    assert "must have same reduction dim" in str(info.value), str(info.value)[:1000]
    assert any("stance miss" in r["reason"] for r in cb.summary()["rearms"])
    assert_restored(model)
    model.__class__ = TinyModule
    refit_matches_eager(model, cb)


# -- resume mid-epoch ----------------------------------------------------------------------


def test_resume_from_a_mid_epoch_checkpoint_saved_in_the_steady_state(tmp_path: Any) -> None:
    """Checkpoint at step 10 (epoch 1, batch 3, steady); both resumed runs agree bitwise."""
    runs: dict[str, Any] = {}
    for name, callbacks in (("eager", []), ("guarded", [guard()])):
        ckpt = ModelCheckpoint(
            dirpath=tmp_path / name, every_n_train_steps=10, save_top_k=-1, filename="{step}"
        )
        L.seed_everything(0, verbose=False)
        model = TinyModule()
        fit(
            model,
            [*callbacks, ckpt],
            max_epochs=2,
            enable_checkpointing=True,
            default_root_dir=tmp_path / name,
        )
        runs[name] = model
    assert_same_run(runs["eager"], runs["guarded"])
    path = tmp_path / "guarded" / "step=10.ckpt"
    saved = torch.load(path, weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("GuardTuneCallback"))
    assert state["steady_steps"] > 0  # saved in the steady state
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert saved["epoch"] == 1 and 0 < progress["completed"] < 7  # mid-epoch

    resumed: dict[str, TinyModule] = {}
    phases: list[str] = []
    cb = guard()

    class Spy(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            phases.append(cb.phase)

    for name, callbacks in (("eager", []), ("guarded", [cb, Spy()])):
        L.seed_everything(0, verbose=False)
        trainer = make_trainer(callbacks, max_epochs=3, default_root_dir=tmp_path / name)
        train, val = loaders()
        model = TinyModule()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*resuming from a checkpoint.*")
            warnings.filterwarnings("ignore", ".*callbacks used to create the checkpoint.*")
            trainer.fit(model, train, val, ckpt_path=str(path))
        resumed[name] = model
    assert len(resumed["eager"].train_losses) > 0
    assert_same_run(resumed["eager"], resumed["guarded"])
    assert phases[0] == "warmup" and "steady" in phases
    assert_restored(resumed["guarded"])


# -- bad input when the run starts ---------------------------------------------------------


class OneNet(L.LightningModule):
    """A LightningModule that delegates to one network, `net` (the default target)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.train_losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.train_losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(nn.functional.mse_loss(self(x), y).detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _lm_compiled(m: OneNet) -> Any:
    return torch.compile(m, backend="eager")


def _net_compile(m: OneNet) -> OneNet:
    m.net.compile(backend="eager")
    return m


def _lm_compile(m: TinyModule) -> TinyModule:
    m.compile(backend="eager")
    return m


def _forward_compiled(m: TinyModule) -> TinyModule:
    m.forward = torch.compile(m.forward, backend="eager")  # type: ignore[method-assign]
    return m


def _net_forward_compiled(m: OneNet) -> OneNet:
    m.net.forward = torch.compile(m.net.forward, backend="eager")  # type: ignore[method-assign]
    return m


def _net_wrapped(m: OneNet) -> OneNet:
    m.net = torch.compile(m.net, backend="eager")  # type: ignore[assignment]
    return m


def _net_forward_lambda(m: OneNet) -> OneNet:
    inner = m.net
    m.net.forward = lambda x: nn.Sequential.forward(inner, x)  # type: ignore[method-assign]
    return m


class Aliased(OneNet):
    def __init__(self) -> None:
        super().__init__()
        self.alias = self.net


class WithList(OneNet):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])


def forwards(model: nn.Module) -> dict[str, Any]:
    return {n: m.__dict__.get("forward") for n, m in model.named_modules()}


@pytest.mark.parametrize(
    ("make", "kwargs", "took_over"),
    [
        (lambda: _net_compile(OneNet()), {}, ["net (nn.Module.compile)"]),
        (lambda: _lm_compile(TinyModule()), {}, ["<LightningModule> (nn.Module.compile)"]),
        (lambda: _forward_compiled(TinyModule()), {}, ["<LightningModule> (a compiled forward)"]),
        (lambda: _net_forward_compiled(OneNet()), {}, ["net (a compiled forward)"]),
        (lambda: _net_wrapped(OneNet()), {"targets": ["net"]}, ["net (torch.compile)"]),
    ],
    ids=[
        "net_dot_compile",
        "lightningmodule_dot_compile",
        "forward_eq_torch_compile",
        "net_forward_eq_torch_compile",
        "net_eq_torch_compile_net_as_target",
    ],
)
def test_users_own_compile_is_taken_over(
    make: Any, kwargs: dict[str, Any], took_over: list[str]
) -> None:
    """The user's own compile of a target is switched off for the run and put back after."""
    model = make()
    before = {
        n: (m.__dict__.get("forward"), m.__dict__.get("_compiled_call_impl"))
        for n, m in model.named_modules()
    }
    with pytest.warns(UserWarning, match="took over the compile of"):
        cb, _ = compare(make, lambda: guard(**kwargs), max_epochs=2)
    assert cb.summary()["took_over"] == took_over
    assert cb.summary()["steady_steps"] > 0 and cb.summary()["compiles"] >= 2
    fit(model, [guard(**kwargs)], max_epochs=1)
    after = {
        n: (m.__dict__.get("forward"), m.__dict__.get("_compiled_call_impl"))
        for n, m in model.named_modules()
    }
    assert after == before  # the user's compiles are back


@pytest.mark.parametrize(
    ("make", "kwargs", "error", "match"),
    [
        (lambda: _lm_compiled(OneNet()), {}, GuardTrainValueError, "compiled with torch.compile"),
        (
            lambda: _net_forward_lambda(OneNet()),
            {},
            GuardTrainTypeError,
            "instance attribute `forward` of type function",
        ),
        (OneNet, {"targets": ["nope"]}, GuardTrainValueError, "'nope' matches no submodule"),
        (
            Aliased,
            {"targets": ["net", "alias"]},
            GuardTrainValueError,
            "`targets` names the same module twice: 'net' and 'alias'",
        ),
        (WithList, {"targets": ["blocks"]}, GuardTrainValueError, "defines no `forward`"),
    ],
    ids=[
        "torch_compile_lightningmodule",
        "forward_not_a_method",
        "unknown_target",
        "aliased_module_named_twice",
        "target_without_forward",
    ],
)
def test_bad_model_is_refused_when_the_run_starts(
    make: Any, kwargs: dict[str, Any], error: type, match: str
) -> None:
    model = make()
    inner = getattr(model, "_orig_mod", model)
    before = forwards(inner)
    with pytest.raises(error, match=match):
        fit(model, [guard(**kwargs)], max_epochs=1)
    after = forwards(inner)
    # Lightning itself installs a compiled forward on the module passed as torch.compile(lm).
    if inner is model:
        assert after == before
    assert not any(getattr(f, "_guardtrain_target", None) for f in after.values())
    assert torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe is False
    assert torch._dynamo.config.install_free_tensors is False
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is False


class WrappedNet(OneNet):
    """``self.net = torch.compile(self.net)`` in ``__init__`` (H8's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="eager")  # type: ignore[assignment]
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss


def test_child_compiled_by_the_user_is_taken_over_by_default() -> None:
    """With ``targets=None`` the default rule looks through a child wrapped by
    ``torch.compile``: its original module is the target, compiled once by guardtrain
    (H29), not the LightningModule around the user's compiled net. Equal to eager."""
    L.seed_everything(0, verbose=False)
    eager = WrappedNet()
    fit(eager, max_epochs=2)
    L.seed_everything(0, verbose=False)
    model = WrappedNet()
    before = forwards(model)
    cb = guard()
    fit(model, [cb], max_epochs=2)
    assert cb.summary()["targets"] == ["net._orig_mod"]
    assert cb.summary()["took_over"] == ["net (torch.compile)"]
    assert len(eager.losses) == len(model.losses) > 0
    for a, b in zip(eager.losses, model.losses):
        assert torch.equal(a, b)
    assert forwards(model) == before


class NamedGuard(GuardTuneCallback):
    @property
    def state_key(self) -> str:
        return "NamedGuard"


def test_two_callbacks_on_one_target_are_refused() -> None:
    """Lightning refuses two callbacks with one state key; with distinct keys guardtrain does."""
    model = OneNet()
    with pytest.raises(RuntimeError, match="more than one stateful callback of type"):
        fit(model, [guard(), guard()], max_epochs=1)
    assert_restored(model)
    second = NamedGuard("aggressive", compile_kwargs=EAGER)
    with pytest.raises(GuardTrainRuntimeError, match="compiled by another GuardTuneCallback"):
        fit(model, [guard(), second], max_epochs=1)
    assert_restored(model)


def test_unsafe_stance_set_before_fit_is_refused() -> None:
    model = OneNet()
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    try:
        with pytest.raises(GuardTrainRuntimeError, match="already set when the run starts"):
            fit(model, [guard()], max_epochs=1)
        assert stance_on()  # the caller's stance is left as it was
    finally:
        torch.compiler.set_stance("default")
    assert_restored(model)


# -- bad constructor arguments not in test_arguments.py --------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"preset": "Balanced"}, GuardTrainValueError, r"`preset` must be one of"),
        (
            {"guard_filter": ["skip_all_nn_modules", "nope"]},
            GuardTrainValueError,
            r"unknown filter 'nope'",
        ),
        (
            {"guard_filter": ["skip_all_nn_modules", 3]},
            GuardTrainTypeError,
            r"`guard_filter` must be a filter name, a callable",
        ),
        ({"guard_filter": object()}, GuardTrainTypeError, r"`guard_filter` must be a filter name"),
        ({"warmup_steps": True}, GuardTrainTypeError, r"`warmup_steps` must be an int, got True"),
        ({"stable_steps": -2}, GuardTrainValueError, r"`stable_steps` must be >= 1, got -2"),
        ({"log_metrics": 1}, GuardTrainTypeError, r"`log_metrics` must be a bool"),
        ({"targets": b"net"}, GuardTrainTypeError, r"`targets` must be None, a name or a list"),
        ({"targets": {"net": 1}}, GuardTrainTypeError, r"`targets` must be None, a name"),
        (
            {"compile_kwargs": {"options": ["max_autotune"]}},
            GuardTrainTypeError,
            r"`compile_kwargs\['options'\]` must be a dict",
        ),
        (
            {"compile_kwargs": {"backend": "eager", "mode": "default"}},
            GuardTrainValueError,
            r"works only with backend='inductor'",
        ),
    ],
)
def test_more_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match) as info:
        GuardTuneCallback(**kwargs)
    assert isinstance(info.value, GuardTrainError)


def test_zero_warmup_steps_is_accepted() -> None:
    cb = GuardTuneCallback(warmup_steps=0)
    assert cb.settings.warmup_steps == 0


def test_mode_with_options_that_contradict_it() -> None:
    """No error: the mode is expanded into inductor options and explicit ``options`` win."""
    from guardtrain.compile import build_compile_kwargs
    from guardtrain.filters import keep_all

    cb = GuardTuneCallback(
        compile_kwargs={"mode": "max-autotune", "options": {"max_autotune": False}}
    )
    built = build_compile_kwargs(cb.compile_kwargs, keep_all)
    assert built["options"]["max_autotune"] is False
    assert "mode" not in built


# -- a torch without the needed API ----------------------------------------------------------


class _ConfigWithout:
    """``torch._dynamo.config`` as an older torch has it: without ``hidden``."""

    def __init__(self, real: Any, hidden: str) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_hidden", hidden)

    def __getattr__(self, name: str) -> Any:
        if name == self._hidden:
            raise AttributeError(name)
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == self._hidden:
            raise AttributeError(name)
        setattr(self._real, name, value)


def _compare_with_eager(cb: GuardTuneCallback) -> TinyModule:
    L.seed_everything(0, verbose=False)
    eager = TinyModule()
    fit(eager)
    L.seed_everything(0, verbose=False)
    guarded = TinyModule()
    fit(guarded, [cb])
    assert_same_run(eager, guarded)
    return guarded


def test_torch_without_skip_guard_eval_unsafe(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.compiler.set_stance

    def set_stance(stance: str = "default", *, force_backend: Any = None) -> Any:
        return real(stance, force_backend=force_backend)

    monkeypatch.setattr(torch.compiler, "set_stance", set_stance)
    cb = guard()
    with pytest.warns(UserWarning, match=r"use_stance is switched off: needs torch>=2.6"):
        model = _compare_with_eager(cb)
    monkeypatch.undo()
    assert_restored(model)
    s = cb.summary()
    assert s["phase"] == "off" and s["steady_steps"] == 0
    assert [o["lever"] for o in s["switched_off"]] == ["use_stance"]


def test_torch_without_recursive_dict_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        torch._dynamo,
        "config",
        _ConfigWithout(torch._dynamo.config, "use_recursive_dict_tags_for_guards"),
    )
    # Presets leave dict tags at torch's default (H22): only an explicit True asks for them.
    cb = guard(recursive_dict_tags=True)
    with pytest.warns(UserWarning, match=r"recursive_dict_tags is switched off: needs torch>=2.9"):
        model = _compare_with_eager(cb)
    monkeypatch.undo()
    assert_restored(model)
    s = cb.summary()
    assert s["levers"]["recursive_dict_tags"] is False
    assert [o["lever"] for o in s["switched_off"]] == ["recursive_dict_tags"]
    assert s["steady_steps"] > 0  # the other levers still work


def test_torch_without_the_named_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")
    with pytest.warns(UserWarning, match=r"'skip_all_nn_modules' needs torch>=2.8"):
        cb = guard()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = _compare_with_eager(cb)
    monkeypatch.undo()
    assert_restored(model)
    assert [o["lever"] for o in cb.summary()["switched_off"]] == ["guard_filter"]


def test_bug_torch_without_install_free_tensors_crashes_every_compiled_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """setup() switches the lever off with a warning on a torch without the config key,
    but the installed ``forward`` (compile.py, ``_make_wrapper``) still reads
    ``cfg.install_free_tensors`` on every call: ``AttributeError``. (Not reachable with
    the declared ``torch>=2.8``; the switch-off branch exists for it.)"""
    monkeypatch.setattr(
        torch._dynamo, "config", _ConfigWithout(torch._dynamo.config, "install_free_tensors")
    )
    cb = guard()
    with pytest.warns(UserWarning, match=r"install_free_tensors is switched off: needs torch>=2.8"):
        model = _compare_with_eager(cb)
    monkeypatch.undo()
    assert_restored(model)
    assert cb.summary()["levers"]["install_free_tensors"] is False
