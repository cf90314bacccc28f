"""Compile options: ``compile_kwargs`` checked, a mode expanded, and the stance-miss test.

``torch.compile`` refuses ``mode`` together with ``options``, so a mode is expanded
into inductor options that travel beside guardtrain's guard filter.
"""

from __future__ import annotations

from typing import Any

from guardtrain._torch import inductor_mode_options
from guardtrain.errors import GuardTrainTypeError, GuardTrainValueError
from guardtrain.filters import GuardFilter

__all__ = [
    "COMPILE_KWARGS",
    "COMPILE_MODES",
    "build_compile_kwargs",
    "check_compile_kwargs",
    "is_stance_miss",
]

#: Keys ``compile_kwargs`` accepts; each is passed to ``torch.compile``.
COMPILE_KWARGS = ("backend", "mode", "fullgraph", "dynamic", "options")
#: Values ``compile_kwargs['mode']`` accepts (``torch.compile``'s modes).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
STANCE_MISS_TEXT = "Recompilation triggered with skip_guard_eval_unsafe stance"


def is_stance_miss(err: BaseException) -> bool:
    """Whether ``err`` is Dynamo's error for a cache miss under the unsafe stance (H4)."""
    return isinstance(err, RuntimeError) and STANCE_MISS_TEXT in str(err)


def check_compile_kwargs(compile_kwargs: Any) -> dict[str, Any]:
    """Validate ``compile_kwargs`` and return a copy. Raises with the bad key named."""
    if compile_kwargs is None:
        return {}
    if not isinstance(compile_kwargs, dict) and not hasattr(compile_kwargs, "items"):
        raise GuardTrainTypeError(
            f"`compile_kwargs` must be a dict, got {compile_kwargs!r} "
            f"({type(compile_kwargs).__name__})."
        )
    kwargs = dict(compile_kwargs.items())
    unknown = sorted(set(kwargs) - set(COMPILE_KWARGS))
    if unknown:
        raise GuardTrainValueError(
            f"`compile_kwargs` has unknown key(s) {unknown}; allowed: {list(COMPILE_KWARGS)}."
        )
    backend = kwargs.get("backend", "inductor")
    if not (isinstance(backend, str) or callable(backend)):
        raise GuardTrainTypeError(
            f"`compile_kwargs['backend']` must be a backend name or a callable, got {backend!r}."
        )
    _check_mode(kwargs.get("mode"), backend)
    _check_flags(kwargs)
    options = kwargs.get("options")
    if options is not None:
        kwargs["options"] = _checked_options(options, backend)
    return kwargs


def _check_mode(mode: Any, backend: Any) -> None:
    """A ``mode`` is one of :data:`COMPILE_MODES`, and only with the inductor backend."""
    if mode is None:
        return
    if mode not in COMPILE_MODES:
        raise GuardTrainValueError(
            f"`compile_kwargs['mode']` must be one of {list(COMPILE_MODES)}, got {mode!r}."
        )
    if backend != "inductor":
        raise GuardTrainValueError(
            f"`compile_kwargs['mode']={mode!r}` works only with backend='inductor' "
            f"(got backend={backend!r}): guardtrain combines a mode with its guard "
            "filter by expanding the mode into inductor options."
        )


def _check_flags(kwargs: dict[str, Any]) -> None:
    """``fullgraph`` is a bool, ``dynamic`` a bool or None."""
    if "fullgraph" in kwargs and not isinstance(kwargs["fullgraph"], bool):
        raise GuardTrainTypeError(
            f"`compile_kwargs['fullgraph']` must be a bool, got {kwargs['fullgraph']!r}."
        )
    if kwargs.get("dynamic") is not None and not isinstance(kwargs["dynamic"], bool):
        raise GuardTrainTypeError(
            f"`compile_kwargs['dynamic']` must be a bool or None, got {kwargs['dynamic']!r}."
        )


def _checked_options(options: Any, backend: Any) -> dict[str, Any]:
    """A copy of ``options``: a dict, of inductor options only with the inductor backend."""
    if not hasattr(options, "items"):
        raise GuardTrainTypeError(f"`compile_kwargs['options']` must be a dict, got {options!r}.")
    copied = dict(options.items())
    if backend != "inductor" and set(copied) - {"guard_filter_fn"}:
        raise GuardTrainValueError(
            f"`compile_kwargs['options']` keys {sorted(copied)} are inductor "
            f"options, but backend={backend!r}."
        )
    return copied


def build_compile_kwargs(kwargs: dict[str, Any], guard_filter: GuardFilter) -> dict[str, Any]:
    """Arguments for one ``torch.compile`` call: a fresh ``options`` dict every time (H10).

    A ``mode`` is expanded into inductor options so it can travel beside the
    guard filter (``torch.compile`` refuses ``mode`` together with ``options``).
    """
    backend = kwargs.get("backend", "inductor")
    options: dict[str, Any] = {}
    mode = kwargs.get("mode")
    if mode is not None and mode != "default":
        options.update(inductor_mode_options(mode, kwargs.get("dynamic")))
    options.update(kwargs.get("options") or {})
    options.pop("guard_filter_fn", None)
    options["guard_filter_fn"] = guard_filter
    return {
        "backend": backend,
        "fullgraph": kwargs.get("fullgraph", False),
        "dynamic": kwargs.get("dynamic"),
        "options": options,
    }
