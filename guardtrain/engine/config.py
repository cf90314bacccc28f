"""What a run was asked to do: the preset's levers and the adapter's other arguments.

:func:`make_config` validates the keyword arguments that ``GuardTuneCallback``
and ``GuardTuner`` share and returns one frozen :class:`GuardConfig`; every
error names the argument, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from guardtrain import filters as _filters
from guardtrain.compile import check_compile_kwargs
from guardtrain.errors import GuardTrainTypeError, GuardTrainValueError
from guardtrain.presets import GuardPreset, get_preset

__all__ = ["DISABLE_ENV", "GuardConfig", "make_config"]

DISABLE_ENV = "GUARDTRAIN_DISABLE"
"""Set to anything but ``""`` or ``"0"`` to make every adapter a no-op."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """The validated arguments of one ``GuardTuneCallback`` or ``GuardTuner``."""

    preset: str
    """The preset's name."""
    levers: GuardPreset
    """The preset with the explicit overrides applied."""
    targets: list[str] | None
    """Submodule names or glob patterns, or None for the default target."""
    compile_kwargs: dict[str, Any]
    """Validated arguments for ``torch.compile``."""
    filter_spec: _filters.FilterSpec
    """The guard filter: a name, a callable, a list of them, or None."""
    unsafe_drop_floor: bool = False
    """Do not combine the filter with the soundness floor."""
    log_metrics: bool = True
    """Log ``guard/*`` metrics when they change."""
    audit_every: int | None = 200
    """Steady training batches between audits; None: no audits."""
    verify_every: int | None = None
    """Steady training batches between eager checks; None: off."""
    verify_rtol: float = 1e-4
    """Relative tolerance of the eager check."""
    verify_atol: float = 1e-6
    """Absolute tolerance of the eager check."""
    guard_collectives: bool = False
    """Ranks agree on every guard failure (one collective per compiled call)."""
    measure_lookup: bool | None = None
    """Profile guard time once; None: only in single-process runs."""
    lookup_window: int = 3
    """Batches per profiled window."""
    compile_cache: str | None = None
    """File of PyTorch's compile-cache artifacts (warm start): loaded at setup on every
    rank, saved at the end of a run by rank zero; None: off."""
    disabled: bool = False
    """``GUARDTRAIN_DISABLE`` was set when the settings were made."""

    @property
    def filter_name(self) -> str | None:
        spec = self.filter_spec
        if spec is None or isinstance(spec, str):
            return spec
        return getattr(spec, "__name__", "custom")


def _every(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GuardTrainTypeError(f"`{name}` must be an int or None, got {value!r}.")
    if value < 1:
        raise GuardTrainValueError(f"`{name}` must be >= 1 (or None to disable), got {value}.")
    return value


def _targets(targets: Any) -> list[str] | None:
    if isinstance(targets, str):
        targets = [targets]
    if targets is None:
        return None
    if isinstance(targets, (bytes, dict)) or not isinstance(targets, Sequence):
        raise GuardTrainTypeError(
            f"`targets` must be None, a name or a list of names, got {targets!r}."
        )
    names = list(targets)
    if not names or any(not isinstance(t, str) for t in names):
        raise GuardTrainValueError(
            f"`targets` must hold submodule names or glob patterns, got {names!r}."
        )
    return names


def _cache_path(value: Any) -> str | None:
    """``compile_cache``: None, or a file path (``str`` or ``os.PathLike``), kept as a str."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise GuardTrainTypeError(
            "`compile_cache` must be a file path (str or os.PathLike) or None, got "
            f"{value!r} ({type(value).__name__})."
        )
    if not path.strip() or os.path.isdir(os.path.expanduser(path)):
        raise GuardTrainValueError(
            f"`compile_cache` must name a file (its folder is created when saving), got {path!r}."
        )
    return path


def _check_flags(measure_lookup: Any, **flags: Any) -> None:
    """Each of ``flags`` is a bool; ``measure_lookup`` is a bool or None."""
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise GuardTrainTypeError(f"`{flag}` must be a bool, got {value!r}.")
    if measure_lookup is not None and not isinstance(measure_lookup, bool):
        raise GuardTrainTypeError(
            f"`measure_lookup` must be a bool or None, got {measure_lookup!r}."
        )


def _check_tolerances(**tolerances: Any) -> None:
    """Each of ``tolerances`` is a number >= 0 (not a bool)."""
    for flag, tol in tolerances.items():
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise GuardTrainValueError(f"`{flag}` must be a number >= 0, got {tol!r}.")


def _filter_spec(
    kwargs: dict[str, Any], guard_filter: _filters.FilterSpec, default: _filters.FilterSpec
) -> _filters.FilterSpec:
    """The guard filter: ``compile_kwargs``' ``guard_filter_fn``, ``guard_filter``, or the
    preset's; passed twice is an error, and an unknown name fails here."""
    in_options = (kwargs.get("options") or {}).get("guard_filter_fn")
    if in_options is not None and guard_filter is not None:
        raise GuardTrainValueError(
            "A guard filter was passed twice: as `guard_filter` and as "
            "`compile_kwargs['options']['guard_filter_fn']`. Pass it once, as `guard_filter`."
        )
    spec: _filters.FilterSpec
    if in_options is not None:
        spec = in_options
    elif guard_filter is not None:
        spec = guard_filter
    else:
        spec = default
    _filters.resolve(spec)  # unknown names fail here, when the adapter is made
    return spec


def make_config(
    preset: str = "balanced",
    *,
    warmup_steps: int | None = None,
    stable_steps: int | None = None,
    targets: str | Sequence[str] | None = None,
    compile_kwargs: dict[str, Any] | None = None,
    guard_filter: _filters.FilterSpec = None,
    install_free_tensors: bool | None = None,
    recursive_dict_tags: bool | None = None,
    use_stance: bool | None = None,
    direct_dispatch: bool | None = None,
    unsafe_drop_floor: bool = False,
    log_metrics: bool = True,
    audit_every: int | None = 200,
    verify_every: int | None = None,
    verify_rtol: float = 1e-4,
    verify_atol: float = 1e-6,
    guard_collectives: bool = False,
    measure_lookup: bool | None = None,
    lookup_window: int = 3,
    compile_cache: str | os.PathLike[str] | None = None,
) -> GuardConfig:
    """Validate the adapters' shared arguments (see ``GuardTuneCallback``).

    Raises:
        GuardTrainValueError: an unknown preset or filter name, a step count out of
            range, a filter passed twice, unknown ``compile_kwargs`` keys.
        GuardTrainTypeError: an argument of the wrong type.
    """
    base = get_preset(preset)
    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "warmup_steps": warmup_steps,
            "stable_steps": stable_steps,
            "install_free_tensors": install_free_tensors,
            "recursive_dict_tags": recursive_dict_tags,
            "use_stance": use_stance,
            "direct_dispatch": direct_dispatch,
        }.items()
        if v is not None
    }
    if isinstance(guard_filter, str):
        overrides["guard_filter"] = guard_filter
    levers = dataclasses.replace(base, **overrides)
    if levers.direct_dispatch and not levers.use_stance:
        raise GuardTrainValueError(
            f"`direct_dispatch=True` needs the stance, but use_stance=False (preset {preset!r}): "
            "direct dispatch runs only in the steady state. Pass use_stance=True, or "
            "direct_dispatch=False."
        )
    _check_flags(
        measure_lookup,
        unsafe_drop_floor=unsafe_drop_floor,
        log_metrics=log_metrics,
        guard_collectives=guard_collectives,
    )
    window = _every("lookup_window", lookup_window)
    if window is None:
        raise GuardTrainValueError("`lookup_window` must be >= 1, got None.")
    _check_tolerances(verify_rtol=verify_rtol, verify_atol=verify_atol)
    kwargs = check_compile_kwargs(compile_kwargs)
    spec = _filter_spec(kwargs, guard_filter, levers.guard_filter)
    return GuardConfig(
        preset=preset,
        levers=levers,
        targets=_targets(targets),
        compile_kwargs=kwargs,
        filter_spec=spec,
        unsafe_drop_floor=unsafe_drop_floor,
        log_metrics=log_metrics,
        audit_every=_every("audit_every", audit_every),
        verify_every=_every("verify_every", verify_every),
        verify_rtol=float(verify_rtol),
        verify_atol=float(verify_atol),
        guard_collectives=guard_collectives,
        measure_lookup=measure_lookup,
        lookup_window=window,
        compile_cache=_cache_path(compile_cache),
        disabled=os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"),
    )
