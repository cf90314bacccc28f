"""Faults while a run is under the stance: exceptions anywhere leave no trace; resuming works.

* an exception in a validation step, in another callback, inside the lookup
  window, or a ``KeyboardInterrupt`` while a loop runs under the stance: afterwards
  the stance, Dynamo's config and the modules' ``forward`` are as before ``fit``,
  and a second ``fit`` of the same model with the same callback equals an
  uncompiled run (``test_callback.py`` covers ``training_step`` and a
  ``KeyboardInterrupt`` in training);
* a wrong input under the stance raises what plain ``torch.compile`` raises;
* resuming from a checkpoint saved mid-epoch in the steady state.

The bad inputs are in ``test_faults_models.py`` (models refused or taken over when
the run starts), ``test_arguments.py`` (constructor arguments) and
``test_faults_torch.py`` (a torch without a named filter).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    PhaseSpy,
    TinyModule,
    assert_restored,
    assert_same_run,
    fit,
    guard,
    guard_without_lookup,
    left_the_stance,
    loaders,
    make_trainer,
    stance_on,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from guardtrain import GuardTuneCallback


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
    cb = guard_without_lookup()
    with pytest.raises(RuntimeError, match="boom in validation_step"):
        fit(model, [cb])
    assert model.stance_at_raise is True  # raised while validation ran under the stance
    assert cb.summary()["phases"]["validate"] == "steady"
    assert_restored(model)
    refit_matches_eager(model, cb)


def test_keyboard_interrupt_in_validation_under_the_stance() -> None:
    model = ValidationBoom(KeyboardInterrupt)
    cb = guard_without_lookup()
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
    cb = guard_without_lookup()
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
    cb = guard(measure_lookup=True, direct_dispatch=False)  # turbo profiles no window
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
    cb = guard_without_lookup()
    with pytest.raises(RuntimeError) as info:
        fit(model, [cb])
    assert model.stance_at_raise is True
    assert type(info.value) is type(plain.value)
    assert "skip_guard_eval_unsafe" not in str(info.value)
    assert "must have same reduction dim" in str(info.value), str(info.value)[:1000]
    assert any(left_the_stance(r["reason"]) for r in cb.summary()["rearms"])
    assert_restored(model)
    model.__class__ = TinyModule
    refit_matches_eager(model, cb)


# -- resume mid-epoch ----------------------------------------------------------------------


def test_resume_from_a_mid_epoch_checkpoint_saved_in_the_steady_state(tmp_path: Any) -> None:
    """Checkpoint at step 10 (epoch 1, batch 3, steady); both resumed runs agree bitwise."""
    runs: dict[str, Any] = {}
    for name, callbacks in (("eager", []), ("guarded", [guard_without_lookup()])):
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
    cb = guard_without_lookup()
    spy = PhaseSpy(cb)
    for name, callbacks in (("eager", []), ("guarded", [cb, spy])):
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
    assert spy.phases[0] == "warmup" and "steady" in spy.phases
    assert_restored(resumed["guarded"])
