"""Recursive dict tags stay at torch's default unless the user asks (H22, pytorch#181873)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from helpers import TinyModule, fit, guard

from guardtrain import PRESETS, GuardTuneCallback

RANK_ZERO = "lightning.pytorch.utilities.rank_zero"
OFF_LINE = "guardtrain: recursive dict tags are off"


class ConfigSeen(L.Callback):
    """Records Dynamo's dict-tags config in every training and validation batch."""

    def __init__(self) -> None:
        self.seen: set[bool] = set()

    def _record(self) -> None:
        self.seen.add(torch._dynamo.config.use_recursive_dict_tags_for_guards)

    def on_train_batch_start(self, *args: Any) -> None:
        self._record()

    def on_validation_batch_start(self, *args: Any) -> None:
        self._record()


def _run(cb: GuardTuneCallback, caplog: pytest.LogCaptureFixture) -> tuple[set[bool], list[str]]:
    """One short fit; the config values seen in the batches, and the warnings' messages."""
    seen = ConfigSeen()
    with (
        caplog.at_level("INFO", logger=RANK_ZERO),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        fit(TinyModule(), [cb, seen], max_epochs=2)
    return seen.seen, [str(w.message) for w in caught]


def _off_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if OFF_LINE in r.getMessage()]


def _upstream_warnings(messages: list[str]) -> list[str]:
    return [m for m in messages if "181873" in m]


def test_constructor_keeps_none_and_explicit_values() -> None:
    assert GuardTuneCallback("safe").settings.recursive_dict_tags is None
    assert GuardTuneCallback("safe", recursive_dict_tags=None).settings.recursive_dict_tags is None
    assert GuardTuneCallback("off", recursive_dict_tags=True).settings.recursive_dict_tags is True
    assert GuardTuneCallback("off", recursive_dict_tags=False).settings.recursive_dict_tags is False


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_leave_torch_default_off(preset: str, caplog: pytest.LogCaptureFixture) -> None:
    default = torch._dynamo.config.use_recursive_dict_tags_for_guards
    assert default is False  # torch 2.13: off unconditionally
    cb = guard(preset)
    seen, messages = _run(cb, caplog)
    assert seen == {False}
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is False
    assert cb.summary()["levers"]["recursive_dict_tags"] is False
    assert cb.summary()["switched_off"] == []
    assert not _upstream_warnings(messages)
    # One INFO line (not a warning), citing torch's default.
    lines = _off_lines(caplog)
    assert len(lines) == 1, lines
    assert "default" in lines[0] and "181873" in lines[0]
    assert not [m for m in messages if OFF_LINE in m]


def test_preset_keeps_a_default_that_is_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch whose default is on (pytorch#188103 on CPython >= 3.12): left on, silently."""
    monkeypatch.setattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", True)
    cb = guard("aggressive")
    seen, messages = _run(cb, caplog)
    assert seen == {True}
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is True
    assert cb.summary()["levers"]["recursive_dict_tags"] is True
    assert not _upstream_warnings(messages)
    assert not _off_lines(caplog)


def test_explicit_true_warns_once_and_restores(caplog: pytest.LogCaptureFixture) -> None:
    cb = guard("safe", recursive_dict_tags=True)
    all_messages: list[str] = []
    for _ in range(2):  # two fits with one callback: one warning
        seen, messages = _run(cb, caplog)
        all_messages += messages
        assert seen == {True}
        assert torch._dynamo.config.use_recursive_dict_tags_for_guards is False  # restored
        assert cb.summary()["levers"]["recursive_dict_tags"] is True
    upstream = _upstream_warnings(all_messages)
    assert len(upstream) == 1, upstream
    assert "recursive_dict_tags=True" in upstream[0]
    assert not _off_lines(caplog)


def test_off_line_once_per_callback(caplog: pytest.LogCaptureFixture) -> None:
    cb = guard("balanced")
    _run(cb, caplog)
    _run(cb, caplog)
    assert len(_off_lines(caplog)) == 1


def test_explicit_false_where_default_is_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", True)
    cb = guard("off", recursive_dict_tags=False)
    seen, messages = _run(cb, caplog)
    assert seen == {False}
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is True  # restored
    assert cb.summary()["levers"]["recursive_dict_tags"] is False
    assert not _upstream_warnings(messages)
    lines = _off_lines(caplog)
    assert len(lines) == 1 and "recursive_dict_tags=False" in lines[0], lines


def test_restored_after_an_exception(caplog: pytest.LogCaptureFixture) -> None:
    class Boom(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 4:
                raise RuntimeError("boom")

    cb = guard("safe", recursive_dict_tags=True)
    seen = ConfigSeen()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(RuntimeError, match="boom"):
            fit(TinyModule(), [cb, seen, Boom()], max_epochs=2)
    assert seen.seen == {True}
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is False
