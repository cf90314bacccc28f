"""Make the ``guard`` config group of guardtrain visible to every Hydra app.

Hydra imports this module while it scans for plugins, before it composes a
config. Importing it must stay cheap: it imports Hydra, OmegaConf and the
standard library only -- not torch, not Lightning, not ``guardtrain``.

It does two things:

* :class:`GuardTrainSearchPathPlugin` appends ``pkg://guardtrain.conf`` to the
  search path, so ``+guard=aggressive`` works without editing the app's config.
  Without the plugin, add ``hydra.searchpath=[pkg://guardtrain.conf]``.
* :class:`GuardTuneConf` is stored in Hydra's ConfigStore as
  ``guardtrain_schema/guard_tune``. Each ``guard/*.yaml`` option extends it
  (``optional``, so the YAML still composes where the schema is not stored):
  a misspelt key or a value of the wrong type fails at composition.

No ``from __future__ import annotations`` here: Hydra's scanner runs this module
before it is in ``sys.modules``, and ``@dataclass`` cannot resolve string
annotations then.
"""

from dataclasses import dataclass
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


@dataclass
class GuardTuneConf:
    """Schema of a ``guard`` option: one field per argument of ``guardtrain.GuardTuneCallback``.

    Defaults equal the constructor's (``None``: take the value from ``preset``);
    the YAML options set every preset field explicitly.
    """

    _target_: str = "guardtrain.GuardTuneCallback"
    _convert_: str = "all"
    preset: str = "balanced"
    warmup_steps: int | None = None
    stable_steps: int | None = None
    targets: Any = None
    compile_kwargs: dict[str, Any] | None = None
    guard_filter: Any = None
    install_free_tensors: bool | None = None
    recursive_dict_tags: bool | None = None
    use_stance: bool | None = None
    direct_dispatch: bool | None = None
    unsafe_drop_floor: bool = False
    log_metrics: bool = True
    audit_every: int | None = 200
    verify_every: int | None = None
    verify_rtol: float = 1e-4
    verify_atol: float = 1e-6
    guard_collectives: bool = False
    measure_lookup: bool | None = None
    lookup_window: int = 3
    compile_cache: str | None = None


ConfigStore.instance().store(
    group=SCHEMA_GROUP, name=SCHEMA_NAME, node=GuardTuneConf, provider="guardtrain"
)
