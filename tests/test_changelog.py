"""CHANGELOG.md keeps its shape: Keep a Changelog sections, one line per entry, links to
files that exist (no anchors: the docs' headings move), and no measured figures (those
belong in docs/bench.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"
VERSION_FILE = ROOT / "guardtrain" / "_version.py"

_RELEASE = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$")
_KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
# A measured figure: a time unit after a number, a ratio such as 1.07x, a percentage.
_FIGURE = re.compile(r"\d\s*(?:µs|us|ns|ms|s)\b|\d(?:\.\d+)?\s*(?:x\b|\u00d7)|\d\s*%")
_LINK = re.compile(r"\]\(([^)]+)\)")


def _lines() -> list[str]:
    return CHANGELOG.read_text(encoding="utf-8").splitlines()


def test_releases_are_in_order_and_the_current_version_is_released() -> None:
    releases = [m for line in _lines() if (m := _RELEASE.match(line))]
    assert releases, "no `## [...]` release headings"
    assert releases[0]["version"] == "Unreleased" and releases[0]["date"] is None
    dated = releases[1:]
    assert all(r["date"] for r in dated), "every release after [Unreleased] has a date"
    assert [r["date"] for r in dated] == sorted((r["date"] for r in dated), reverse=True)
    version = re.search(r'__version__ = "([^"]+)"', VERSION_FILE.read_text())
    assert version is not None
    assert dated and dated[0]["version"] == version[1], "the newest release is the package's"


def test_sections_are_keep_a_changelog_kinds() -> None:
    kinds = [line[4:] for line in _lines() if line.startswith("### ")]
    assert kinds and set(kinds) <= _KINDS, kinds


def test_every_entry_is_one_line() -> None:
    in_release = False
    for number, line in enumerate(_lines(), 1):
        if line.startswith("## "):
            in_release = True
        if not in_release or not line or line.startswith("#"):
            continue
        if line.startswith("- "):
            continue
        # a release's one-paragraph introduction sits right under its heading
        assert not line.startswith((" ", "\t")), f"line {number}: an entry goes on one line"


def test_no_measured_figures() -> None:
    for number, line in enumerate(_lines(), 1):
        text = _LINK.sub("]()", line)  # link targets may hold anything
        assert not _FIGURE.search(text), f"line {number}: a figure belongs in docs/bench.md"


def test_links_point_to_files_that_exist_without_anchors() -> None:
    for number, line in enumerate(_lines(), 1):
        for target in _LINK.findall(line):
            if target.startswith(("http://", "https://")):
                continue
            assert "#" not in target, f"line {number}: {target}: link to the file only"
            assert (ROOT / target).is_file(), f"line {number}: {target} does not exist"
