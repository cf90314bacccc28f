"""``scripts/soundness_table.py`` (docs/soundness.md's table), on two of its rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_restored

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def table() -> Any:
    spec = importlib.util.spec_from_file_location(
        "soundness_table", ROOT / "scripts" / "soundness_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_plain_compile_recompiles_for_an_int_argument(table: Any) -> None:
    result = table.run_case("int argument", "torch.compile")
    assert (result.stale, result.calls, result.error) == (0, table.STEPS - table.CHANGE_AT, None)
    assert result.stale_before == 0
    assert_restored()


def test_the_guide_recipe_runs_a_changed_attribute_stale(table: Any) -> None:
    """Under the stance with the nn-module guards dropped the old temperature runs on."""
    result = table.run_case("module attribute", "guide recipe")
    assert result.stance_at_change is True
    assert result.stale == result.calls == table.STEPS - table.CHANGE_AT
    assert result.stale_before == 0
    assert_restored()  # the stance and install_free_tensors are put back
    assert table.GAIN == 1.0


def test_the_table_is_written(table: Any, tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    args = ["-q", "--cases", "global scalar", "--configs", "torch.compile", "--out", str(out)]
    assert table.main(args) == 0
    text = out.read_text()
    assert f"torch {torch.__version__}" in text
    assert "| global scalar | module global `GAIN` 1.0 -> 2.0 | 0/14 |" in text
