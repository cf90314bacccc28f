"""The adapters' signatures as type checkers read them, checked against ``GuardConfig``.

Each adapter writes its ``__init__`` once, as mypy, pyright and IDEs read it: the
positional and the adapter's own parameters, then ``**arguments: Unpack[GuardArguments]``;
its ``__signature__`` (what ``inspect.signature``, LightningCLI and ``help()`` read) is made
from ``GuardConfig``'s fields (``guardtrain.arguments``). These tests keep the two equal,
and run mypy once on a few calls to see that it reads them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from guardtrain.arguments import argument_parameters, read_fields
from guardtrain.engine.config import GuardArguments, GuardConfig

ROOT = Path(__file__).resolve().parents[1]
_P = inspect.Parameter
#: The adapters: (module, class).
ADAPTERS = [
    ("guardtrain.callback", "GuardTuneCallback"),
    ("guardtrain.tuner", "GuardTuner"),
    ("guardtrain.hf", "GuardTrainerCallback"),
]


def _keyword_fields() -> list[_P]:
    return [p for p in argument_parameters(GuardConfig) if p.kind is _P.KEYWORD_ONLY]


def test_guard_arguments_are_the_keyword_only_fields() -> None:
    """Every keyword-only argument field, nothing more, in the fields' order, each with the
    accepted type (``Wider`` of ``Annotated[Held, Accepts(Wider)]``), written the same."""
    fields = _keyword_fields()
    assert [p.name for p in fields] == list(GuardArguments.__annotations__), (
        "GuardArguments (guardtrain/engine/config.py) must list GuardConfig's keyword-only "
        "argument fields, in their order"
    )
    assert GuardArguments.__required_keys__ == frozenset()  # total=False: all have defaults
    positional = [p.name for p in argument_parameters(GuardConfig) if p not in fields]
    assert positional == ["preset"]  # written out in each adapter's checker __init__

    source = inspect.getsource(sys.modules[GuardConfig.__module__])
    accepted = {f.name: f.annotation for f in read_fields(source, "GuardConfig")}
    written = {f.name: f.annotation for f in read_fields(source, "GuardArguments")}
    namespace = vars(sys.modules[GuardConfig.__module__])
    for p in fields:
        assert written[p.name] == accepted[p.name], p.name
        assert eval(written[p.name], namespace) == p.annotation, p.name


def _adapter(module_name: str, name: str) -> tuple[Any, type]:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # guardtrain.hf needs transformers (a dev dependency)
        pytest.skip(f"{module_name} cannot be imported: {e}")
    return module, getattr(module, name)


def _checker_init(module: Any, name: str) -> ast.FunctionDef:
    """Class ``name``'s ``__init__`` as written (what checkers read), decorated with the
    signature made from the fields (what ``inspect.signature`` reads)."""
    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert [ast.unparse(d) for d in init.decorator_list] == ["_SIGNATURE"], name
    return init


def _parameters(init: ast.FunctionDef, namespace: dict[str, Any]) -> list[tuple[Any, ...]]:
    """``(name, kind, default, annotation)`` of each named parameter, values evaluated."""
    args = init.args
    assert not args.posonlyargs and args.vararg is None
    plain = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    found = []
    for arg, default, kind in [
        *((a, d, _P.POSITIONAL_OR_KEYWORD) for a, d in zip(args.args, plain)),
        *((a, d, _P.KEYWORD_ONLY) for a, d in zip(args.kwonlyargs, args.kw_defaults)),
    ]:
        value = _P.empty if default is None else ast.literal_eval(default)
        hint = _P.empty if arg.annotation is None else eval(ast.unparse(arg.annotation), namespace)
        found.append((arg.arg, kind, value, hint))
    return found


@pytest.mark.parametrize(("module_name", "name"), ADAPTERS)
def test_written_init_is_the_signature(module_name: str, name: str) -> None:
    """The written ``__init__``: the signature's parameters that are no keyword of
    ``GuardArguments`` (``preset``, and ``model`` and ``fabric`` for ``GuardTuner``),
    same names, kinds, defaults and annotations, then ``**arguments: Unpack[GuardArguments]``."""
    module, adapter = _adapter(module_name, name)
    init = _checker_init(module, name)
    assert init.args.kwarg is not None and init.args.kwarg.annotation is not None
    assert ast.unparse(init.args.kwarg.annotation) == "Unpack[GuardArguments]", name

    keywords = set(GuardArguments.__annotations__)
    signature = inspect.signature(adapter.__init__).parameters.values()
    own = [(p.name, p.kind, p.default, p.annotation) for p in signature if p.name not in keywords]
    assert _parameters(init, vars(module)) == own, name
    rest = {p.name for p in signature if p.name in keywords and p.kind is _P.KEYWORD_ONLY}
    assert rest == keywords, name


#: The snippets mypy checks: name -> source. The two ``wrong_`` ones have one error each.
SNIPPETS = {
    "wrong_callback": """
        from guardtrain import GuardTuneCallback

        GuardTuneCallback(warmup_step=3)
    """,
    "wrong_tuner": """
        from torch import nn

        from guardtrain import GuardTuner

        GuardTuner(nn.Linear(2, 2), preset=3)
    """,
    "right_callback": """
        from pathlib import Path

        from guardtrain import GuardTuneCallback

        GuardTuneCallback("aggressive", targets="net", compile_cache=Path("cache.bin"))
        GuardTuneCallback(preset="turbo", warmup_steps=3, guard_filter=["no_dict_tags"])
    """,
    "right_tuner": """
        from torch import nn

        from guardtrain import GuardTuner

        GuardTuner(nn.Linear(2, 2), "safe", fabric=None, compile_kwargs=None, verify_rtol=1e-3)
    """,
    "right_hf": """
        from guardtrain.hf import GuardTrainerCallback

        GuardTrainerCallback(preset="balanced", audit_every=None, targets=["model"])
    """,
}

#: mypy follows guardtrain (ignoring its own errors) and skips everything else (torch,
#: Lightning, transformers: their types become ``Any``), so it takes seconds.
MYPY_CONFIG = """\
[mypy]
mypy_path = {root}
follow_imports = skip
ignore_missing_imports = True
[mypy-guardtrain.*]
follow_imports = normal
ignore_errors = True
"""

_LINE = re.compile(r"^(?P<file>[\w.]+):(?P<line>\d+): (?P<level>error|note): (?P<message>.*)$")


def test_mypy_reads_the_adapters_signatures(tmp_path: Path) -> None:
    """One mypy run: an unknown keyword and a wrong ``preset`` type are its only errors."""
    pytest.importorskip("mypy", reason="mypy is not installed (the dev extra installs it)")
    files = []
    for name, source in SNIPPETS.items():
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source).lstrip(), encoding="utf-8")
        files.append(path.name)
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG.format(root=ROOT), encoding="utf-8")
    command = [sys.executable, "-m", "mypy", "--config-file", str(config)]
    command += ["--cache-dir", os.devnull, "--no-pretty", "--no-color-output", *files]
    start = time.perf_counter()
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - start
    report = f"mypy ({took:.1f} s, exit {out.returncode}):\n{out.stdout}{out.stderr}"

    lines = [m for m in map(_LINE.match, out.stdout.splitlines()) if m]
    errors = sorted(
        (m["file"], int(m["line"]), m["message"]) for m in lines if m["level"] == "error"
    )
    assert len(errors) == 2, report
    assert errors[0][:2] == ("wrong_callback.py", 3), report
    assert errors[0][2].startswith(
        'Unexpected keyword argument "warmup_step" for "GuardTuneCallback"'
    ), report
    assert errors[1][:2] == ("wrong_tuner.py", 5), report
    assert re.match(
        r'Argument "preset" to "GuardTuner" has incompatible type "(Literal\[3\]|int)"; '
        r"expected \"Literal\['auto', 'off', 'safe', 'balanced', 'aggressive', 'turbo'\]\"",
        errors[1][2],
    ), report
    assert not [m for m in lines if m["file"].startswith("right_")], report
    assert out.returncode == 1, report
