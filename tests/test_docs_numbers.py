"""The README's speed figures are docs/bench.md's latest: each one, in step, by phrase.

Every figure the README quotes about speed (µs, ms, s, ``x``, %) stands in a phrase that
:data:`FIGURES` names, beside the phrase docs/bench.md states it in. For each, the test
reads the README's value and the value of the *latest dated section* of docs/bench.md
that states it in that phrase (a section's date: the first ``YYYY-MM-DD`` of its heading,
else of its text, else its parent's; on one date the last such section in the file), and
asserts they are equal, as written. So the test fails when either side changes alone,
and when a newer dated section states the figure again with another value: a new
measurement of one of these figures states it in the same phrase, and the README follows.
A speed figure in the README that no phrase covers fails too
(:func:`test_every_readme_speed_figure_has_a_source`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCH = ROOT / "docs" / "bench.md"

_NUM = r"(\d+(?:\.\d+)?)"
_RANGE = r"(\d+(?:\.\d+)?-\d+(?:\.\d+)?)"
_FIG = r"(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)"
"""A number or a range."""
SPEED = re.compile(r"\d+(?:\.\d+)?(?:\s?[-\u2013]\s?\d+(?:\.\d+)?)?\s?(?:µs|ms|s\b|x\b|%)")
"""What counts as a speed figure in the README."""
DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


@dataclass(frozen=True)
class Figure:
    """One quoted figure: the README's phrase and docs/bench.md's (each regex's groups
    are the figure's values, compared as written)."""

    what: str
    readme: str
    bench: str


FIGURES = (
    Figure(
        "aggressive: guard + pre-graph time per call against compile's (transformer)",
        r"`aggressive` cut guard and pre-graph time per call to " + _FIG + r"% of",
        r"`aggressive`'s guard and pre-graph time per call: \*\*" + _FIG + r"%\*\* of `compile`'s",
    ),
    Figure(
        "aggressive: whole no_grad call against the unsound floor's (transformer)",
        r"its whole `no_grad` call at " + _FIG + r"x the unsound floor's",
        r"`aggressive`'s whole `no_grad` call: \*\*" + _FIG + r"x\*\* `floor`'s",
    ),
    Figure(
        "turbo: per-call checks of a steady call",
        r"after " + _RANGE + r" µs of per-call checks",
        r"turbo's per-call checks: \*\*" + _RANGE + r" µs\*\*",
    ),
    Figure(
        "turbo: Dynamo's entry path per frame that a direct call skips",
        r"skipping " + _RANGE + r" µs of Dynamo's entry path per frame",
        r"against " + _RANGE + r" µs of Dynamo's entry path per frame",
    ),
    Figure(
        "warm start: cold and warm seconds to the first steady step (12 blocks)",
        r"inductor: " + _NUM + r" s to " + _NUM + r" s to the first steady step",
        r"\| `Transformer\(depth=12\)` \| " + _NUM + r" \([^)]*\) \| " + _NUM + r" \(",
    ),
    Figure(
        "workloads: dpo-peft-hf's default targets and targets=[''] against plain compile",
        r"\(`dpo-peft-hf`: " + _NUM + r"x plain compile; `targets=\[\"\"\]`: " + _NUM + r"x\)",
        r"those two targets " + _NUM + r"x plain compile, the whole model as one target "
        r"\(`targets=\[\"\"\]`\) " + _NUM + r"x",
    ),
    Figure(
        "workloads: dpo-trl handed over to full guards, against plain compile",
        r"\(`dpo-trl`: " + _NUM + r"x\)",
        _NUM + r"x, with \d+ compiles against plain compile's",
    ),
)


@dataclass(frozen=True)
class Section:
    start: int
    end: int
    date: str | None
    title: str


def _sections(text: str) -> list[Section]:
    """docs/bench.md's sections (every heading), each with its date."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    heads = [(i, m) for i, line in enumerate(lines) if (m := HEADING.match(line.rstrip("\n")))]
    out: list[Section] = []
    parents: list[tuple[int, str | None]] = []  # (level, date) of the enclosing headings
    for n, (i, m) in enumerate(heads):
        level = len(m.group(1))
        end_line = heads[n + 1][0] if n + 1 < len(heads) else len(lines)
        body = "".join(lines[i + 1 : end_line])
        while parents and parents[-1][0] >= level:
            parents.pop()
        found = DATE.search(m.group(2)) or DATE.search(body)
        date = found.group(1) if found else (parents[-1][1] if parents else None)
        parents.append((level, date))
        out.append(Section(offsets[i], offsets[end_line], date, m.group(2)))
    return out


def _rx(phrase: str) -> re.Pattern[str]:
    """A phrase as a pattern: a space stands for any run of white space (line breaks)."""
    return re.compile(phrase.replace(" ", r"\s+"))


def _readme_value(figure: Figure, readme: str) -> tuple[str, ...]:
    found = list(_rx(figure.readme).finditer(readme))
    assert len(found) == 1, f"README.md: {figure.what}: {len(found)} matches of {figure.readme!r}"
    return found[0].groups()


def _latest_bench_value(figure: Figure, bench: str) -> tuple[tuple[str, ...], Section]:
    """The figure as the latest dated section of docs/bench.md states it."""
    sections = _sections(bench)
    stated = []
    for m in _rx(figure.bench).finditer(bench):
        inner = [s for s in sections if s.start <= m.start() < s.end][-1]
        if inner.date is not None:
            stated.append((inner.date, m.start(), m.groups(), inner))
    assert stated, f"docs/bench.md states no dated {figure.what!r} ({figure.bench!r})"
    _, _, values, section = max(stated, key=lambda s: (s[0], s[1]))
    return values, section


@pytest.mark.parametrize("figure", FIGURES, ids=[f.what for f in FIGURES])
def test_readme_figure_is_bench_mds_latest(figure: Figure) -> None:
    readme = README.read_text(encoding="utf-8")
    bench = BENCH.read_text(encoding="utf-8")
    quoted = _readme_value(figure, readme)
    latest, section = _latest_bench_value(figure, bench)
    assert quoted == latest, (
        f"{figure.what}: README.md says {quoted}, docs/bench.md's latest "
        f"({section.date}, {section.title!r}) says {latest}"
    )


def test_every_readme_speed_figure_has_a_source() -> None:
    readme = README.read_text(encoding="utf-8")
    covered = [
        m.span(g)
        for f in FIGURES
        for m in _rx(f.readme).finditer(readme)
        for g in range(1, len(m.groups()) + 1)
    ]
    unsourced = [
        f"line {readme[: m.start()].count(chr(10)) + 1}: {m.group()!r}"
        for m in SPEED.finditer(readme)
        if not any(a <= m.start() < b for a, b in covered)
    ]
    assert not unsourced, "README.md speed figures with no docs/bench.md phrase in FIGURES:\n" + (
        "\n".join(unsourced)
    )


def test_the_latest_dated_section_wins() -> None:
    """On synthetic text: a later date wins over an earlier one further down, the file
    order breaks a tie, and an undated subsection takes its parent's date."""
    figure = Figure("x", "", r"checks: \*\*" + _RANGE + r" µs\*\*")
    text = (
        "# bench\n"
        "## New (2026-12-03)\n### part\nchecks: **1.0-2.0 µs**\n"
        "## Old\nMeasured 2026-11-30.\nchecks: **3.0-4.0 µs**\n"
    )
    values, section = _latest_bench_value(figure, text)
    assert values == ("1.0-2.0",) and section.title == "part" and section.date == "2026-12-03"
    later = text + "## Same day (2026-12-03)\nchecks: **5.0-6.0 µs**\n"
    assert _latest_bench_value(figure, later)[0] == ("5.0-6.0",)
    with pytest.raises(AssertionError, match="states no dated"):
        _latest_bench_value(figure, "# bench\nchecks: **1.0-2.0 µs**\n")
