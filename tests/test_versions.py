"""The torch versions guardtrain declares and tests (H36): the range, the untested warning.

``scripts/matrix.sh`` runs the suite on each tested torch; docs/versions.md has the table.
"""

from __future__ import annotations

import re
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from helpers import Net, guard_tuner

from guardtrain import versions

ROOT = Path(__file__).resolve().parents[1]


def _steps(model: torch.nn.Module, tuner: object) -> None:
    for _ in range(3):
        x = torch.randn(4, 8)
        with tuner.step((x,)):  # type: ignore[attr-defined]
            model(x).sum().backward()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.13.0+cpu", (2, 13)),
        ("2.15.0+cu132", (2, 15)),
        ("2.16.0a0+git1234", (2, 16)),
        ("3.0", (3, 0)),
    ],
)
def test_release_reads_major_and_minor(text: str, expected: tuple[int, int]) -> None:
    assert versions.release(text) == expected


def test_release_names_a_bad_version() -> None:
    with pytest.raises(ValueError, match="'nightly'"):
        versions.release("nightly")


@pytest.mark.parametrize("text", ["2.11.0", "2.13.0+cpu", "2.15.0", "2.15.9"])
def test_tested_versions_give_no_warning(text: str) -> None:
    assert versions.untested_warning(text) is None


@pytest.mark.parametrize("text", ["2.16.0", "2.16.0.dev20270101+cpu", "3.0.0"])
def test_a_newer_torch_is_named_with_the_tested_range(text: str) -> None:
    message = versions.untested_warning(text)
    assert message is not None
    assert f"torch {text} is newer" in message and "torch 2.11 to 2.15" in message


def test_the_installed_torch_is_in_the_tested_range() -> None:
    """The matrix runs the suite on each of these: this one must be among them."""
    low, high = versions.TESTED
    assert low <= versions.release() <= high, torch.__version__


def test_pyproject_declares_the_oldest_tested_torch_without_an_upper_pin() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    low = versions.TESTED[0]
    assert torch_dep.replace(" ", "") == f"torch>={low[0]}.{low[1]}", torch_dep
    assert "<" not in torch_dep


def test_matrix_script_lists_the_tested_versions() -> None:
    script = (ROOT / "scripts" / "matrix.sh").read_text()
    (line,) = [line for line in script.splitlines() if line.startswith("ALL_VERSIONS=")]
    names = line.split("(")[1].rstrip(")").split()
    low, high = versions.TESTED
    assert names == [f"{low[0]}.{m}" for m in range(low[1], high[1] + 1)], names


def test_untested_torch_warns_once_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch newer than the newest tested: one warning over two runs, then the run goes on."""
    monkeypatch.setattr(versions, "_warned", [])
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    messages = []
    for _ in range(2):
        model = Net()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with guard_tuner(model) as tuner:
                _steps(model, tuner)
        messages += [str(w.message) for w in record if "newer than" in str(w.message)]
        assert tuner.summary()["compiles"] >= 1
    assert len(messages) == 1, messages
    assert "torch 2.16.0" in messages[0] and "2.11 to 2.15" in messages[0]


def test_tested_torch_gives_no_version_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "_warned", [])
    model = Net()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with guard_tuner(model) as tuner:
            _steps(model, tuner)
    assert not [w for w in record if "newer than" in str(w.message)]


def _pins() -> dict[str, str]:
    """``scripts/constraints.txt`` as {distribution: release}."""
    pins = {}
    for raw in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line:
            name, sep, release = line.partition("==")
            assert sep and re.fullmatch(r"[\w.]+", release), f"not name==release: {raw!r}"
            pins[name.lower()] = release
    return pins


def test_constraints_pin_releases_and_leave_torch_to_the_scripts() -> None:
    pins = _pins()
    assert "torch" not in pins
    for name in ("lightning", "hydra-core", "transformers", "accelerate", "peft", "trl"):
        assert name in pins, name


def test_docs_name_the_pinned_hf_releases() -> None:
    """docs/hf.md's TRL section says what CI installs (scripts/constraints.txt)."""
    pins = _pins()
    hf = (ROOT / "docs" / "hf.md").read_text()
    for name in ("trl", "transformers", "peft", "accelerate", "datasets"):
        assert f"{name} {pins[name]}" in hf, f"docs/hf.md does not name {name} {pins[name]}"
