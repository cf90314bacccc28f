"""Recursive dict tags stay at torch's default unless the user asks (H22, pytorch#181873)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from helpers import TinyModule, fit, guard

from guardtrain import PRESETS, GuardTuneCallback, versions

RANK_ZERO = "lightning.pytorch.utilities.rank_zero"
OFF_LINE = "guardtrain: recursive dict tags are off"
TORCH_DEFAULT: bool = torch._dynamo.config.use_recursive_dict_tags_for_guards
"""This torch's own default: on in 2.10 and 2.11, off from 2.12 on (on CPython 3.11)."""


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
    if versions.risky_dict_tags_default():
        pytest.skip(
            f"torch {torch.__version__} defaults to on: test_default_on_before_the_fixes_is_"
            "turned_off covers it"
        )
    assert TORCH_DEFAULT is False  # torch 2.12 to 2.15 on CPython 3.11: off
    cb = guard(preset)
    seen, messages = _run(cb, caplog)
    assert seen == {False}
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is False
    assert cb.summary()["levers"]["recursive_dict_tags"] is False
    assert cb.summary()["switched_off"] == []
    assert not _upstream_warnings(messages)
    # Off by torch's own default: nothing to read at setup, and no warning.
    assert not _off_lines(caplog)
    assert not [m for m in messages if OFF_LINE in m]


def test_preset_keeps_a_default_that_is_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch whose default is on (pytorch#188103 on CPython >= 3.12): left on, silently."""
    monkeypatch.setattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", True)
    monkeypatch.setattr(versions, "release", lambda version=None: (2, 16))  # has the fixes
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
        assert torch._dynamo.config.use_recursive_dict_tags_for_guards is TORCH_DEFAULT  # restored
        assert cb.summary()["levers"]["recursive_dict_tags"] is True
    upstream = _upstream_warnings(all_messages)
    assert len(upstream) == 1, upstream
    assert "recursive_dict_tags=True" in upstream[0]
    assert not _off_lines(caplog)


def test_off_line_once_per_callback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", True)
    monkeypatch.setattr(versions, "release", lambda version=None: (2, 11))  # overridden
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
    assert not _off_lines(caplog)  # the user's own argument is not said back


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
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is TORCH_DEFAULT


@pytest.mark.parametrize("release", [(2, 10), (2, 11)])
def test_default_on_before_the_fixes_is_turned_off(
    release: tuple[int, int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch 2.10 and 2.11 default to on without the segfault fixes of 2.12 (H36): guardtrain
    turns them off, with one INFO line, and restores torch's value after the run."""
    monkeypatch.setattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", True)
    monkeypatch.setattr(versions, "release", lambda version=None: release)
    cb = guard("aggressive")
    seen, messages = _run(cb, caplog)
    _run(cb, caplog)  # a second fit: still one line
    assert seen == {False}
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is True  # restored
    assert cb.summary()["levers"]["recursive_dict_tags"] is False
    assert not _upstream_warnings(messages)
    lines = _off_lines(caplog)
    assert len(lines) == 1, lines
    assert "turned off" in lines[0] and "181873" in lines[0] and "2.12" in lines[0], lines
    assert "recursive_dict_tags=True" in lines[0]


def test_default_on_before_the_fixes_explicit_true_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """recursive_dict_tags=True on such a torch keeps them on, with the warning."""
    monkeypatch.setattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", True)
    monkeypatch.setattr(versions, "release", lambda version=None: (2, 11))
    cb = guard("aggressive", recursive_dict_tags=True)
    seen, messages = _run(cb, caplog)
    assert seen == {True}
    upstream = _upstream_warnings(messages)
    assert len(upstream) == 1 and "on by default without the fixes" in upstream[0], upstream
    assert not _off_lines(caplog)


@pytest.mark.skipif(
    not versions.risky_dict_tags_default(),
    reason=f"torch {torch.__version__} does not default to on before the fixes (2.10, 2.11 do)",
)
def test_this_torchs_risky_default_is_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    """On a real torch 2.11 (the matrix), unpatched."""
    cb = guard("balanced")
    seen, _ = _run(cb, caplog)
    assert seen == {False}
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is True
    assert len(_off_lines(caplog)) == 1
