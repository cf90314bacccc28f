"""The examples in the docstrings run as written."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "guardtrain"
WITH_EXAMPLES = sorted(
    ".".join(("guardtrain", *p.relative_to(PACKAGE).with_suffix("").parts))
    for p in PACKAGE.rglob("*.py")
    if ">>> " in p.read_text(encoding="utf-8")
)


def test_modules_with_examples_are_found() -> None:
    assert "guardtrain.engine.phases" in WITH_EXAMPLES


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
