"""A torch without a named guard filter (``torch.compiler``'s ``*_unsafe`` functions): the
filter is switched off with a warning, and the run equals an uncompiled one and leaves no
trace (``docs/errors.md``, "a torch without a named filter"). The supported releases
(2.11 and later) have every other lever.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TinyModule, assert_restored, compare, guard_without_lookup


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
