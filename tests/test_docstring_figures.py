"""Measured timings in the package's docstrings and comments stay where they inform a choice.

The speed suite beside the package (``benchmarks/``) is held to the same rule.

A timing figure (a number with ``µs``, ``us``, ``ns`` or ``ms``; a ratio such as ``0.95x``
or a percentage next to words such as *faster*, *slower* or *plain compile*) drifts as
the code changes, so it appears only where a user picks something by it: the config
fields' docs (``guardtrain/engine/config.py``), the presets' descriptions
(``guardtrain/presets.py``) and the bench's help texts (``guardtrain/bench/command.py``).
There, the docstring, comment block or ``help=`` text that states it also names the
docs/bench.md section it comes from, as ``(docs/bench.md, "Section name")``. Everywhere
else the figure goes and the sentence keeps its point in words.

Docstrings (every string statement, so attribute docstrings too) are read with
:mod:`ast`, comments with :mod:`tokenize`; comments on consecutive lines form one block.
Each failure lists ``file:line`` and the figure.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "guardtrain"
SUITE = ROOT / "benchmarks"

#: The files where a timing figure may stand, with its docs/bench.md citation.
ALLOWED = frozenset(
    {"guardtrain/engine/config.py", "guardtrain/presets.py", "guardtrain/bench/command.py"}
)

_NUMBER = r"(?<![\w.])\d+(?:[.,]\d+)?(?:\s*[-\u2013]\s*\d+(?:[.,]\d+)?)?"
#: A duration: a number (or a range) with a unit of time.
DURATION = re.compile(_NUMBER + r"\s?(?:µs|μs|us|ns|ms|s|seconds?)\b")
#: A ratio or a percentage, a figure of speed when words of speed stand near it.
RATIO = re.compile(_NUMBER + r"\s?(?:[x\u00d7](?!\w)|%)")
SPEED_WORDS = re.compile(
    r"faster|slower|speed|plain compile|eager|whole (?:call|step)|of the step|overhead"
    r"|\bthan\b|\btime\b",
    re.IGNORECASE,
)
#: How far (characters, either side) a word of speed may stand from a ratio.
NEAR = 40
CITATION = re.compile(r'docs/bench\.md,\s*"[^"\n]+"')


def _docstrings(tree: ast.AST) -> list[tuple[int, str]]:
    """``(first line, text)`` of every string statement (docstrings, attribute docs)."""
    return [
        (node.lineno, node.value.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]


def _help_texts(tree: ast.AST) -> list[tuple[int, str]]:
    """``(first line, text)`` of every ``help=`` string (the bench's options)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "help":
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append((value.lineno, value.value))
            elif isinstance(value, ast.JoinedStr):  # an f-string: its literal parts
                parts = [
                    p.value
                    for p in value.values
                    if isinstance(p, ast.Constant) and isinstance(p.value, str)
                ]
                found.append((value.lineno, "{}".join(parts)))
    return found


def _comment_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of each run of comments on consecutive lines."""
    blocks: list[tuple[int, list[str]]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        body = tok.string.lstrip("#").strip()
        if line == last + 1 and blocks:
            blocks[-1][1].append(body)
        else:
            blocks.append((line, [body]))
        last = line
    return [(start, "\n".join(lines)) for start, lines in blocks]


def timing_figures(text: str) -> list[tuple[int, str]]:
    """``(offset in lines, figure)`` of each timing figure in ``text``."""
    found = [(m.start(), m.group()) for m in DURATION.finditer(text)]
    for m in RATIO.finditer(text):
        near = text[max(0, m.start() - NEAR) : m.end() + NEAR]
        if SPEED_WORDS.search(near):
            found.append((m.start(), m.group()))
    return sorted((text.count("\n", 0, at), " ".join(fig.split())) for at, fig in found)


def _blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    blocks = _docstrings(tree) + _comment_blocks(text)
    if path.name == "command.py":
        blocks += _help_texts(tree)
    return blocks


def offenders() -> list[str]:
    """``file:line: figure`` of every timing figure out of place, or uncited in place."""
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *SUITE.rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for start, block in _blocks(path):
            figures = timing_figures(block)
            if not figures:
                continue
            cited = CITATION.search(block) is not None
            for offset, figure in figures:
                if rel not in ALLOWED:
                    found.append(f"{rel}:{start + offset}: {figure!r} (not a place for timings)")
                elif not cited:
                    found.append(f"{rel}:{start + offset}: {figure!r} (no docs/bench.md citation)")
    return sorted(set(found))


def test_timing_figures_only_in_the_choices_and_cited() -> None:
    found = offenders()
    assert not found, (
        "timing figures in docstrings/comments: remove them (keep the point in words), or, "
        "in engine/config.py, presets.py or bench/command.py, cite their section as "
        '(docs/bench.md, "Section name"):\n' + "\n".join(found)
    )


def test_the_scanner_finds_figures() -> None:
    assert timing_figures("a pass over the parameters, about 60 ns each") == [(0, "60 ns")]
    assert timing_figures("costs 1.5-2.5 µs per call") == [(0, "1.5-2.5 µs")]
    assert timing_figures("took\n2 ms") == [(1, "2 ms")]
    assert timing_figures("0.95x plain compile") == [(0, "0.95x")]
    assert timing_figures("calls about 12% slower") == [(0, "12%")]
    assert timing_figures("about 4 s a step") == [(0, "4 s")]
    assert timing_figures("1.2\u00d7 faster, 70\u2013107 µs") == [
        (0, "1.2\u00d7"),
        (0, "70\u2013107 µs"),
    ]
    # sizes, shapes, counts and thresholds are no timings
    assert timing_figures("a 32x64 @ 64x64 matmul; 49 modules; 4 ranks") == []
    assert timing_figures("at most 50% of the parameters are frozen") == []
    assert timing_figures("items of 8 bytes, 3 msgs") == []


def test_comments_on_consecutive_lines_are_one_block() -> None:
    source = "x = 1  # one\n# two\n\n# three\n"
    assert _comment_blocks(source) == [(1, "one\ntwo"), (4, "three")]


def test_a_citation_is_the_section_named_in_quotes() -> None:
    assert CITATION.search('(docs/bench.md, "Per-call costs")')
    assert not CITATION.search("(docs/bench.md)")
