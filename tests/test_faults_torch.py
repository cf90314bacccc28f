"""A torch without an API a lever needs: the lever is switched off with a warning.

Each test hides one API (``set_stance``'s ``skip_guard_eval_unsafe``, a Dynamo
config key, the named guard filter), checks the warning, and checks that the
run equals an uncompiled one and leaves no trace (``docs/errors.md``, "a torch
without a lever").
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from helpers import TinyModule, assert_restored, compare, guard_without_lookup

from guardtrain import _torch


class _ConfigWithout:
    """Dynamo's config as an older torch has it: without ``hidden``."""

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


def _hide_config_key(monkeypatch: pytest.MonkeyPatch, hidden: str) -> None:
    """Hide one of Dynamo's config keys from guardtrain: its door (``guardtrain._torch``)
    and every module that took the config from it see a config without ``hidden``."""
    real = _torch.dynamo_config
    older = _ConfigWithout(real, hidden)
    for name, module in list(sys.modules.items()):
        if name.startswith("guardtrain") and getattr(module, "dynamo_config", None) is real:
            monkeypatch.setattr(module, "dynamo_config", older)


def test_torch_without_skip_guard_eval_unsafe(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.compiler.set_stance

    def set_stance(stance: str = "default", *, force_backend: Any = None) -> Any:
        return real(stance, force_backend=force_backend)

    monkeypatch.setattr(torch.compiler, "set_stance", set_stance)
    cb = guard_without_lookup()
    with pytest.warns(UserWarning, match=r"use_stance is switched off: needs torch>=2.6"):
        _, model = compare(TinyModule, lambda: cb)
    monkeypatch.undo()
    assert_restored(model)
    s = cb.summary()
    assert s["phase"] == "off" and s["steady_steps"] == 0
    assert [o["lever"] for o in s["switched_off"]] == ["use_stance"]


def test_torch_without_recursive_dict_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_config_key(monkeypatch, "use_recursive_dict_tags_for_guards")
    # Presets leave dict tags at torch's default (H22): only an explicit True asks for them.
    cb = guard_without_lookup(recursive_dict_tags=True)
    with pytest.warns(UserWarning, match=r"recursive_dict_tags is switched off: needs torch>=2.9"):
        _, model = compare(TinyModule, lambda: cb)
    monkeypatch.undo()
    assert_restored(model)
    s = cb.summary()
    assert s["levers"]["recursive_dict_tags"] is False
    assert [o["lever"] for o in s["switched_off"]] == ["recursive_dict_tags"]
    assert s["steady_steps"] > 0  # the other levers still work


def test_torch_without_the_named_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")
    with pytest.warns(UserWarning, match=r"'skip_all_nn_modules' needs torch>=2.8"):
        cb = guard_without_lookup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _, model = compare(TinyModule, lambda: cb)
    monkeypatch.undo()
    assert_restored(model)
    assert [o["lever"] for o in cb.summary()["switched_off"]] == ["guard_filter"]


def test_torch_without_install_free_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """setup() switches the lever off with a warning on a torch without the config key, and
    no compiled call reads the key after (the per-call path reads it only where the target
    uses the lever). Not reachable with the declared ``torch>=2.8``; the switch-off branch
    exists for it."""
    _hide_config_key(monkeypatch, "install_free_tensors")
    cb = guard_without_lookup()
    with pytest.warns(UserWarning, match=r"install_free_tensors is switched off: needs torch>=2.8"):
        _, model = compare(TinyModule, lambda: cb)
    monkeypatch.undo()
    assert_restored(model)
    assert cb.summary()["levers"]["install_free_tensors"] is False
