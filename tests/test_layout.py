"""The layout limits of the package and of the speed suite (``benchmarks/``), checked
mechanically.

* files above :data:`MAX_FILE_LINES` lines and classes above :data:`MAX_CLASS_LINES` lines
  (``end_lineno - lineno + 1``, docstrings count) are listed in a warning for review, not
  refused: a file is split by concern, never to stay under a count;
* no function or closure above cyclomatic complexity :data:`MAX_COMPLEXITY`, as
  ``radon cc --show-closures`` measures it, except one whose ``def`` line (or first
  decorator) is directly preceded by a comment that names its complexity, e.g.
  ``# Complexity 25: the per-call path; split, it measured slower.``;
* no import cycle among guardtrain's and the suite's modules, counting every ``import`` in a module:
  under ``TYPE_CHECKING``, inside functions, and a package ``__init__``'s re-exports;
* README.md at most :data:`MAX_README_LINES` lines (details go to docs/);
* docs/design.md's "Where things live" table names only files that exist, and every
  module of the package (:func:`test_where_things_live_names_every_module`);
* every test file (and test) that code or docs cite exists
  (:func:`test_every_cited_test_exists`).

Each failure lists every offender with its number.
"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "guardtrain"
#: The speed suite of real workloads: not installed, held to the package's limits.
SUITE = ROOT / "benchmarks"
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300
MAX_COMPLEXITY = 15
MAX_README_LINES = 160
#: The comment that exempts a function: ``# Complexity N`` (N its measured complexity).
EXEMPTION = re.compile(r"^\s*#\s*Complexity\s+(\d+)\b", re.IGNORECASE)


def _files() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *SUITE.rglob("*.py")])


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


class SizeReview(UserWarning):
    """A file or class above the review size: read it for concerns to split (not a cap)."""


def _oversized() -> list[str]:
    """Files above :data:`MAX_FILE_LINES` lines and classes above :data:`MAX_CLASS_LINES`."""
    found = []
    for path in _files():
        text = path.read_text(encoding="utf-8")
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            found.append(f"{_rel(path)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"{_rel(path)}:{node.lineno} class {node.name}: {size} lines")
    return found


def test_files_and_classes_above_the_review_size_are_listed() -> None:
    """A size is a prompt for review, never a cap that moves code: a file is split by
    concern. Each file or class above the review size is listed in one warning."""
    found = _oversized()
    if found:
        warnings.warn(SizeReview("above the review size:\n" + "\n".join(found)), stacklevel=1)


def _functions(text: str) -> list[Any]:
    """Every function, method and closure, as ``radon cc --show-closures`` lists them."""
    from radon.complexity import add_inner_blocks, cc_visit
    from radon.visitors import Function

    return [b for b in add_inner_blocks(cc_visit(text)) if isinstance(b, Function)]


def _def_starts(tree: ast.AST) -> dict[int, int]:
    """``def`` line -> the line the definition starts on (its first decorator, if any)."""
    starts = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            starts[node.lineno] = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return starts


def _exempt(lines: list[str], start: int, complexity: int) -> bool:
    """Whether the line above ``start`` (1-based) is ``# Complexity <complexity>...``."""
    if start < 2:
        return False
    found = EXEMPTION.match(lines[start - 2])
    return found is not None and int(found.group(1)) == complexity


def _complexity_offenders(text: str) -> list[tuple[int, str, int]]:
    """``(line, name, complexity)`` of each function above the limit and not exempted."""
    lines = text.splitlines()
    starts = _def_starts(ast.parse(text))
    return sorted(
        (block.lineno, block.fullname, block.complexity)
        for block in _functions(text)
        if block.complexity > MAX_COMPLEXITY
        and not _exempt(lines, starts.get(block.lineno, block.lineno), block.complexity)
    )


def test_no_function_above_the_complexity_limit() -> None:
    pytest.importorskip("radon", reason="the complexity limit is measured with radon (dev extra)")
    offenders = [
        f"{_rel(path)}:{line} {name}: CC {cc}"
        for path in _files()
        for line, name, cc in _complexity_offenders(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, (
        f"functions and closures above cyclomatic complexity {MAX_COMPLEXITY} (split them, or "
        "put `# Complexity N: why` directly above the def):\n" + "\n".join(offenders)
    )


def test_the_complexity_comment_exempts_only_its_function() -> None:
    pytest.importorskip("radon", reason="the complexity limit is measured with radon (dev extra)")
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(16))
    body = f"def f(x):\n{branches}    return -1\n"
    assert _complexity_offenders(body) == [(1, "f", 17)]
    assert _complexity_offenders("# Complexity 17: one table.\n" + body) == []
    assert _complexity_offenders("# Complexity 16: stale.\n" + body) == [(2, "f", 17)]
    decorated = "# Complexity 17: one table.\n@staticmethod\n" + body
    assert _complexity_offenders(decorated) == []
    closure = "def outer():\n" + "".join("    " + ln + "\n" for ln in body.splitlines())
    assert _complexity_offenders(closure) == [(2, "outer.f", 17)]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The guardtrain modules that the module ``name`` (file ``path``) imports anywhere.

    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``;
    relative imports resolve against the module's package.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in _files()}
    modules = set(paths)
    return {name: _imports(path, name, modules) for name, path in paths.items()}


def test_import_graph_sees_every_kind_of_import() -> None:
    """The graph has the edges the cycle check relies on (it would pass vacuously without)."""
    graph = _import_graph()
    assert "guardtrain.engine.config" in graph["guardtrain.engine"]  # __init__ re-export
    assert "guardtrain.callback" in graph["guardtrain"]  # inside the lazy __getattr__
    assert "guardtrain.filters" in graph["guardtrain.engine.config"]  # from guardtrain import x
    assert "benchmarks.suite" in graph["benchmarks"]  # the suite's modules are in the graph
    assert "guardtrain.bench.command" in graph["benchmarks.command"]


def test_no_import_cycle() -> None:
    graph = _import_graph()
    cycles = _cycles(graph)
    described = []
    for members in cycles:
        edges = [f"{a} -> {b}" for a in members for b in sorted(graph[a]) if b in members]
        described.append(f"{len(members)} modules: " + ", ".join(edges))
    assert not cycles, "import cycles among the modules:\n" + "\n".join(described)


def test_readme_is_a_front_page() -> None:
    n = _lines(ROOT / "README.md")
    assert n <= MAX_README_LINES, f"README.md: {n} lines, above {MAX_README_LINES}"


# -- docs that stay true ------------------------------------------------------------------------

DESIGN = ROOT / "docs" / "design.md"
#: The package folders whose modules the "Where things live" table must name.
LISTED_PACKAGES = ("guardtrain", "hydra_plugins/guardtrain_searchpath", "benchmarks")
#: Modules that need no row: a package's ``__init__`` is its folder's row; ``_version.py``
#: holds only the version string that pyproject.toml reads.
UNLISTED_NAMES = frozenset({"__init__.py", "_version.py"})
_ROW = re.compile(r"^\|\s*`(?P<path>[^`]+)`\s*\|(?P<role>.*)\|\s*$")
_BARE = re.compile(r"`(?P<name>[\w.-]+\.py)`")


def _table_rows() -> list[tuple[int, str, str]]:
    """``(line, path, role)`` of each row of design.md's "Where things live" table."""
    rows: list[tuple[int, str, str]] = []
    inside = False
    for number, line in enumerate(DESIGN.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("## "):
            inside = line.strip() == "## Where things live"
            continue
        found = _ROW.match(line) if inside else None
        if found and found["path"] != "path":
            rows.append((number, found["path"], found["role"]))
    return rows


def _table_names() -> dict[str, int]:
    """Every path the table names -> its line: the first column, and in a folder's row
    (a path ending in ``/``) each bare ``name.py`` of its role, as ``folder/name.py``."""
    names: dict[str, int] = {}
    for number, path, role in _table_rows():
        names.setdefault(path, number)
        if path.endswith("/"):
            for found in _BARE.finditer(role):
                names.setdefault(path + found["name"], number)
    return names


def test_where_things_live_is_parsed() -> None:
    """Both forms are read (the checks below would pass vacuously without)."""
    names = _table_names()
    assert "guardtrain/callback.py" in names  # a first column
    assert "guardtrain/engine/" in names  # a folder's row
    assert "guardtrain/engine/decisions.py" in names  # a bare name in the folder's row
    assert "guardtrain/compile/accept.py" in names
    assert "benchmarks/hf_data.py" in names


def test_where_things_live_names_only_what_exists() -> None:
    """Each path of docs/design.md's table exists (a ``*`` pattern matches something)."""
    missing = [
        f"docs/design.md:{line}: {path}"
        for path, line in _table_names().items()
        if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists())
    ]
    assert not missing, "the Where things live table names what does not exist:\n" + "\n".join(
        missing
    )


def test_where_things_live_names_every_module() -> None:
    """Every ``.py`` file in :data:`LISTED_PACKAGES` has a row, or is named in its folder's
    row, except the :data:`UNLISTED_NAMES` (``__init__.py``, ``_version.py``)."""
    names = _table_names()
    unnamed = sorted(
        _rel(path)
        for package in LISTED_PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name not in UNLISTED_NAMES and _rel(path) not in names
    )
    assert not unnamed, (
        "modules that docs/design.md's Where things live table does not name (add each, "
        "with its role, to its folder's row):\n" + "\n".join(unnamed)
    )


#: Cited test files that do not exist yet (none now): a file cited before it is written
#: goes here, and out again once it exists (:func:`test_pending_tests_are_still_pending`).
PENDING_TESTS: frozenset[str] = frozenset()
#: Where citations are looked for. CHANGELOG.md is not read: it is history, and may name
#: files since renamed or removed.
CITING = (
    "guardtrain/**/*.py",
    "hydra_plugins/**/*.py",
    "tests/**/*.py",
    "tests/**/*.yaml",
    "scripts/**/*",
    "examples/**/*",
    "docs/**/*.md",
    "README.md",
)
_NAME = r"(?:::(?P<name>\w+(?:::\w+)*\*?))?"
#: ``tests/<path>`` (a file or folder), or a bare ``test_<name>.py``; either may be followed
#: by ``::name`` (a test, a class or a module-level name; ``prefix*`` for several).
_CITED = re.compile(rf"(?<![\w/.-])(?:tests/(?P<path>[\w./-]*\w)|(?P<bare>test_\w+\.py)){_NAME}")


def _citations(text: str) -> list[tuple[int, str, str | None, bool]]:
    """``(line, path, name, bare)`` of each test cited in ``text``."""
    found: list[tuple[int, str, str | None, bool]] = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in _CITED.finditer(line):
            path = m["path"] if m["path"] else m["bare"]
            found.append((number, path, m["name"], not m["path"]))
    return found


def _defines(path: Path, name: str) -> bool:
    """Whether the module at ``path`` defines ``name``: a function, a class or an assigned
    name at its top level; ``Class::method`` inside a class; ``prefix*`` for any such."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    *outer, last = name.split("::")
    for part in outer:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == part]
        if not classes:
            return False
        body = classes[0].body
    defined: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
    if last.endswith("*"):
        return any(d.startswith(last[:-1]) for d in defined)
    return last in defined


def _broken(path: str, name: str | None, bare: bool) -> str | None:
    """Why a citation is broken, or None."""
    tests = ROOT / "tests"
    if bare:
        candidates = sorted(tests.rglob(path))
        if not candidates:
            return None if f"tests/{path}" in PENDING_TESTS else f"no {path} under tests/"
        target = candidates[0]
    else:
        if f"tests/{path}" in PENDING_TESTS:
            return None
        target = tests / path
        if not target.exists():
            return f"tests/{path} does not exist"
    if name and target.suffix == ".py" and not _defines(target, name):
        return f"{_rel(target)} defines no {name}"
    return None


def _citing_files() -> list[Path]:
    files = {p for pattern in CITING for p in ROOT.glob(pattern) if p.is_file()}
    return sorted(p for p in files if "__pycache__" not in p.parts and p.suffix != ".pyc")


def test_citations_are_found() -> None:
    """The pattern reads each form (the check below would pass vacuously without)."""
    t = "test"  # the examples are not citations of this file's own
    text = (
        f"see {t}s/{t}_a.py::test_b, ({t}s/ddp_scripts/run.py).\n"
        f"``{t}_c.py::Case::test_d`` and {t}s/template_conf/ and x/{t}s/y.py"
    )
    assert _citations(text) == [
        (1, f"{t}_a.py", "test_b", False),
        (1, "ddp_scripts/run.py", None, False),
        (2, f"{t}_c.py", "Case::test_d", True),
        (2, "template_conf", None, False),
    ]
    me = "test_layout.py"
    assert _broken(me, "test_citations_are_found", False) is None
    assert _broken(me, "PENDING_TESTS", True) is None
    assert _broken(me, "test_citations_*", True) is None
    assert _broken(me, "test_no_such_test", False) == f"tests/{me} defines no test_no_such_test"
    assert _broken(f"{t}_no_such_file.py", None, True) is not None
    assert len(_citing_files()) > 50


def test_every_cited_test_exists() -> None:
    """Each ``tests/...`` path and bare ``test_*.py`` name cited in the package, the tests,
    scripts, examples, docs and README.md exists, and so does each ``::name`` cited in a
    test file, except the :data:`PENDING_TESTS`."""
    broken: list[str] = []
    for path in _citing_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, cited, name, bare in _citations(text):
            why = _broken(cited, name, bare)
            if why:
                broken.append(f"{_rel(path)}:{number}: {why}")
    assert not broken, "citations of tests that do not exist:\n" + "\n".join(broken)


def test_pending_tests_are_still_pending() -> None:
    """An entry of :data:`PENDING_TESTS` is removed once its file exists."""
    made = sorted(p for p in PENDING_TESTS if (ROOT / p).exists())
    assert not made, f"{made} exist now: remove them from PENDING_TESTS in tests/test_layout.py"
