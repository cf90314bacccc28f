"""The layout limits of the package, checked mechanically.

* no file in ``guardtrain/`` above :data:`MAX_FILE_LINES` lines;
* no class above :data:`MAX_CLASS_LINES` lines (``end_lineno - lineno + 1``, docstrings
  count);
* no function or closure above cyclomatic complexity :data:`MAX_COMPLEXITY`, as
  ``radon cc --show-closures`` measures it, except one whose ``def`` line (or first
  decorator) is directly preceded by a comment that names its complexity, e.g.
  ``# Complexity 25: the per-call path; split, it measured slower.``;
* no import cycle among guardtrain's modules, counting every ``import`` in a module:
  under ``TYPE_CHECKING``, inside functions, and a package ``__init__``'s re-exports;
* README.md at most :data:`MAX_README_LINES` lines (details go to docs/).

Each failure lists every offender with its number.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "guardtrain"
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300
MAX_COMPLEXITY = 15
MAX_README_LINES = 160
#: The comment that exempts a function: ``# Complexity N`` (N its measured complexity).
EXEMPTION = re.compile(r"^\s*#\s*Complexity\s+(\d+)\b", re.IGNORECASE)


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_file_above_the_line_limit() -> None:
    offenders = [f"{_rel(p)}: {n} lines" for p in _files() if (n := _lines(p)) > MAX_FILE_LINES]
    assert not offenders, f"files above {MAX_FILE_LINES} lines:\n" + "\n".join(offenders)


def test_no_class_above_the_line_limit() -> None:
    offenders = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    offenders.append(f"{_rel(path)}:{node.lineno} class {node.name}: {size} lines")
    assert not offenders, f"classes above {MAX_CLASS_LINES} lines:\n" + "\n".join(offenders)


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


def test_no_import_cycle() -> None:
    graph = _import_graph()
    cycles = _cycles(graph)
    described = []
    for members in cycles:
        edges = [f"{a} -> {b}" for a in members for b in sorted(graph[a]) if b in members]
        described.append(f"{len(members)} modules: " + ", ".join(edges))
    assert not cycles, "import cycles among guardtrain modules:\n" + "\n".join(described)


def test_readme_is_a_front_page() -> None:
    n = _lines(ROOT / "README.md")
    assert n <= MAX_README_LINES, f"README.md: {n} lines, above {MAX_README_LINES}"
