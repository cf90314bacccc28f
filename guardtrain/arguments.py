"""The adapters' constructors, made from one argument list: the fields of ``GuardConfig``.

Each adapter writes its ``__init__`` once, as type checkers and IDEs read it: its own and
the positional parameters, then ``**arguments: Unpack[GuardArguments]``, where
:class:`~guardtrain.engine.config.GuardArguments` lists the keyword-only arguments with
the types they accept. :class:`AdapterSignature` gives that ``__init__`` the signature
the fields define (``inspect.signature``, LightningCLI and ``help()`` read it: named
parameters, annotations and defaults, no ``**kwargs``) and binds each call to it.
:func:`document_arguments` writes the fields' docstrings into an adapter's ``Args:``
section, and the Hydra schema (``hydra_plugins/guardtrain_searchpath``) reads the same
fields with :func:`read_fields`. ``tests/test_typed_arguments.py`` checks
``GuardArguments`` and each written ``__init__`` against the fields, and runs mypy on a
few calls.

Standard library only, and nothing from ``guardtrain``: the Hydra plugin loads
this file by its path, without importing torch.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "Accepts",
    "AdapterSignature",
    "FieldSource",
    "argument_parameters",
    "document_arguments",
    "read_fields",
]

_P = inspect.Parameter
_Init = TypeVar("_Init", bound=Callable[..., None])


@dataclass(frozen=True)
class Accepts:
    """``Annotated[Held, Accepts(Wider)]``: the argument takes ``Wider`` and the config
    holds ``Held`` (``targets="net"`` is held as ``["net"]``)."""

    type: Any


def _accepted(hint: Any) -> Any:
    """The type an argument takes: ``Wider`` of ``Annotated[Held, Accepts(Wider)]``, ``Held``
    of another ``Annotated``, else the hint itself."""
    for extra in getattr(hint, "__metadata__", ()):
        if isinstance(extra, Accepts):
            return extra.type
    return hint.__origin__ if hasattr(hint, "__metadata__") else hint


def _hints(config: type) -> dict[str, Any]:
    """The fields' annotations, evaluated in ``config``'s module; forward references inside
    them stay (``GuardFilter`` names ``GuardFilterEntry``, a type that only checkers import)."""
    namespace = vars(sys.modules[config.__module__])
    return {
        f.name: eval(f.type, namespace) if isinstance(f.type, str) else f.type
        for f in dataclasses.fields(config)
    }


def argument_parameters(config: type, positional: Sequence[str] = ("preset",)) -> list[_P]:
    """The constructor arguments that ``config``'s fields define, as parameters.

    Fields with ``init=False`` or ``metadata={"argument": False}`` are no
    arguments. ``positional`` fields may also be passed by position.
    """
    hints = _hints(config)
    params = []
    for f in dataclasses.fields(config):
        if not f.init or f.metadata.get("argument", True) is False:
            continue
        kind = _P.POSITIONAL_OR_KEYWORD if f.name in positional else _P.KEYWORD_ONLY
        params.append(_P(f.name, kind, default=f.default, annotation=_accepted(hints[f.name])))
    return params


class AdapterSignature:
    """An adapter's constructor parameters, made from ``config``'s fields: ``self``,
    ``before``, the positional config fields, then ``keyword`` and the other fields as
    keyword-only parameters.

    The adapter's ``__init__`` is written once, for type checkers
    (``**arguments: Unpack[GuardArguments]``); :attr:`signature` is set as its
    ``__signature__``, what ``inspect.signature``, LightningCLI and ``help()`` read, and
    :meth:`bind` checks a call against it.
    """

    def __init__(self, config: type, *, before: Sequence[_P] = (), keyword: Sequence[_P] = ()):
        fields = argument_parameters(config)
        front = [p for p in fields if p.kind is _P.POSITIONAL_OR_KEYWORD]
        back = [p for p in fields if p.kind is _P.KEYWORD_ONLY]
        params = [_P("self", _P.POSITIONAL_OR_KEYWORD), *before, *front, *keyword, *back]
        self.signature = inspect.Signature(params, return_annotation=None)
        """Raises at import for a bad order or a duplicate name."""
        self.fields = tuple(p.name for p in fields)
        """The parameters that are ``config``'s fields."""

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The config's fields of a call, defaults applied; the ``TypeError`` Python raises
        for an unknown or missing argument."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return {name: bound.arguments[name] for name in self.fields}

    def __call__(self, init: _Init) -> _Init:
        """Decorate the adapter's ``__init__``: its ``__signature__`` is :attr:`signature`."""
        init.__signature__ = self.signature  # type: ignore[attr-defined]
        return init


@dataclass(frozen=True)
class FieldSource:
    """One field of a dataclass as written in its source."""

    name: str
    annotation: str
    """The annotation's text; for ``Annotated[Held, Accepts(Wider)]``, ``Wider``'s."""
    default: Any
    """The default's value (a literal), or :attr:`inspect.Parameter.empty`."""
    doc: str
    """The field's docstring (the string right below it), cleaned; ``""`` if none."""
    argument: bool
    """A constructor argument: not ``field(init=False, ...)`` nor ``metadata={"argument": False}``."""


def read_fields(source: str, class_name: str) -> list[FieldSource]:
    """The fields of class ``class_name`` in module ``source``, with their docstrings."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    found: list[FieldSource] = []
    body = cls.body
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        doc = ""
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            doc = inspect.cleandoc(str(after.value.value))
        default, argument = _default(node.value)
        found.append(
            FieldSource(node.target.id, _annotation(node.annotation), default, doc, argument)
        )
    return found


def _annotation(node: ast.expr) -> str:
    """The annotation's text, or the accepted type's for ``Annotated[..., Accepts(T)]``."""
    if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Annotated"):
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        for extra in items[1:]:
            if isinstance(extra, ast.Call) and ast.unparse(extra.func).endswith("Accepts"):
                return ast.unparse(extra.args[0])
        return ast.unparse(items[0])
    return ast.unparse(node)


def _default(node: ast.expr | None) -> tuple[Any, bool]:
    """``(default, is an argument)`` of a field's value: a literal, or ``field(...)``."""
    if node is None:
        return _P.empty, True
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("field"):
        options = {k.arg: k.value for k in node.keywords}
        init = options.get("init")
        meta = options.get("metadata")
        argument = not (isinstance(init, ast.Constant) and init.value is False)
        if isinstance(meta, ast.Dict):
            pairs = zip(meta.keys, meta.values)
            if any(_literal(k) == "argument" and _literal(v) is False for k, v in pairs):
                argument = False
        value = options.get("default")
        return (ast.literal_eval(value) if value is not None else _P.empty), argument
    return ast.literal_eval(node), True


def _literal(node: ast.expr | None) -> Any:
    return node.value if isinstance(node, ast.Constant) else None


def document_arguments(doc: str | None, config: type, marker: str = "{arguments}") -> str | None:
    """``doc`` with its ``marker`` line replaced by one ``Args:`` entry per argument of
    ``config``, each with the field's docstring (indented as the marker is)."""
    if doc is None:  # python -OO
        return None
    line = next((ln for ln in doc.splitlines() if ln.strip() == marker), None)
    if line is None:
        raise ValueError(f"the docstring has no line {marker!r}")
    indent = line[: len(line) - len(line.lstrip())]
    try:
        docs = {f.name: f.doc for f in read_fields(inspect.getsource(config), config.__name__)}
    except (OSError, TypeError):  # no source (a frozen application): names only
        docs = {}
    entries = []
    for name in (p.name for p in argument_parameters(config)):
        text = docs.get(name) or f"see :class:`{config.__module__}.{config.__name__}`."
        first, *rest = text.splitlines()
        entries.append(f"{indent}{name}: {first}")
        entries.extend(f"{indent}    {r}" if r else "" for r in rest)
    return doc.replace(line, "\n".join(entries))
