"""Make the ``guard`` config group of guardtrain visible to every Hydra app.

Hydra imports this module while it scans for plugins, before it composes a
config. Importing it must stay cheap: it imports Hydra, OmegaConf and the
standard library only -- not torch, not Lightning, not ``guardtrain``.

It does two things:

* :class:`GuardTrainSearchPathPlugin` appends ``pkg://guardtrain.conf`` to the
  search path, so ``+guard=aggressive`` works without editing the app's config.
  Without the plugin, add ``hydra.searchpath=[pkg://guardtrain.conf]``.
* :class:`GuardTuneConf`, made from the fields of ``GuardConfig`` (read from
  ``guardtrain/engine/config.py`` by ``guardtrain/arguments.py``, loaded by its
  path: guardtrain itself is not imported), is stored in Hydra's ConfigStore as
  ``guardtrain_schema/guard_tune``. Each ``guard/*.yaml`` option extends it
  (``optional``, so the YAML still composes where the schema is not stored):
  a misspelt key or a value of the wrong type fails at composition.

No ``from __future__ import annotations`` here: Hydra's scanner runs this module
before it is in ``sys.modules``, and dataclasses cannot resolve string
annotations then; the schema's field types are objects.
"""

import ast
import importlib.util
import sys
from dataclasses import field, make_dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin

__all__ = [
    "SCHEMA_GROUP",
    "SCHEMA_NAME",
    "SEARCH_PATH",
    "GuardTrainSearchPathPlugin",
    "GuardTuneConf",
]

#: Where the ``guard`` config group lives (a package of the installed distribution).
SEARCH_PATH = "pkg://guardtrain.conf"
#: ConfigStore group and name of :class:`GuardTuneConf`; outside ``guard``, so it is no option.
SCHEMA_GROUP = "guardtrain_schema"
SCHEMA_NAME = "guard_tune"


class GuardTrainSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://guardtrain.conf`` (provider ``guardtrain``) to the config search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="guardtrain", path=SEARCH_PATH)


def _package_root() -> Path | None:
    """The folder of the installed ``guardtrain`` package, found without importing it."""
    spec = importlib.util.find_spec("guardtrain")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _load_arguments(root: Path) -> ModuleType | None:
    """``guardtrain/arguments.py``, loaded by its path: nothing else of guardtrain runs."""
    loader = importlib.util.spec_from_file_location(
        "_guardtrain_searchpath_arguments", root / "arguments.py"
    )
    if loader is None or loader.loader is None:
        return None
    module = importlib.util.module_from_spec(loader)
    sys.modules[loader.name] = module  # dataclasses looks the module up while it runs
    loader.loader.exec_module(module)
    return module


#: Annotation names of ``GuardConfig`` that YAML holds as another type.
_ALIASES: dict[str, Any] = {"PresetName": str, "bool": bool, "int": int, "float": float, "str": str}


def _yaml_type(annotation: str) -> Any:
    """The schema type of a ``GuardConfig`` annotation.

    A union keeps its members that YAML can hold (``bool``, ``int``, ``float``,
    ``str``, ``list[str]``, ``dict[str, Any]``): one member is that type, several
    are ``Any``; ``None`` makes it optional. ``os.PathLike`` and callables drop out.
    """
    members: list[ast.expr] = []
    todo = [ast.parse(annotation, mode="eval").body]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            todo += [node.right, node.left]
        else:
            members.append(node)
    optional = any(isinstance(m, ast.Constant) and m.value is None for m in members)
    kept: list[Any] = []
    for m in members:
        text = ast.unparse(m)
        if text in _ALIASES:
            kept.append(_ALIASES[text])
        elif text.startswith("dict["):
            kept.append(dict[str, Any])
        elif text.startswith("list["):
            kept.append(list[str])
    found: Any = kept[0] if len(kept) == 1 else Any
    return found | None if optional and found is not Any else found


def _schema() -> type | None:
    """:class:`GuardTuneConf`, one field per argument of ``GuardConfig`` (None: not found)."""
    root = _package_root()
    arguments = None if root is None else _load_arguments(root)
    if root is None or arguments is None:
        return None
    source = (root / "engine" / "config.py").read_text(encoding="utf-8")
    fields: list[tuple[str, Any, Any]] = [
        ("_target_", str, field(default="guardtrain.GuardTuneCallback")),
        ("_convert_", str, field(default="all")),
    ]
    for f in arguments.read_fields(source, "GuardConfig"):
        if f.argument:
            fields.append((f.name, _yaml_type(f.annotation), field(default=f.default)))
    doc = """Schema of a ``guard`` option: one field per argument of ``guardtrain.GuardTuneCallback``.

    Made from the fields of ``guardtrain.engine.config.GuardConfig``. Defaults equal the
    constructor's (``None``: take the value from ``preset``); the YAML options set every
    preset field explicitly.
    """
    return make_dataclass(
        "GuardTuneConf", fields, namespace={"__doc__": doc, "__module__": __name__}
    )


GuardTuneConf = _schema()
if GuardTuneConf is not None:
    ConfigStore.instance().store(
        group=SCHEMA_GROUP, name=SCHEMA_NAME, node=GuardTuneConf, provider="guardtrain"
    )
