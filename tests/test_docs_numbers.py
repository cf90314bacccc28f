"""The README's speed figures are docs/bench.md's, and the docs' links resolve.

docs/bench.md is the results page: one undated, named section per thing measured, each
holding the latest figure (earlier runs are in docs/history/bench.md, the measurement
log). Every figure the README quotes about speed (µs, ms, s, ``x``, %) stands in a phrase
that :data:`FIGURES` names, beside the docs/bench.md section it comes from and where in
that section it stands: a phrase (a regex whose groups are the values) or a table
:class:`Cell` (a row by its first cell, a column by its header). The test reads the
README's value and the value in that section only, and asserts they are equal, as
written: it fails when the section is missing, when the section does not state the
figure, and when either side changes alone. A new run updates the section and the README
follows. A speed figure in the README that no phrase covers fails too
(:func:`test_every_readme_speed_figure_has_a_source`).

The links: every relative link in README.md and docs/ (docs/history/ too) names a file
that exists, and its ``#anchor`` a heading of the target file, by GitHub's slug rules
(:func:`slug`); README.md, docs/bench.md and docs/history/bench.md strictly, the other docs
but for a list of known broken links to be fixed (:data:`BROKEN_ELSEWHERE`). Each citation
of a section by name, ``(docs/bench.md, "Section name")``, names a heading of docs/bench.md
(:data:`CITED_ELSEWHERE_STALE` lists the ones to be fixed). README.md and docs/bench.md
link to no dated anchor, and docs/bench.md's headings carry no date.
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
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")

REAL = "Real workloads against plain compile"
PER_CALL = "Guard and pre-graph time per call"
TURBO_CHECKS = "Turbo's per-call checks"
WARM = "Warm start"
WHOLE_STEP = "The whole step with the optimizer compiled"


@dataclass(frozen=True)
class Cell:
    """A table cell of a section: the row whose first cell is ``row`` (or starts with
    ``row`` and a space: ``vit-checkpoint (built-in TinyViT)``), the column whose header
    is ``column``; its value is the number it starts with."""

    row: str
    column: str


@dataclass(frozen=True)
class Figure:
    """One quoted figure: the README's phrase, the docs/bench.md section (its heading's
    title) it comes from, and where in that section it stands."""

    what: str
    readme: str
    section: str
    bench: str | Cell


def _auto(workload: str, what: str, readme: str, section: str | None = None) -> Figure:
    """A real workload's figure: ``auto``'s step (the default preset) against plain
    compile's, or against PyTorch's compiled-optimizer recipe (``section``)."""
    return Figure(f"workloads: {what}, auto", readme, section or REAL, Cell(workload, "auto"))


FIGURES = (
    _auto("rollout", "rollouts with generate()", r"RL rollouts with `generate\(\)` " + _NUM + "x"),
    _auto("grpo", "TRL's GRPO", r"TRL's GRPO " + _NUM + "x"),
    _auto("dpo-peft", "DPO with peft in a plain loop", r"DPO with a peft adapter " + _NUM + "x"),
    _auto("dpo-peft-lightning", "DPO with peft under Lightning", _NUM + r"x under Lightning"),
    _auto("step-transformer", "the transformer", r"a 12-block transformer " + _NUM + "x"),
    _auto(
        "step-transformer-regional",
        "the transformer block by block",
        r"transformer [\d.]+x, block by block " + _NUM + "x",
    ),
    _auto("vit-checkpoint", "ViT", r"a ViT with\s+gradient checkpointing " + _NUM + "x"),
    _auto("rl-alternate", "RL rollouts", r"RL rollouts and updates " + _NUM + "x"),
    _auto("gan-toggle", "Lightning GAN", r"a Lightning GAN " + _NUM + "x"),
    _auto("dpo-peft-hf", "the HF Trainer's DPO", r"the HF\s+Trainer's DPO " + _NUM + "x"),
    _auto("autocast-alternate", "autocast", r"autocast every other step " + _NUM + "x"),
    _auto("dpo-trl", "TRL's DPO", r"TRL's DPO " + _NUM + "x"),
    _auto(
        "step-transformer",
        "the transformer's step with compile_optimizer",
        r"the transformer's step " + _NUM + "x",
        WHOLE_STEP,
    ),
    _auto(
        "step-transformer-regional",
        "block by block with compile_optimizer",
        r"the transformer's step [\d.]+x, block by block " + _NUM + "x",
        WHOLE_STEP,
    ),
    Figure(
        "aggressive: guard + pre-graph time per call against compile's (transformer)",
        r"`aggressive` cuts guard and pre-graph time to " + _FIG + r"% of",
        PER_CALL,
        r"`aggressive`'s guard and pre-graph time per call: \*\*" + _FIG + r"%\*\* of `compile`'s",
    ),
    Figure(
        "aggressive: whole no_grad call against the unsound floor's (transformer)",
        r"its whole `no_grad` call at " + _FIG + r"x the unsound floor's",
        PER_CALL,
        r"`aggressive`'s whole `no_grad` call: \*\*" + _FIG + r"x\*\* `floor`'s",
    ),
    Figure(
        "turbo: per-call checks of a steady call",
        r"after " + _RANGE + r" µs of per-call checks",
        TURBO_CHECKS,
        r"turbo's per-call checks: \*\*" + _RANGE + r" µs\*\*",
    ),
    Figure(
        "turbo: Dynamo's entry path per frame that a direct call skips",
        r"skipping " + _RANGE + r" µs of Dynamo's entry path per frame",
        TURBO_CHECKS,
        r"against " + _RANGE + r" µs of Dynamo's entry path per frame",
    ),
    Figure(
        "warm start: cold and warm seconds to the first steady step (12 blocks)",
        r"inductor: " + _NUM + r" s to " + _NUM + r" s to the first steady step",
        WARM,
        r"\| `Transformer\(depth=12\)` \| " + _NUM + r" \([^)]*\) \| " + _NUM + r" \(",
    ),
)


# --- docs/bench.md's sections -------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    title: str
    level: int
    text: str
    """The section's body, its subsections included."""


def _code_free_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of ``text`` outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def _headings(text: str) -> list[tuple[int, int, str]]:
    """``(line index, level, title)`` of each ATX heading outside code blocks."""
    found: list[tuple[int, int, str]] = []
    for number, line in _code_free_lines(text):
        if m := HEADING.match(line):
            found.append((number - 1, len(m.group(1)), m.group(2)))
    return found


def sections(text: str) -> list[Section]:
    """Every section of a Markdown text: its heading's title and level, and its body up to
    the next heading of the same or a higher level."""
    lines = text.splitlines(keepends=True)
    heads = _headings(text)
    out: list[Section] = []
    for n, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[n + 1 :] if lv <= level), len(lines))
        out.append(Section(title, level, "".join(lines[i + 1 : end])))
    return out


def section(text: str, title: str) -> Section:
    """The one section whose heading's title is ``title``."""
    found = [s for s in sections(text) if s.title == title]
    assert found, f"docs/bench.md has no section {title!r}"
    assert len(found) == 1, f"docs/bench.md has {len(found)} sections {title!r}"
    return found[0]


def _rx(phrase: str) -> re.Pattern[str]:
    """A phrase as a pattern: a space stands for any run of white space (line breaks)."""
    return re.compile(phrase.replace(" ", r"\s+"))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _cell_value(cell: Cell, body: str) -> tuple[str, ...]:
    """The number the cell starts with, from the section's tables."""
    found: list[str] = []
    table: list[list[str]] = []
    for line in [*body.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            table.append(_cells(line))
            continue
        if len(table) > 2 and cell.column in table[0]:
            col = table[0].index(cell.column)
            for row in table[2:]:
                if row[0] == cell.row or row[0].startswith(cell.row + " "):
                    found.append(row[col] if col < len(row) else "")
        table = []
    assert len(found) == 1, f"{len(found)} cells of row {cell.row!r}, column {cell.column!r}"
    m = re.match(r"\**" + _FIG, found[0])
    assert m, f"row {cell.row!r}, column {cell.column!r}: no figure in {found[0]!r}"
    return m.groups()


def bench_value(figure: Figure, bench: str) -> tuple[str, ...]:
    """The figure as its named section of docs/bench.md states it (that section only)."""
    body = section(bench, figure.section).text
    if isinstance(figure.bench, Cell):
        return _cell_value(figure.bench, body)
    found = list(_rx(figure.bench).finditer(body))
    assert found, f"section {figure.section!r} does not state {figure.what!r} ({figure.bench!r})"
    values = {m.groups() for m in found}
    assert len(values) == 1, f"section {figure.section!r} states {figure.what!r} as {values}"
    return values.pop()


def _readme_value(figure: Figure, readme: str) -> tuple[str, ...]:
    found = list(_rx(figure.readme).finditer(readme))
    assert len(found) == 1, f"README.md: {figure.what}: {len(found)} matches of {figure.readme!r}"
    return found[0].groups()


@pytest.mark.parametrize("figure", FIGURES, ids=[f.what for f in FIGURES])
def test_readme_figure_is_its_bench_section_s(figure: Figure) -> None:
    readme = README.read_text(encoding="utf-8")
    bench = BENCH.read_text(encoding="utf-8")
    quoted = _readme_value(figure, readme)
    stated = bench_value(figure, bench)
    assert quoted == stated, (
        f"{figure.what}: README.md says {quoted}, docs/bench.md's section "
        f"{figure.section!r} says {stated}"
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


def test_a_figure_is_read_from_its_named_section_only() -> None:
    """On synthetic text: the named section's phrase and table cell are read, a subsection
    counts as part of its section, the same phrase elsewhere does not, and a missing
    section, phrase or cell fails."""
    text = (
        "# bench\n"
        "## Checks\nchecks: **1.0-2.0 µs**\n### Detail\n\n"
        "| workload | compile | turbo |\n|---|---:|---:|\n"
        "| dpo (x) | 1.00 | 0.90 [0.8-1.0] |\n| gan | 1.00 | **1.10** |\n\n"
        "## Old\nchecks: **3.0-4.0 µs**\n"
    )
    phrase = Figure("x", "", "Checks", r"checks: \*\*" + _RANGE + r" µs\*\*")
    assert bench_value(phrase, text) == ("1.0-2.0",)
    assert bench_value(Figure("x", "", "Old", phrase.bench), text) == ("3.0-4.0",)
    assert bench_value(Figure("x", "", "Checks", Cell("dpo", "turbo")), text) == ("0.90",)
    assert bench_value(Figure("x", "", "Detail", Cell("gan", "turbo")), text) == ("1.10",)
    with pytest.raises(AssertionError, match="no section 'New'"):
        bench_value(Figure("x", "", "New", phrase.bench), text)
    with pytest.raises(AssertionError, match="does not state"):
        bench_value(Figure("x", "", "Detail", phrase.bench), text)
    with pytest.raises(AssertionError, match="0 cells"):
        bench_value(Figure("x", "", "Old", Cell("gan", "turbo")), text)


# --- links ----------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline link or image; group 1 is its destination."""
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")

#: The files whose links must all resolve now (README.md and docs/bench.md; the log).
STRICT = ("README.md", "docs/bench.md", "docs/history/bench.md")
#: Links in other docs that do not resolve yet, ``(file, destination)``: each is to be
#: fixed in its file and then removed here (:func:`test_other_docs_links_resolve` fails on a
#: listed link that resolves or is gone, as on a broken one not listed).
BROKEN_ELSEWHERE: frozenset[tuple[str, str]] = frozenset()


def slug(title: str) -> str:
    """A heading's anchor as GitHub makes it: the rendered text (a link's text, no markup)
    lowercased, every character but letters, digits, ``_``, ``-`` and spaces dropped,
    spaces made ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return "".join(c for c in text.lower() if c.isalnum() or c in "_- ").replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a Markdown text: its headings' (a repeated slug gets ``-1``, ``-2``,
    ...) and each HTML ``<a id="...">`` or ``<a name="...">``."""
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for _, _, title in _headings(text):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[tuple[int, str]]:
    """``(line, destination)`` of each inline link outside code blocks and code spans; a
    link's text may wrap over lines (the line is where it starts)."""
    kept = dict(_code_free_lines(text))
    plain = "\n".join(
        CODE_SPAN.sub("", kept.get(n, "")) for n in range(1, len(text.splitlines()) + 1)
    )
    return [(plain.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(plain)]


def broken_links(path: Path) -> list[tuple[int, str, str]]:
    """``(line, destination, why)`` of each relative link of ``path`` that does not resolve."""
    text = path.read_text(encoding="utf-8")
    out: list[tuple[int, str, str]] = []
    for number, dest in links(text):
        if SCHEME.match(dest):
            continue
        file_part, _, anchor = dest.partition("#")
        target = (path.parent / file_part).resolve() if file_part else path
        if not target.exists():
            out.append((number, dest, f"no file {file_part}"))
            continue
        is_doc = target.suffix == ".md" and target.is_file()
        if anchor and is_doc and anchor not in anchors(target.read_text(encoding="utf-8")):
            out.append((number, dest, f"no heading #{anchor} in {file_part or path.name}"))
    return out


def _doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*/*.md"))]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_slugs_and_links_are_read_as_github_does() -> None:
    """The slug rules on this repository's kinds of headings, and what counts as a link."""
    assert slug("The anchor `aot` (issue 34, 2026-12-03, torch 2.13.0+cpu)") == (
        "the-anchor-aot-issue-34-2026-12-03-torch-2130cpu"
    )
    assert slug("Turbo's per-call checks") == "turbos-per-call-checks"
    assert slug("Warm start: `compile_cache`") == "warm-start-compile_cache"
    assert slug("H32\u2013H35: state") == "h32h35-state"
    assert slug("[Lightning](https://x) and `Trainer`") == "lightning-and-trainer"
    assert anchors("# A\n## B\n## B\n```\n# not a heading\n```\n") == {"a", "b", "b-1"}
    text = (
        "[a](x.md#y) and ![b](img.png) and `[c](not-a-link.md)` and [d](https://e)\n"
        '```\n[f](in-code.md)\n```\n[g [h]](z.md "title") and [a wrapped\nlink](w.md#v)\n'
    )
    assert links(text) == [
        (1, "x.md#y"),
        (1, "img.png"),
        (1, "https://e"),
        (5, "z.md"),
        (5, "w.md#v"),
    ]
    assert "h1-x" in anchors('| <a id="h1-x"></a>H1 | ... |\n')


@pytest.mark.parametrize("name", STRICT)
def test_links_resolve(name: str) -> None:
    path = ROOT / name
    broken = [f"{name}:{line}: ({dest}) {why}" for line, dest, why in broken_links(path)]
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_other_docs_links_resolve() -> None:
    """Every other doc's links resolve, but the :data:`BROKEN_ELSEWHERE` ones (to be fixed)."""
    broken = {
        (_rel(path), dest): f"{_rel(path)}:{line}: ({dest}) {why}"
        for path in _doc_files()
        if _rel(path) not in STRICT
        for line, dest, why in broken_links(path)
    }
    new = [why for key, why in broken.items() if key not in BROKEN_ELSEWHERE]
    fixed = sorted(BROKEN_ELSEWHERE - broken.keys())
    assert not new, "links that do not resolve:\n" + "\n".join(new)
    assert not fixed, f"resolve now (remove them from BROKEN_ELSEWHERE): {fixed}"


CITED_SECTION = re.compile(r'docs/bench\.md,?\s*\(?\s*"([^"\n]+)"')
"""A citation of a docs/bench.md section by name: ``(docs/bench.md, "Section name")``."""


#: Citations by name of sections docs/bench.md no longer has, ``(file, name)``: each is to be
#: pointed at a section that has the figure (or at docs/history/bench.md) and removed here.
CITED_ELSEWHERE_STALE: frozenset[tuple[str, str]] = frozenset()


def _citing() -> list[Path]:
    """Where docs/bench.md's sections are cited by name: the package, the scripts, README.md
    and docs/ (docs/history/ too: a log cites what stood then, and it must still stand)."""
    files = [*sorted((ROOT / "guardtrain").rglob("*.py")), *sorted((ROOT / "scripts").glob("*"))]
    return [p for p in files if p.is_file()] + _doc_files()


def test_cited_bench_sections_exist() -> None:
    """Each ``(docs/bench.md, "Section name")`` names a heading of docs/bench.md, but the
    :data:`CITED_ELSEWHERE_STALE` ones (to be fixed in their files)."""
    titles = {s.title for s in sections(BENCH.read_text(encoding="utf-8"))}
    found: dict[tuple[str, str], str] = {}
    for path in _citing():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for m in CITED_SECTION.finditer(text):
            if m.group(1) not in titles:
                line = text.count("\n", 0, m.start()) + 1
                found[(_rel(path), m.group(1))] = f"{_rel(path)}:{line}: {m.group(1)!r}"
    new = [why for key, why in found.items() if key not in CITED_ELSEWHERE_STALE]
    fixed = sorted(CITED_ELSEWHERE_STALE - found.keys())
    assert not new, "docs/bench.md has no such section:\n" + "\n".join(new)
    assert not fixed, f"resolve now (remove them from CITED_ELSEWHERE_STALE): {fixed}"


def test_no_dated_anchor_or_heading() -> None:
    """README.md and docs/bench.md link to no dated anchor, and docs/bench.md's headings,
    one per thing measured, are undated: the date of a run stands in its text."""
    dated = [
        f"{name}:{line}: {dest}"
        for name in ("README.md", "docs/bench.md")
        for line, dest in links((ROOT / name).read_text(encoding="utf-8"))
        if DATE.search(dest.partition("#")[2])
    ]
    assert not dated, "links to dated anchors:\n" + "\n".join(dated)
    headings = [t for _, _, t in _headings(BENCH.read_text(encoding="utf-8")) if DATE.search(t)]
    assert not headings, f"dated headings in docs/bench.md: {headings}"
