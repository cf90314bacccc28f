"""Named presets: which guard levers a :class:`~guardtrain.GuardTuneCallback` pulls.

Each preset is a frozen :class:`GuardPreset`. Its field names are the
constructor arguments of the callback, so ``GuardTuneCallback(preset="balanced",
use_stance=False)`` reads as "the balanced preset, but never enter the stance".

| preset     | recursive dict tags | install_free_tensors | guard filter             | stance |
|------------|---------------------|----------------------|--------------------------|--------|
| auto       | torch's default     | yes                  | skip_all_nn_modules      | yes: turbo where not refused, else aggressive |
| off        | torch's default     | no                   | none                     | no     |
| safe       | torch's default     | yes                  | none                     | no     |
| balanced   | torch's default     | yes                  | skip_inbuilt_nn_modules  | yes    |
| aggressive | torch's default     | yes                  | skip_all_nn_modules      | yes    |
| turbo      | torch's default     | yes                  | skip_all_nn_modules      | yes, and direct dispatch |

Every preset compiles; ``off`` only leaves Dynamo's guards as they are.

``auto``, the default, is the fastest configuration the run allows: ``turbo``'s levers,
and where direct dispatch is refused (FSDP, guard collectives) ``aggressive``'s stance, per target, with no warning: the setup line and
``summary()["auto"]`` say what it chose and why. Every preset is equally sound on
guardtrain's suites, so the default takes the fastest (docs/design.md, "The default").
It is not in :data:`PRESETS`: :func:`get_preset` gives it ``turbo``'s levers.

``safe`` keeps every guard and never enters the stance: ``install_free_tensors``
removes the pre-graph bytecode that passes the parameters in as graph inputs,
and guardtrain gives each target a private code object (instances never share
a graph) and re-checks parameter identity at loop and epoch boundaries (a
replaced parameter rebuilds the target).

``turbo`` is ``aggressive`` plus direct dispatch (``direct_dispatch=True``): in
the steady state each compiled call runs the cache entry that Dynamo chose for
its mode directly, below Dynamo's entry path, after guardtrain's own per-call
checks (the call's mode, global state, the input tensors' metadata, the values
of non-tensor arguments, no active compile callback, torch-function mode or
saved-tensor hooks, and that the entry is still in Dynamo's cache). A call that
fails a check takes the normal path. A target with graph breaks runs the calls whose
entry breaks with full guards and the others directly, never under the stance (a default
target with no entry that runs whole is split first). FSDP runs and
``guard_collectives=True`` are refused, and the summary says why.

Recursive dict tags (Dynamo's config ``use_recursive_dict_tags_for_guards``)
stay at torch's default in every preset (``recursive_dict_tags=None``): PyTorch
switched them off by default after segfaults (pytorch/pytorch#181873), and
torch 2.13 has them off. Pass ``recursive_dict_tags=True`` to turn them on anyway
(guardtrain then warns once).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping

from guardtrain.errors import GuardTrainTypeError, GuardTrainValueError

__all__ = [
    "AUTO",
    "BENCH_GUARD_SHARE",
    "DEFAULT_PRESET",
    "GuardPreset",
    "PRESETS",
    "PRESET_NAMES",
    "PresetName",
    "get_preset",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardPreset:
    """The levers of one preset. Field names equal the callback's arguments.

    What each lever does: docs/how-it-works.md ("Presets, levers and the floor").

    Args:
        warmup_steps: training batches with full guards before the stance.
        stable_steps: batches without a compile needed to enter the stance.
        recursive_dict_tags: Dynamo's recursive dict tags (``None``: torch's default).
        install_free_tensors: compile with ``install_free_tensors``.
        guard_filter: a filter name from :mod:`guardtrain.filters`, or ``None``.
        use_stance: enter the unsafe stance once a loop is warm.
        direct_dispatch: run each steady call's cache entry directly.

    Raises:
        GuardTrainTypeError: a step count that is not an int, a flag that is not a
            bool (``recursive_dict_tags``: nor ``None``), a ``guard_filter`` that is
            not a name or ``None``.
        GuardTrainValueError: ``warmup_steps`` below 0 or ``stable_steps`` below 1.
        TypeError: an unknown keyword argument, or a positional one.

    Example:
        >>> balanced = GuardPreset(
        ...     install_free_tensors=True, guard_filter="skip_inbuilt_nn_modules", use_stance=True
        ... )
        >>> balanced == PRESETS["balanced"]
        True
    """

    warmup_steps: int = 20
    """Training batches that run with full guards before the stance may be entered."""

    stable_steps: int = 10
    """The stance is entered only when none of the last ``stable_steps`` batches compiled."""

    recursive_dict_tags: bool | None = None
    """Dynamo's config ``use_recursive_dict_tags_for_guards`` during the run;
    ``None``: torch's default (the config is left alone)."""

    install_free_tensors: bool = False
    """Compile with Dynamo's config ``install_free_tensors`` (each target gets a private cache)."""

    guard_filter: str | None = None
    """Name of a filter in :mod:`guardtrain.filters`, or ``None`` to keep every guard."""

    use_stance: bool = False
    """Enter ``set_stance(skip_guard_eval_unsafe=True)`` once a loop is warm."""

    direct_dispatch: bool = False
    """In the steady state, run each call's compiled entry directly, below Dynamo's
    entry path, after guardtrain's own per-call checks (needs ``use_stance``)."""

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "stable_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise GuardTrainTypeError(
                    f"`{name}` must be an int, got {value!r} ({type(value).__name__})."
                )
        if self.warmup_steps < 0:
            raise GuardTrainValueError(f"`warmup_steps` must be >= 0, got {self.warmup_steps}.")
        if self.stable_steps < 1:
            raise GuardTrainValueError(f"`stable_steps` must be >= 1, got {self.stable_steps}.")
        for name in ("install_free_tensors", "use_stance", "direct_dispatch"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise GuardTrainTypeError(
                    f"`{name}` must be a bool, got {value!r} ({type(value).__name__})."
                )
        if self.recursive_dict_tags is not None and not isinstance(self.recursive_dict_tags, bool):
            raise GuardTrainTypeError(
                "`recursive_dict_tags` must be a bool or None, got "
                f"{self.recursive_dict_tags!r} ({type(self.recursive_dict_tags).__name__})."
            )
        if self.guard_filter is not None and not isinstance(self.guard_filter, str):
            raise GuardTrainTypeError(
                f"A preset's `guard_filter` must be a filter name or None, got {self.guard_filter!r}."
            )


PRESETS: Mapping[str, GuardPreset] = MappingProxyType(
    {
        "off": GuardPreset(),
        "safe": GuardPreset(install_free_tensors=True),
        "balanced": GuardPreset(
            install_free_tensors=True,
            guard_filter="skip_inbuilt_nn_modules",
            use_stance=True,
        ),
        "aggressive": GuardPreset(
            install_free_tensors=True,
            guard_filter="skip_all_nn_modules",
            use_stance=True,
        ),
        "turbo": GuardPreset(
            install_free_tensors=True,
            guard_filter="skip_all_nn_modules",
            use_stance=True,
            direct_dispatch=True,
        ),
    }
)
"""Preset name -> :class:`GuardPreset`."""

BENCH_GUARD_SHARE: Mapping[str, float] = MappingProxyType(
    {"off": 0.94, "safe": 0.91, "balanced": 0.09, "aggressive": 0.054, "turbo": 0.054}
)
"""Each preset's guard and pre-graph time per call as a share of plain compile's, as the
bench measured it on its 12-block transformer (torch 2.13.0, CPU, inductor): 5.4% for
``aggressive`` and ``turbo`` (which also skips Dynamo's entry path: its call is below
the floor's), 9% for ``balanced``, 91% for ``safe`` (docs/bench.md, "Guard and pre-graph
time per call"). The summary names it as the bench's figure, never as the run's."""

AUTO = "auto"
"""The default preset: ``turbo``'s levers, ``aggressive``'s stance where direct dispatch
is refused (per target, or the run)."""

DEFAULT_PRESET = AUTO
"""The preset of every adapter when none is named."""

PRESET_NAMES: tuple[str, ...] = (AUTO, *PRESETS)
"""Every name that ``preset=`` accepts: ``auto`` and the keys of :data:`PRESETS`."""

PresetName = Literal["auto", "off", "safe", "balanced", "aggressive", "turbo"]
""":data:`PRESET_NAMES`, in order, as a type: ``GuardTuneCallback(preset=...)`` is
annotated with it, so type checkers and LightningCLI (``--help``) know the names."""


def get_preset(name: str) -> GuardPreset:
    """Return the preset called ``name``; the error lists the valid names."""
    if not isinstance(name, str):
        raise GuardTrainTypeError(
            f"`preset` must be one of {list(PRESET_NAMES)}, got {name!r} ({type(name).__name__})."
        )
    if name == AUTO:
        return PRESETS["turbo"]
    try:
        return PRESETS[name]
    except KeyError:
        raise GuardTrainValueError(
            f"`preset` must be one of {list(PRESET_NAMES)}, got {name!r}."
        ) from None
