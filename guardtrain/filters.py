"""Guard filters by name, their composition, and the soundness floor.

A guard filter is what ``torch.compile(options={"guard_filter_fn": f})``
takes: a function of a list of Dynamo's ``GuardFilterEntry`` records that
returns one ``bool`` per entry (``True`` keeps the guard).

Named filters (:data:`NAMED_FILTERS`) wrap PyTorch's own
``torch.compiler.*_unsafe`` functions. Every filter guardtrain installs is
combined with :func:`soundness_floor` (:func:`with_floor`), which keeps the
guards whose loss cannot be repaired by a re-check between batches:

* global state: grad mode, autocast and other global flags, torch-function
  state, default device, deterministic algorithms, functorch's transforms
  (``grad``, ``vmap``) and forward-AD's dual level, as the installed torch names
  them (:data:`FLOOR_GUARD_TYPES`);
* the guards that decide whether code creates state (``hasattr`` on a module,
  a key's presence; H39);
* the shape environment (symbolic shapes);
* every guard on the inputs of the compiled frame (tensor metadata of the
  arguments, the structure of containers passed in);
* ``.training`` flags of modules, so ``eval()`` recompiles;
* the values of bool, int, float and str attributes that the compiled code
  reads (H19), so a changed scalar recompiles instead of running a stale
  constant. Under the stance these are skipped like every other guard;
  guardtrain's change tracking sees the assignment before the next call (H33);
* the length of a list or tuple that the compiled code reads (``self.active``,
  whose items pick the blocks that run): a list changed in place is polled per
  call (:mod:`guardtrain.compile.polled`), and its new length then recompiles an
  entry beside the old one instead of rebuilding.

The saved-tensor-hooks guard is not in the floor: every compiled call checks
for active saved-tensor hooks in guardtrain's wrapper instead (H31).
guardtrain's ``skip_all_nn_modules`` (the ``aggressive`` filter) also drops the
guards that guardtrain re-checks itself (:func:`skip_rechecked`): identity
guards on global modules, functions and builtins, re-checked at loop
boundaries and audits, and the saved-tensor-hooks guard.

Example:
    >>> from guardtrain import filters
    >>> f = filters.resolve("skip_all_nn_modules")
    >>> callable(f)
    True
    >>> sorted(filters.NAMED_FILTERS)[:2]
    ['keep_all', 'keep_portable']
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, Union

from guardtrain.errors import GuardTrainTypeError, GuardTrainValueError

if TYPE_CHECKING:  # pragma: no cover
    from guardtrain._torch import GuardFilterEntry

GuardFilter = Callable[[Sequence["GuardFilterEntry"]], Sequence[bool]]
FilterSpec = Union[str, GuardFilter, Sequence[str | GuardFilter], None]

__all__ = [
    "GuardFilter",
    "NAMED_FILTERS",
    "FLOOR_GUARD_TYPES",  # noqa: F822 - module __getattr__, read on first use
    "GLOBAL_STATE_GUARD_TYPES",
    "STATE_CREATION_GUARD_TYPES",
    "GLOBAL_IDENTITY_GUARD_TYPES",
    "SAVED_TENSORS_HOOKS",
    "is_rechecked",
    "skip_rechecked",
    "keep_all",
    "soundness_floor",
    "all_of",
    "any_of",
    "with_floor",
    "resolve",
    "available",
]

#: Guard types of global state that some torch version defines (``GuardBuilder``'s
#: methods): the floor keeps those of them that the installed torch has.
GLOBAL_STATE_GUARD_TYPES = (
    "GRAD_MODE",
    "GLOBAL_STATE",
    "TORCH_FUNCTION_STATE",
    "DEFAULT_DEVICE",
    "SHAPE_ENV",
    "DETERMINISTIC_ALGORITHMS",
    "FUNCTORCH_STACK_MATCH",
    "DUAL_LEVEL",
    "FSDP_TRAINING_STATE",
)


@functools.cache
def floor_guard_types() -> frozenset[str]:
    """Guard types of global state in the installed torch (grad mode, autocast and the
    other global flags, torch-function state, default device, the shape environment,
    deterministic algorithms, functorch's transform stack, forward-AD's dual level):
    the names of :data:`GLOBAL_STATE_GUARD_TYPES` that its ``GuardBuilder`` defines.
    Also ``filters.FLOOR_GUARD_TYPES``; read on first use (``import guardtrain`` does not
    import torch)."""
    from guardtrain._torch import guard_builder_names

    names = guard_builder_names()
    return frozenset(n for n in GLOBAL_STATE_GUARD_TYPES if n in names)


def __getattr__(name: str) -> Any:
    if name == "FLOOR_GUARD_TYPES":
        return floor_guard_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Guards that decide whether compiled code creates state: ``hasattr(self, "_buf")``
#: before a buffer is made on the first call (litgpt's LoRA, H39), or a key's presence.
#: Dropped, the code traced on the first call would create it again on every call.
STATE_CREATION_GUARD_TYPES = frozenset({"HASATTR", "DICT_CONTAINS", "DICT_NOT_CONTAINS"})

#: Identity guards that guardtrain re-checks at loop boundaries and audits when
#: they are on globals (``G[...]``: imported modules, functions, builtins, classes,
#: and the aliasing between two such globals), so a filter may drop them (H31).
#: Value guards on globals (a global ``bool`` or ``float``) are not among them:
#: a changed value must recompile at once, also in warm-up (as H19).
GLOBAL_IDENTITY_GUARD_TYPES = frozenset(
    {
        "ID_MATCH",
        "MODULE_MATCH",
        "FUNCTION_MATCH",
        "CLASS_MATCH",
        "BUILTIN_MATCH",
        "CLOSURE_MATCH",
        "TYPE_MATCH",
        "DUPLICATE_INPUT",
    }
)

SAVED_TENSORS_HOOKS = "AUTOGRAD_SAVED_TENSORS_HOOKS"
"""The saved-tensor-hooks guard type: guardtrain's wrapper checks it per call (H31)."""

#: name -> (attribute of ``torch.compiler``, torch version that added it).
#: ``skip_all_nn_modules`` is PyTorch's filter combined with :func:`skip_rechecked`.
NAMED_FILTERS: dict[str, tuple[str | None, str]] = {
    "keep_all": (None, "2.8"),
    "skip_inbuilt_nn_modules": ("skip_guard_on_inbuilt_nn_modules_unsafe", "2.8"),
    "skip_all_nn_modules": ("skip_guard_on_all_nn_modules_unsafe", "2.8"),
    "skip_globals": ("skip_guard_on_globals_unsafe", "2.8"),
    "keep_tensors": ("keep_tensor_guards_unsafe", "2.8"),
    "keep_portable": ("keep_portable_guards_unsafe", "2.11"),
    "skip_all": ("skip_all_guards_unsafe", "2.10"),
}


def keep_all(entries: Sequence[GuardFilterEntry]) -> list[bool]:
    """Keep every guard (Dynamo's default)."""
    return [True] * len(entries)


def is_rechecked(entry: GuardFilterEntry) -> bool:
    """Whether guardtrain checks this guard itself: an identity guard on a global
    (at boundaries and audits) or the saved-tensor-hooks guard (per call), H31."""
    if entry.guard_type == SAVED_TENSORS_HOOKS:
        return True
    return (
        entry.is_global
        and entry.guard_type in GLOBAL_IDENTITY_GUARD_TYPES
        and entry.name.startswith("G[")
    )


def skip_rechecked(entries: Sequence[GuardFilterEntry]) -> list[bool]:
    """Drop the guards guardtrain checks itself (:func:`is_rechecked`, H31).

    Only sound inside guardtrain: :class:`~guardtrain.compile.CompiledTarget`
    records each dropped global identity guard and re-checks it at loop
    boundaries and audits (a change rebuilds the target), keeps any it cannot
    record, and checks for saved-tensor hooks on every call.
    """
    return [not is_rechecked(e) for e in entries]


#: Named filters that also drop the guards guardtrain re-checks itself (H31).
_PLUS_RECHECKED = frozenset({"skip_all_nn_modules"})


def _is_nn_module_source(entry: GuardFilterEntry) -> bool:
    source = getattr(entry.orig_guard, "source", None)
    check = getattr(source, "is_unspecialized_nn_module", None)
    return bool(check()) if check is not None else False


_SCALARS = (bool, int, float, str)
_TRAINING = (".training", "'training')")
"""A guard's name that reads a module's ``training`` flag: ``m.training``, or Dynamo's
``object.__getattribute__(m, 'training')`` (a module with its own ``__getattr__``)."""
_LENGTH_GUARDS = frozenset({"SEQUENCE_LENGTH", "LIST_LENGTH", "TUPLE_LENGTH"})
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})


def _floor_keeps(entry: GuardFilterEntry) -> bool:
    if entry.guard_type in floor_guard_types():
        return True
    if entry.guard_type in STATE_CREATION_GUARD_TYPES and not entry.is_global:
        return True
    if entry.name.endswith(_TRAINING):
        return True
    if entry.guard_type in _LENGTH_GUARDS and not entry.is_global:
        return True
    if (
        entry.guard_type in _VALUE_GUARDS
        and not entry.is_global
        and entry.has_value
        and type(entry.value) in _SCALARS
    ):
        # A bool, int, float or str attribute read in `forward` (an annealed
        # temperature, H19): a change recompiles (and Dynamo then makes a float
        # an input) instead of running a stale constant.
        return True
    # Guards on the frame's inputs: neither a global nor reached through a module.
    return not entry.is_global and bool(entry.name) and not _is_nn_module_source(entry)


def soundness_floor(entries: Sequence[GuardFilterEntry]) -> list[bool]:
    """Return ``True`` for each guard that guardtrain never lets a filter drop."""
    return [_floor_keeps(e) for e in entries]


def all_of(*filters: GuardFilter) -> GuardFilter:
    """Keep a guard only if every filter keeps it (each filter's drops add up)."""
    if not filters:
        return keep_all

    def combined(entries: Sequence[GuardFilterEntry]) -> list[bool]:
        keep = [True] * len(entries)
        for f in filters:
            keep = [k and bool(r) for k, r in zip(keep, f(entries))]
        return keep

    combined.__name__ = "all_of(" + ", ".join(_name(f) for f in filters) + ")"
    return combined


def any_of(*filters: GuardFilter) -> GuardFilter:
    """Keep a guard if any filter keeps it."""

    def combined(entries: Sequence[GuardFilterEntry]) -> list[bool]:
        keep = [False] * len(entries)
        for f in filters:
            keep = [k or bool(r) for k, r in zip(keep, f(entries))]
        return keep

    combined.__name__ = "any_of(" + ", ".join(_name(f) for f in filters) + ")"
    return combined


def with_floor(f: GuardFilter) -> GuardFilter:
    """``f``, but never dropping a guard of :func:`soundness_floor`."""
    if f is keep_all:
        return keep_all
    return any_of(f, soundness_floor)


def _name(f: Any) -> str:
    return getattr(f, "__name__", type(f).__name__)


def available(name: str) -> bool:
    """Whether the installed torch has the named filter."""
    import torch.compiler

    attr, _ = NAMED_FILTERS[name]
    return attr is None or hasattr(torch.compiler, attr)


def _by_name(name: str) -> GuardFilter | None:
    if name not in NAMED_FILTERS:
        raise GuardTrainValueError(
            f"`guard_filter` names an unknown filter {name!r}; "
            f"known filters: {sorted(NAMED_FILTERS)}."
        )
    attr, version = NAMED_FILTERS[name]
    if attr is None:
        return keep_all
    import torch
    import torch.compiler

    fn = getattr(torch.compiler, attr, None)
    if fn is None:
        warnings.warn(
            f"guardtrain: guard filter {name!r} needs torch>={version} "
            f"(installed: {torch.__version__}); it is switched off.",
            stacklevel=3,
        )
        return None
    if name in _PLUS_RECHECKED:
        combined = all_of(fn, skip_rechecked)
        combined.__name__ = name
        return combined
    return fn  # type: ignore[no-any-return]


def resolve(spec: FilterSpec) -> GuardFilter | None:
    """Turn a filter name, a callable, or a sequence of them into one filter.

    A sequence combines its members with :func:`all_of` (each one's drops add
    up). ``None`` returns ``None`` (keep every guard). A named filter that the
    installed torch lacks is switched off with a warning naming the version it
    needs. The floor is not added here: see :func:`with_floor`.

    Raises:
        GuardTrainValueError: an unknown filter name (the message lists the known ones).
        GuardTrainTypeError: something that is neither a name nor a callable.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        return _by_name(spec)
    if callable(spec):
        return spec
    if isinstance(spec, Iterable):
        parts = [resolve(s) for s in spec]  # type: ignore[arg-type]
        kept = [p for p in parts if p is not None]
        return all_of(*kept) if kept else None
    raise GuardTrainTypeError(
        f"`guard_filter` must be a filter name, a callable taking a list of "
        f"GuardFilterEntry, or a list of those; got {spec!r} ({type(spec).__name__})."
    )
