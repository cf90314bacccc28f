"""Levers: which of the preset's levers the installed torch, the strategy and the world allow.

:func:`resolve` is what :meth:`GuardEngine.setup <guardtrain.engine.engine.GuardEngine.setup>`
runs for each run (the bench calls it too): every lever that the strategy forbids is
switched off with a warning that says why. The supported torch releases (2.11 and later)
have every lever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from guardtrain import filters as _filters
from guardtrain import versions as _versions
from guardtrain._torch import dynamo_config
from guardtrain.compile import direct_supported
from guardtrain.engine.config import GuardConfig
from guardtrain.engine.host import Host
from guardtrain.filters import GuardFilter

__all__ = ["DictTagsNotes", "Levers", "config_values", "requested", "resolve"]


@dataclass(slots=True)
class Levers:
    """The levers in force for this run (a lever the strategy forbids is off)."""

    install_free_tensors: bool = False
    recursive_dict_tags: bool | None = None
    use_stance: bool = False
    guard_filter: GuardFilter | None = None
    direct_dispatch: bool = False
    """Turbo: run harvested entries directly in the steady state (not refused)."""
    switched_off: list[dict[str, str]] = field(default_factory=list)
    """Levers switched off for this run, each ``{"lever": ..., "why": ...}``."""
    direct_refused: str | None = None
    """Why direct dispatch (turbo) is off for the whole run, if it was asked for."""

    def switch_off(self, host: Host, lever: str, why: str) -> None:
        """Record ``lever`` as switched off for ``why``, with a warning."""
        self.switched_off.append({"lever": lever, "why": why})
        host.warn(f"guardtrain: {lever} is switched off: {why}")


@dataclass(slots=True)
class DictTagsNotes:
    """What was said about recursive dict tags (H22, H36): once per engine, not per run."""

    warned: bool = False
    """The warning that they are on where they may crash was given."""
    told: bool = False
    """The run's setup line said that they are off."""
    off: str | None = None
    """Why guardtrain turned torch's default off, for the setup line (once per engine)."""
    overridden: bool = False
    """torch's own default (True on 2.10 and 2.11) is overridden to False."""


def requested(config: GuardConfig) -> Levers:
    """The levers the preset and the explicit arguments ask for, before any check."""
    lv = config.levers
    return Levers(
        lv.install_free_tensors,
        lv.recursive_dict_tags,
        lv.use_stance,
        direct_dispatch=lv.direct_dispatch,
    )


def resolve(
    lv: Levers,
    config: GuardConfig,
    host: Host,
    notes: DictTagsNotes,
    *,
    world_size: int = 1,
    swaps_parameters: str | None = None,
    sharded_by_hand: str | None = None,
) -> None:
    """Switch off, in ``lv``, each lever that this torch, strategy or world does not allow.

    Args:
        lv: the requested levers (:func:`requested`), changed in place.
        config: the run's arguments.
        host: where the warnings go.
        notes: what was already said about recursive dict tags (kept per engine).
        world_size: processes in the run.
        swaps_parameters: a strategy that swaps parameters around every forward (FSDP).
        sharded_by_hand: FSDP2's ``fully_shard`` found without such a strategy (H37).
    """
    swapper = swaps_parameters or sharded_by_hand
    if lv.install_free_tensors and swapper is not None:
        # FSDP gathers and frees the full parameters around every forward, and
        # install_free_tensors bakes the parameter objects into the graph (H3).
        lv.install_free_tensors = False
        lv.switch_off(
            host,
            "install_free_tensors",
            f"{swapper} swaps parameters around every forward, "
            "and install_free_tensors freezes parameter identity in the graph",
        )
    _resolve_dict_tags(lv, config, host, notes)
    if lv.direct_dispatch:
        why = _direct_refusal(lv, config, world_size, swaps_parameters)
        if why is not None:
            lv.direct_dispatch = False
            lv.direct_refused = why
            if config.preset != "auto":  # auto says what it chose at setup, as a choice
                host.warn(f"guardtrain: direct dispatch (turbo) is refused: {why}.")
    spec = config.filter_spec
    resolved = _filters.resolve(spec)
    if resolved is None and spec not in (None, "keep_all"):
        lv.switched_off.append({"lever": "guard_filter", "why": f"{spec!r} is not in this torch"})
    if resolved is not None and not config.unsafe_drop_floor:
        resolved = _filters.with_floor(resolved)
    lv.guard_filter = resolved


def _direct_refusal(
    lv: Levers, config: GuardConfig, world_size: int, swaps_parameters: str | None
) -> str | None:
    """Why direct dispatch (turbo) may not run in this run at all, or None."""
    if not lv.use_stance:
        return "the stance is off"
    if config.guard_collectives and world_size > 1:
        return (
            "guard_collectives=True: a rank whose call took the normal path would "
            "issue a guard collective that ranks running directly never match"
        )
    if swaps_parameters is not None:
        return (
            f"{swaps_parameters} gathers and frees parameters around every forward "
            "(FSDP): a directly run entry would bypass its hooks' expectations"
        )
    if not direct_supported():
        return f"torch {torch.__version__} lacks Dynamo's cache-entry and guard APIs"
    return None


def _resolve_dict_tags(lv: Levers, config: GuardConfig, host: Host, notes: DictTagsNotes) -> None:
    """Recursive dict tags (H22): None leaves torch's default; a bool from the user sets it."""
    cfg = dynamo_config
    explicit = config.levers.recursive_dict_tags
    default = bool(cfg.use_recursive_dict_tags_for_guards)
    release = torch.__version__.split("+")[0]
    # torch 2.10 and 2.11 default to True without the segfault fixes (H36).
    risky = _versions.risky_dict_tags_default()
    notes.overridden = explicit is None and risky
    on = (default and not risky) if explicit is None else explicit
    lv.recursive_dict_tags = on
    if on and (not default or risky) and not notes.warned:
        notes.warned = True
        host.warn(_versions.dict_tags_warning(release, default))
    if not lv.recursive_dict_tags and notes.overridden and not notes.told:
        # Said only where guardtrain overrode torch's default: off by torch's own default
        # or by the user's argument is nothing the user needs to read.
        notes.told = True
        notes.off = f"recursive dict tags are off ({_versions.dict_tags_override_reason(release)})"


def config_values(config: GuardConfig, lv: Levers, notes: DictTagsNotes) -> dict[str, Any]:
    """The Dynamo config values a run sets (after :func:`resolve`).

    Only an explicit ``recursive_dict_tags`` that this torch has (H22), or False
    where torch's own default is overridden (H36); every other lever is applied
    per target or per call.
    """
    explicit = config.levers.recursive_dict_tags
    if explicit is not None and lv.recursive_dict_tags == explicit:
        return {"use_recursive_dict_tags_for_guards": explicit}
    if notes.overridden:
        return {"use_recursive_dict_tags_for_guards": False}
    return {}
