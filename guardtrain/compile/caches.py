"""Objects an argument key describes by their attributes: transformers' caches (H53).

Each model call of ``generate()`` carries a transformers ``Cache``: a prefill fills it,
and every decode call adds one position to each layer's key and value tensors. What
Dynamo's guards read of such an object is its class, whether each attribute is there
(``hasattr``, "not in ``__dict__``"), the plain values it holds (``is_initialized``, a
device), the length of its lists (``layers``), the classes' own attributes (through
``type(cache).__mro__``), and the tensors' metadata, whose sizes may be symbolic (a
growing cache length). :func:`~guardtrain.compile.call_mode.call_key` describes such an
object as ``(class, attribute names, class-dictionary versions)`` followed by each
attribute's value as it describes any argument (tensors by their place, plain values by
value, lists and dicts by their structure, nested caches alike), so two calls with equal
keys differ only in their tensors; the stance's own tensor and shape guards, or turbo's
check of them (:mod:`guardtrain.compile.direct`), decide those.

Recognised classes (transformers is never imported here: its classes are looked up in
``sys.modules``): subclasses of ``transformers.cache_utils.Cache`` (``DynamicCache``,
``StaticCache``, ``EncoderDecoderCache``, ...) and of its ``CacheLayerMixin`` (the
layer-wise caches of transformers 5), and of ``ModelOutput`` (an encoder's output, handed
to every decoder call; a ``dict`` too, whose items the key describes beside its
attributes). Any other object still makes a call keyless: it runs with full guards.

Blind spots: an attribute written with ``object.__setattr__`` into a slot (caches have
none), and a function's ``__code__`` replaced in place on a cache class (a class
attribute assigned anew is seen: it moves the class dictionary's version).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from guardtrain._torch import guards
from guardtrain.compile.watch import class_dict

__all__ = ["BASES", "carries_cache", "class_dicts", "in_key", "versions"]

BASES: tuple[tuple[str, str], ...] = (
    ("transformers.cache_utils", "Cache"),
    ("transformers.cache_utils", "CacheLayerMixin"),
    ("transformers.utils.generic", "ModelOutput"),
)
"""``(module, class)``: the base classes whose subclasses a key describes: the caches, and
the model outputs that ``generate()`` hands to each decoder call of an encoder-decoder
model (``encoder_outputs``; a ``dict`` whose items are its fields)."""
_IMMUTABLE = 1 << 8
"""``Py_TPFLAGS_IMMUTABLETYPE``: a class nothing can write to (``dict``, ``OrderedDict``)."""

_dict_version: Callable[[dict[Any, Any]], int] = guards.dict_version
_CLASSES: dict[type, tuple[dict[Any, Any], ...] | None] = {}
"""Each class seen: the real dictionaries of its classes (what a class attribute read
through the object resolves through; not those of classes nothing can write to), or
None: not one a key describes."""
_CACHES: set[type] = set()
"""The classes seen that are caches or cache layers (a call that carries one is a
``generate()`` call)."""


def class_dicts(cls: type) -> tuple[dict[Any, Any], ...] | None:
    """The class dictionaries whose versions a key of a ``cls`` object holds, or None when
    ``cls`` is not a cache class (one dictionary lookup once seen)."""
    try:
        return _CLASSES[cls]
    except KeyError:
        return _learn(cls)


def versions(dicts: tuple[dict[Any, Any], ...]) -> int:
    """The sum of the dictionaries' versions: it grows with every write to any of them."""
    return sum(map(_dict_version, dicts))


def _bases(of: tuple[tuple[str, str], ...] = BASES) -> tuple[type, ...]:
    """The recognised base classes that are imported now."""
    found = []
    for module, name in of:
        base = getattr(sys.modules.get(module), name, None)
        if isinstance(base, type):
            found.append(base)
    return tuple(found)


def _learn(cls: type) -> tuple[dict[Any, Any], ...] | None:
    dicts: tuple[dict[Any, Any], ...] | None = None
    bases = _bases()
    caches = _bases(BASES[:2])
    if caches and issubclass(cls, caches):
        _CACHES.add(cls)
    if bases and issubclass(cls, bases):
        found = [class_dict(c) for c in cls.__mro__ if not c.__flags__ & _IMMUTABLE]
        if all(d is not None for d in found):  # else no version tells a class write
            dicts = tuple(d for d in found if d is not None)
    if bases or cls.__module__.partition(".")[0] != "transformers":
        # Before transformers is imported no object is one of its caches; a class of
        # transformers' seen before its cache module is imported is asked again.
        _CLASSES[cls] = dicts
    return dicts


def in_key(key: tuple[Any, ...]) -> bool:
    """Whether an argument key describes a cache (a decode or prefill call)."""
    return any(type(e) is tuple and len(e) == 3 and e[0] in _CACHES for e in key)


def carries_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call's arguments hold a cache at the top level (``cache=``,
    ``past_key_values=``, or positionally): the calls that ``generate()`` makes. For the
    counts of a call that runs with full guards anyway, so not on a fast path."""
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind is not torch.Tensor and class_dicts(kind) is not None and kind in _CACHES:
            return True
    return False
