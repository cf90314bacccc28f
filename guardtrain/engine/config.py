"""The adapters' arguments, written once: :class:`GuardConfig`, validated when made.

``GuardTuneCallback``, ``GuardTuner`` and the Hydra schema derive their
arguments from the fields of :class:`GuardConfig` (:mod:`guardtrain.arguments`);
each field's docstring is the argument's documentation. Every error names the
argument, the value and what is allowed. :class:`GuardArguments` lists the
keyword arguments once more, for type checkers; a test keeps it equal to the fields.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

from guardtrain import filters as _filters
from guardtrain.arguments import Accepts
from guardtrain.compile import check_compile_kwargs
from guardtrain.errors import GuardTrainTypeError, GuardTrainValueError
from guardtrain.presets import AUTO, GuardPreset, PresetName, get_preset

__all__ = ["DISABLE_ENV", "GuardArguments", "GuardConfig", "make_config"]

DISABLE_ENV = "GUARDTRAIN_DISABLE"
"""Set to anything but ``""`` or ``"0"`` to make every adapter a no-op."""

#: The preset's levers that an argument overrides when it is not None.
_LEVERS = (
    "warmup_steps",
    "stable_steps",
    "install_free_tensors",
    "recursive_dict_tags",
    "use_stance",
    "direct_dispatch",
)


def _disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip() not in ("", "0")


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """The arguments of ``GuardTuneCallback`` and ``GuardTuner``, validated when made.

    Each field up to ``compile_cache`` is a constructor argument of both adapters,
    with the same name, type and default; a field's type is what the config holds
    and ``Accepts`` names a wider type that an argument also takes (``targets="net"``
    is held as ``["net"]``). ``levers``, ``filter_spec`` and ``disabled`` are derived.
    Each field's docstring below gives the details and the default; what each setting
    does while training: docs/how-it-works.md.

    Args:
        preset: the preset whose levers the arguments below override.
        warmup_steps: training batches with full guards before the stance.
        stable_steps: batches without a compile needed to enter the stance.
        targets: the submodules to compile (names or glob patterns).
        compile_kwargs: the arguments for ``torch.compile``.
        guard_filter: the guard filter, in place of the preset's.
        install_free_tensors: compile with ``install_free_tensors``.
        recursive_dict_tags: Dynamo's recursive dict tags during the run.
        use_stance: enter the unsafe stance once a loop is warm.
        direct_dispatch: run each steady call's cache entry directly.
        unsafe_drop_floor: do not combine the filter with the soundness floor.
        log_metrics: log ``guard/*`` metrics through the Trainer's loggers.
        audit_every: steady batches between audits (``None``: no audits).
        verify_every: steady batches between eager comparisons (``None``: none).
        verify_rtol: relative tolerance of ``verify_every``.
        verify_atol: absolute tolerance of ``verify_every``.
        guard_collectives: make the ranks agree on every guard failure.
        compile_optimizer: compile the optimizers' step too.
        measure_lookup: profile Dynamo's lookup once when the stance is entered.
        lookup_window: batches per measuring window.
        compile_cache: a file for PyTorch's compile-cache artifacts (warm start).
        disabled: make every adapter a no-op (default: from ``GUARDTRAIN_DISABLE``).

    Raises:
        GuardTrainValueError: an unknown preset or filter name; a step count out of
            range (``warmup_steps`` below 0, ``stable_steps``, ``audit_every``,
            ``verify_every`` or ``lookup_window`` below 1); a tolerance that is not a
            number >= 0; ``direct_dispatch=True`` with ``use_stance=False``; a filter
            passed twice (``guard_filter`` and ``guard_filter_fn`` in
            ``compile_kwargs["options"]``); unknown ``compile_kwargs`` keys, or a
            ``mode`` or inductor options with another backend; an empty ``targets``
            list; a ``compile_cache`` that names a folder.
        GuardTrainTypeError: an argument of the wrong type.
        TypeError: an unknown keyword argument, or a positional one.

    Example:
        >>> config = GuardConfig(preset="aggressive", warmup_steps=5, targets="blocks.*")
        >>> config.levers.warmup_steps, config.levers.use_stance, config.targets
        (5, True, ['blocks.*'])
    """

    preset: PresetName = "auto"
    """``"auto"`` (the default: ``turbo`` where direct dispatch is not refused, else
    ``aggressive``), ``"off"``, ``"safe"``, ``"balanced"``, ``"aggressive"`` or ``"turbo"``
    (see :data:`guardtrain.PRESETS`). Explicit arguments below override it."""

    warmup_steps: int | None = None
    """training batches with full guards before the stance (preset: 20)."""

    stable_steps: int | None = None
    """the last ``stable_steps`` batches must not have compiled (preset: 10)."""

    targets: Annotated[list[str] | None, Accepts(str | list[str] | None)] = None
    """``None`` (the network the LightningModule delegates to, when it
    has exactly one child with parameters; else the LightningModule), or
    submodule names / glob patterns (``"blocks.*"``, outermost matches).
    ``""`` names the LightningModule itself."""

    compile_kwargs: Annotated[dict[str, Any], Accepts(dict[str, Any] | None)] = None  # type: ignore[assignment]
    """``backend``, ``mode``, ``fullgraph``, ``dynamic``,
    ``options`` for ``torch.compile``."""

    guard_filter: str | list[str] | _filters.GuardFilter | None = None
    """a filter name from :mod:`guardtrain.filters`, a callable
    ``guard_filter_fn``, or a list of them; replaces the preset's filter.
    It is combined with the soundness floor."""

    install_free_tensors: bool | None = None
    """compile with ``install_free_tensors``."""

    recursive_dict_tags: bool | None = None
    """``use_recursive_dict_tags_for_guards`` during the run;
    ``None`` (every preset) leaves torch's default (off since torch 2.12,
    after segfaults: pytorch/pytorch#181873). ``True`` where torch's
    default is off warns once."""

    use_stance: bool | None = None
    """enter the unsafe stance once a loop is warm."""

    direct_dispatch: bool | None = None
    """in the steady state, run each compiled call's cache entry
    directly, below Dynamo's entry path (preset ``turbo``). Each call is
    checked first: its ``(training, grad, inference mode, autocast)``
    mode, Dynamo's global-state guard, the input tensors' dtype, device,
    ``requires_grad``, sizes, strides and dispatch keys, which arguments
    are one tensor, the values of non-tensor arguments, no active compile
    callback, torch-function mode or saved-tensor hooks, that the entry is
    still in Dynamo's cache, and, where a mode has several entries, the
    guards that tell them apart (what the stance evaluates); a call that
    fails one takes the normal path. Cost: about 1.5-2.5 µs per compiled
    call (2 µs more with several entries for a mode), against Dynamo's
    entry path of tens of µs per frame (docs/bench.md, "Per-call costs"). The
    entry for a mode is the one that Dynamo's own guards accept for the first
    steady call of that mode, chosen again after every boundary, audit and re-arm.
    A target with graph breaks runs its calls whose entry breaks with full guards
    and the others directly, never under the stance. Refused (the summary
    says why) under FSDP (``FSDPStrategy``, ``ModelParallelStrategy``,
    ``fully_shard``) and with ``guard_collectives=True``. Needs ``use_stance``."""

    unsafe_drop_floor: bool = False
    """do not combine the guard filter with the soundness
    floor. Unsafe: ``eval()`` or a new dtype may then silently reuse code."""

    log_metrics: bool = True
    """log ``guard/phase``, ``guard/compiles`` and ``guard/rearms``
    through the Trainer's loggers when they change."""

    audit_every: int | None = 200
    """every ``audit_every`` steady training batches, repeat the
    boundary re-check inside the epoch and run one batch with full guards;
    a compile in that batch means an assumption of the stance broke (a
    global read in ``forward`` changed, say): re-arm with its reason.
    ``None`` disables audits. Cost: one batch with full guards (tens to
    hundreds of µs of guard evaluation) and one walk over the parameters
    per audit; at the default of 200 that is well under 1 µs per step
    (docs/bench.md, "Per-call costs")."""

    verify_every: int | None = None
    """every ``verify_every`` steady training batches, run the eager
    ``forward`` beside the compiled one (same RNG state and buffers, under
    ``no_grad``) and rebuild the target with a report when the outputs
    differ beyond ``verify_rtol``/``verify_atol``. Off by default: each
    verified batch costs one more eager forward and one copy of the
    buffers. With inductor, random ops (dropout) in training mode draw
    differently from eager unless inductor's ``fallback_random`` is set."""

    verify_rtol: float = 1e-4
    """relative tolerance of ``verify_every``."""

    verify_atol: float = 1e-6
    """absolute tolerance of ``verify_every``."""

    guard_collectives: bool = False
    """with several processes, turn on
    ``torch.compiler.set_enable_guard_collectives`` in the training loop once
    the ranks first entered the stance together, so they agree on every
    guard failure. Cost: one ``all_gather_object`` per compiled call, many
    times what a whole call costs under the stance; targets are rebuilt on all ranks together, and a
    stance miss (on any rank) is retried with the plain ``forward``."""

    compile_optimizer: bool = False
    """compile the step of the run's optimizers (``GuardTuner``'s ``optimizers``, the
    Trainer's own in Lightning) as one frame, and run it directly, below Dynamo's
    entry path, while nothing its guards read changed
    (:mod:`guardtrain.compile.optimizer`); put back at the end of the run. Refused for
    ``LBFGS`` and ``differentiable=True``."""

    measure_lookup: bool = False
    """Off by default: the torch profiler runs inside your training only when you ask for
    it (nothing guardtrain decides reads it). ``True``: when training first enters the
    stance, profile ``lookup_window`` batches with full guards and then as many under
    the stance, and report Dynamo's guard and pre-graph µs per step for both
    (``summary()["lookup_us"]``, the logged ``guard/lookup_us``, the summary's saving).
    Skipped when another profiler is running; with several processes a DDP child once
    ended with "terminate called without an active exception" after a run that had
    profiled. Cost, once per run: about 1 ms to start and stop the profiler plus about
    1.5 ms per profiled compiled call, and calls about 12% slower inside the windows
    (measured on the CPU; docs/bench.md, "Per-call costs")."""

    lookup_window: int = 3
    """batches per measuring window."""

    compile_cache: Annotated[str | None, Accepts(str | os.PathLike[str] | None)] = None
    """a file for PyTorch's compile-cache artifacts (warm start);
    ``None`` (default): off. At setup every rank loads it
    (``torch.compiler.load_cache_artifacts``) before anything compiles; at
    the end of the run rank zero saves this process's artifacts there
    (``torch.compiler.save_cache_artifacts``, written atomically; the folder
    is created). A second run on a fresh machine then skips Inductor's and
    AOTAutograd's work (not the C++ compiler's on the CPU). Only the inductor
    backend records artifacts. A missing file logs one INFO line; a corrupt
    file or one saved by another torch or Python warns and compiles cold.
    ``summary()["compile_cache"]`` says what was loaded, hit and saved."""

    disabled: bool = field(default_factory=_disabled_by_env, metadata={"argument": False})
    """``GUARDTRAIN_DISABLE`` was set when the config was made (no adapter argument)."""

    levers: GuardPreset = field(init=False)
    """The preset with the explicit overrides applied."""

    filter_spec: _filters.FilterSpec = field(init=False)
    """The guard filter in use: a name, a callable, a list of them, or None."""

    def __post_init__(self) -> None:
        levers = _levers(self.preset, {k: getattr(self, k) for k in _LEVERS}, self.guard_filter)
        _check_flags(self)
        kwargs = check_compile_kwargs(self.compile_kwargs)
        spec = _filter_spec(self.guard_filter, kwargs, levers)
        set_ = object.__setattr__  # frozen: the checked values replace the passed ones
        set_(self, "levers", levers)
        set_(self, "targets", _targets(self.targets))
        set_(self, "compile_kwargs", kwargs)
        set_(self, "filter_spec", spec)
        set_(self, "audit_every", _every("audit_every", self.audit_every))
        set_(self, "verify_every", _every("verify_every", self.verify_every))
        set_(self, "verify_rtol", float(self.verify_rtol))
        set_(self, "verify_atol", float(self.verify_atol))
        set_(self, "compile_cache", _cache_path(self.compile_cache))

    def for_run(self, compile_kwargs: dict[str, Any] | None) -> GuardConfig:
        """This config, or (``compile_kwargs`` given) a copy with them in place of its own,
        validated again: a run whose adapter took over a framework's own compile."""
        if compile_kwargs is None:
            return self
        return dataclasses.replace(self, compile_kwargs=compile_kwargs)

    @property
    def filter_name(self) -> str | None:
        spec = self.filter_spec
        if spec is None or isinstance(spec, str):
            return spec
        return getattr(spec, "__name__", "custom")


class GuardArguments(TypedDict, total=False):
    """The adapters' keyword-only arguments as type checkers see them: the fields of
    :class:`GuardConfig` after ``preset``, each with the type the argument accepts.

    Each adapter's ``__init__`` takes them as ``**arguments: Unpack[GuardArguments]``, which
    mypy, pyright and IDEs read; its signature is made from the fields (``guardtrain.arguments``).
    ``tests/test_typed_arguments.py`` checks it against the fields: same names, order and
    accepted types."""

    warmup_steps: int | None
    stable_steps: int | None
    targets: str | list[str] | None
    compile_kwargs: dict[str, Any] | None
    guard_filter: str | list[str] | _filters.GuardFilter | None
    install_free_tensors: bool | None
    recursive_dict_tags: bool | None
    use_stance: bool | None
    direct_dispatch: bool | None
    unsafe_drop_floor: bool
    log_metrics: bool
    audit_every: int | None
    verify_every: int | None
    verify_rtol: float
    verify_atol: float
    guard_collectives: bool
    compile_optimizer: bool
    measure_lookup: bool
    lookup_window: int
    compile_cache: str | os.PathLike[str] | None


def make_config(preset: str = "auto", **arguments: Any) -> GuardConfig:
    """``GuardConfig(preset=preset, **arguments)``: the adapters' arguments, validated.

    Raises:
        GuardTrainValueError, GuardTrainTypeError: as :class:`GuardConfig`.
        TypeError: an argument that is not a field of :class:`GuardConfig`.
    """
    return GuardConfig(preset=preset, **arguments)  # type: ignore[arg-type]


def _levers(preset: str, overrides: dict[str, Any], guard_filter: Any) -> GuardPreset:
    """The preset's levers with the arguments that are not None applied."""
    base = get_preset(preset)
    given = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(guard_filter, str):
        given["guard_filter"] = guard_filter
    levers = dataclasses.replace(base, **given)
    if preset == AUTO and "direct_dispatch" not in given and not levers.use_stance:
        levers = dataclasses.replace(levers, direct_dispatch=False)  # auto's choice: no stance
    if levers.direct_dispatch and not levers.use_stance:
        raise GuardTrainValueError(
            f"`direct_dispatch=True` needs the stance, but use_stance=False (preset {preset!r}): "
            "direct dispatch runs only in the steady state. Pass use_stance=True, or "
            "direct_dispatch=False."
        )
    return levers


def _check_flags(config: GuardConfig) -> None:
    """The bools, the lookup settings and the tolerances; the error names the argument."""
    for flag in (
        "unsafe_drop_floor",
        "log_metrics",
        "guard_collectives",
        "compile_optimizer",
        "measure_lookup",
    ):
        value = getattr(config, flag)
        if not isinstance(value, bool):
            raise GuardTrainTypeError(f"`{flag}` must be a bool, got {value!r}.")
    if _every("lookup_window", config.lookup_window) is None:
        raise GuardTrainValueError("`lookup_window` must be >= 1, got None.")
    for flag in ("verify_rtol", "verify_atol"):
        tol = getattr(config, flag)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise GuardTrainValueError(f"`{flag}` must be a number >= 0, got {tol!r}.")


def _filter_spec(
    guard_filter: Any, compile_kwargs: dict[str, Any], levers: GuardPreset
) -> _filters.FilterSpec:
    """The filter in use: ``guard_filter``, else one in ``compile_kwargs``, else the preset's."""
    in_options = (compile_kwargs.get("options") or {}).get("guard_filter_fn")
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
        spec = levers.guard_filter
    _filters.resolve(spec)  # unknown names fail here, when the adapter is made
    return spec


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
