"""The Hugging Face ``Trainer`` leaves nothing behind (H45): a ``train()`` that a
KeyboardInterrupt cut (the ``Trainer`` has no exception event), a second run on the same
model, the Trainer's compile taken over, reported, and put back.

Each sequence also runs without guardtrain; the later run's losses are compared bitwise
(``aot_eager``). What guardtrain may change is compared field by field
(:func:`test_leave_nothing.differences`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_helpers import guard, losses, tiny_model, trainer_for
from test_leave_nothing import differences, model_state, primed_state
from transformers import TrainerCallback

from guardtrain import GuardTrainerCallback
from guardtrain import hf_accelerate as hfa
from guardtrain.engine.process import stance_is_unsafe

RELEASED = "ended without its end event"


class _Interrupt(TrainerCallback):  # type: ignore[misc]
    """KeyboardInterrupt in ``on_step_begin`` of one step: no event of the Trainer follows."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.done = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step and not self.done:
            self.done = True
            raise KeyboardInterrupt


class _StanceSpy(TrainerCallback):  # type: ignore[misc]
    """Whether the stance is set at each Trainer event, and around each model call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[bool] = []
        self.handles = [
            model.register_forward_pre_hook(lambda *a: self.seen.append(stance_is_unsafe())),
            model.register_forward_hook(lambda *a: self.seen.append(stance_is_unsafe())),
        ]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.seen.append(stance_is_unsafe())

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.seen.append(stance_is_unsafe())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _ours(model: torch.nn.Module, cb: Any) -> int:
    """The model's hooks that belong to ``cb``."""
    hooks = [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
    return sum(getattr(getattr(h, "func", None), "__self__", None) is cb for h in hooks)


def _sequence(tmp_path: Path, how: str, guarded: bool) -> dict[str, Any]:
    """``train()`` cut by a KeyboardInterrupt at step 10, then ``train()`` again: on the same
    Trainer, on a new Trainer with the same callback, or with a new callback."""
    model = tiny_model()
    first = guard() if guarded else None
    trainer = trainer_for(
        tmp_path / "first", [_Interrupt(10), *([first] if first else [])], model=model
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    held = bool(first and first.engine.active)
    second: Any = {"new-callback": guard(), "same-callback": first, "same-trainer": first}[how]
    second = second if guarded else None
    spy = _StanceSpy(model)
    callbacks = [spy, *([second] if second else [])]
    if how == "same-trainer":  # the Trainer has `first` already: only the spy is added
        trainer.add_callback(spy)
        again = trainer
    else:
        again = trainer_for(tmp_path / "again", callbacks, model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.train()
    spy.remove()
    return {
        "losses": losses(again)[-24:],
        "model": model,
        "first": first,
        "second": second,
        "held": held,
        "seen": spy.seen,
        "told": [str(w.message) for w in caught if RELEASED in str(w.message)],
    }


@pytest.mark.parametrize(
    "how",  # about 17 s each: the dead run released by another callback in the default run
    [
        "new-callback",
        *(pytest.param(h, marks=pytest.mark.slow) for h in ("same-callback", "same-trainer")),
    ],
)
def test_keyboard_interrupt_in_train_then_train_again(tmp_path: Path, how: str) -> None:
    eager = _sequence(tmp_path / "eager", how, guarded=False)
    got = _sequence(tmp_path / "guarded", how, guarded=True)
    assert got["losses"] == eager["losses"]
    assert got["held"], "the interrupted run still held the model"
    first, second, model = got["first"], got["second"], got["model"]
    # A new callback released the dead run (one warning); the same callback ended its own.
    assert len(got["told"]) == (how == "new-callback"), got["told"]
    assert "GuardTrainerCallback released it" in "".join(got["told"]) or how != "new-callback"
    assert not first.engine.active and not second.engine.active
    if how == "new-callback":
        assert _ours(model, first) == 0, "the dead run's hooks are still on the model"
    assert _ours(model, second) == 2
    # The stance is set only inside the targets' own compiled calls: never at the Trainer's
    # events, nor in the root model's hooks around its call.
    assert got["seen"] and not any(got["seen"])
    assert second.summary()["phases"]["train"] == "steady"
    second.release()
    if how == "new-callback":
        first.release()
    assert _ours(model, first) == _ours(model, second) == 0
    assert "forward" not in vars(model.transformer)


def test_two_live_runs_on_one_model_are_refused(tmp_path: Path) -> None:
    model = tiny_model()
    outer = guard()
    inner = guard()
    caught: list[BaseException] = []

    class _Nested(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 6 and not caught:
                nested = trainer_for(tmp_path / "inner", [inner], model=model, max_steps=2)
                try:
                    nested.train()
                except Exception as error:
                    caught.append(error)

    trainer = trainer_for(tmp_path / "outer", [outer, _Nested()], model=model, max_steps=10)
    trainer.train()
    assert len(caught) == 1
    assert (
        "`model.transformer` is compiled by a GuardTrainerCallback whose run is still "
        "going; GuardTrainerCallback cannot compile it too" in str(caught[0])
    )
    assert outer.summary()["phases"]["train"] == "steady"
    outer.release()
    inner.release()


# -- the Trainer's compile: reported, put back -----------------------------------------------


def test_took_over_names_the_trainers_compile_with_backend_and_mode(tmp_path: Path) -> None:
    cb = GuardTrainerCallback("aggressive", warmup_steps=4, stable_steps=2)
    with pytest.warns(UserWarning, match="took over the Trainer's compile"):
        trainer = trainer_for(
            tmp_path, [cb], torch_compile=True, torch_compile_backend="aot_eager", max_steps=8
        )
    trainer.train()
    told = "the Trainer's torch_compile (TorchDynamoPlugin, backend 'aot_eager', mode 'default')"
    assert cb.summary()["took_over"] == [told]
    assert f"took over        {told}" in cb.format_summary()
    cb.release()


def test_took_over_label_for_regional_compilation() -> None:
    from accelerate.utils import TorchDynamoPlugin

    plugin = TorchDynamoPlugin(
        backend="inductor", mode="max-autotune", use_regional_compilation=True
    )
    taken = hfa.take_over(type("State", (), {"dynamo_plugin": plugin})(), {}, set())
    assert taken is not None
    assert hfa.took_over_label(taken) == (
        "accelerate's regional compilation (TorchDynamoPlugin, backend 'inductor', "
        "mode 'max-autotune')"
    )
    assert str(plugin.backend.value).lower() == "no"


def _plugin_fields(trainer: Any) -> dict[str, Any]:
    return dict(vars(trainer.accelerator.state.dynamo_plugin))


def _raise_at(step: int) -> TrainerCallback:
    class _Raise(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == step:
                raise ValueError("boom")

    return _Raise()


@pytest.mark.parametrize("ending", ["finished", "raised", "dead-run-released"])
def test_release_puts_back_every_field(tmp_path: Path, ending: str) -> None:
    compiled = {"torch_compile": True, "torch_compile_backend": "aot_eager", "max_steps": 8}
    user_left = _plugin_fields(trainer_for(tmp_path / "plain", **compiled))  # as accelerate made it
    eager_model = tiny_model()
    eager_before = model_state(eager_model)
    trainer_for(tmp_path / "eager", model=eager_model, max_steps=8).train()
    by_the_trainer = differences(eager_before, model_state(eager_model))  # accelerate's marks
    model = tiny_model()
    before, model_before = primed_state(), model_state(model)
    cb = GuardTrainerCallback("aggressive", warmup_steps=4, stable_steps=2)
    extra = [_raise_at(6)] if ending != "finished" else []
    if ending == "dead-run-released":
        extra = [_Interrupt(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_for(tmp_path / "a", [cb, *extra], model=model, **compiled)
        try:
            trainer.train()
        except (ValueError, KeyboardInterrupt):
            assert ending != "finished"
        callbacks = [cb]
        if ending == "dead-run-released":
            callbacks.append(GuardTrainerCallback("aggressive", warmup_steps=4, stable_steps=2))
            trainer = trainer_for(tmp_path / "b", callbacks[1:], model=model, **compiled)
            trainer.train()
    if ending == "finished":
        # Between runs only the two hooks on the model and the plugin's backend differ.
        between = differences(model_before, model_state(model))
        assert sorted({*by_the_trainer, "<root>.<hooks>"}) == between, between
        assert differences(user_left, _plugin_fields(trainer)) == ["backend"]
    for callback in callbacks:
        callback.release()
    assert differences(before, primed_state()) == []
    assert differences(model_before, model_state(model)) == by_the_trainer
    assert differences(user_left, _plugin_fields(trainer)) == []
