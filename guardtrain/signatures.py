"""Batch signatures: the shapes, dtypes and devices of a batch's tensors, as a hashable value.

:func:`batch_signature` makes one per batch; :class:`SameSignature` recognises a
batch like a known one in one C++ call; :func:`describe_signature` reads one
for a re-arm reason. The engine compares them at every batch start.
"""

from __future__ import annotations

import dataclasses
from collections import UserDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from guardtrain._torch import guards
from guardtrain.compile.caches import class_dicts

__all__ = ["SameSignature", "batch_signature", "describe_signature"]

_Tensor = torch.Tensor


def batch_signature(batch: Any) -> Any:
    """Shapes, dtypes and devices of the tensors in ``batch``, as a hashable value.

    A tuple, list or dict (subclasses such as namedtuples and ``OrderedDict``
    included) keeps its type and structure; an exact tuple, list or dict reads
    its tensors' metadata in place, and that of an array with a shape, dtype and
    device (NumPy's) among its members. Any other container (a ``Mapping`` that is not a
    ``dict``, such as HF's ``BatchEncoding``; a dataclass instance; any other
    collection that ``apply_to_collection`` walks) gives a :class:`_Container`:
    its type, its keys or field names, and per member either the tensor's
    metadata or the metadata of every tensor nested in that member, in the
    order ``apply_to_collection`` visits them. Values never count; a leaf that
    is not a tensor, and an object that is no collection, count by type only.

    Args:
        batch: the batch as the loop hands it to the step.

    Returns:
        A hashable value, equal for two batches whose tensors have the same
        shapes, dtypes and devices in the same containers.
    """
    cls = type(batch)
    # The common cases: a tuple, list or dict of tensors, or of tensors and plain values (a
    # model call's keyword arguments), a tensor's metadata read in place.
    if cls is tuple or cls is list:
        return (cls, _items(batch))
    if cls is dict:
        return (cls, _entries(batch))
    if isinstance(batch, torch.Tensor):
        return (batch.shape, batch.dtype, batch.device)
    if isinstance(batch, (tuple, list)):
        return (cls, tuple([batch_signature(b) for b in batch]))
    if isinstance(batch, dict):
        return (cls, tuple([(k, batch_signature(v)) for k, v in batch.items()]))
    return _container_signature(batch)


def _items(batch: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
    """The members' signatures of a tuple or list (exact types)."""
    return tuple(
        [
            (t.shape, t.dtype, t.device)
            if isinstance(t, _Tensor)
            else (type(t) if type(t) in _LEAVES else _member_of_exact(t))
            for t in batch
        ]
    )


def _entries(batch: dict[Any, Any]) -> tuple[Any, ...]:
    """The entries' signatures of a dict (exact type)."""
    return tuple(
        [
            (
                k,
                (v.shape, v.dtype, v.device)
                if isinstance(v, _Tensor)
                else (type(v) if type(v) in _LEAVES else _member_of_exact(v)),
            )
            for k, v in batch.items()
        ]
    )


def _member_of_exact(value: Any) -> Any:
    """The signature of a member of an exact tuple, list or dict that is neither a tensor
    nor a plain value: an array (a type with NumPy's ``__array_interface__`` or a
    ``__dlpack__``) by its shape, dtype and device, anything else by
    :func:`batch_signature` (a container recursed into, a transformers cache by its type)."""
    cls = type(value)
    if hasattr(cls, "__array_interface__") or hasattr(cls, "__dlpack__"):
        try:
            shape = value.shape
            if type(shape) is tuple:
                return (shape, value.dtype, value.device)
        except Exception:  # an array type without a device (NumPy before 2.0): recursed
            pass
    return batch_signature(value)


_TensorGuards: Any = getattr(guards, "TensorGuards", None)
"""Dynamo's C++ tensor check; absent (or another constructor) in another torch: no fast path."""


class SameSignature:
    """Recognises, in one C++ call, a batch whose signature equals a known batch's.

    Made from a batch that is a tensor, or a tuple, list or dict (exact types)
    of plain strided tensors, and that batch's :func:`batch_signature`
    (:attr:`signature`). :meth:`matches` is True only for a batch of the same
    container type, length (dict: the same keys in the same order) and tensors
    that Dynamo's ``TensorGuards`` accept: the same dtype, device, sizes,
    strides, ``requires_grad`` and dispatch keys. That is stricter than the
    signature (strides, ``requires_grad``), so a match always has an equal
    signature; a batch that does not match may still have one, and is then
    compared by its full signature. A match is cheaper than computing
    :func:`batch_signature`; making one costs more, once per signature.
    """

    __slots__ = ("_check", "_keys", "_n", "_type", "misses", "signature")

    MAX_MISSES = 8
    """Batches with an equal signature that did not match (other strides, say) in a row,
    before the matcher is kept as it is instead of being made again for each."""

    def __init__(
        self, kind: type, n: int, keys: tuple[Any, ...] | None, check: Any, signature: Any
    ) -> None:
        self._type = kind
        self._n = n
        self._keys = keys
        self._check = check
        self.signature = signature
        self.misses = 0

    @classmethod
    def of(
        cls, batch: Any, signature: Any, previous: SameSignature | None = None
    ) -> SameSignature | None:
        """The matcher for batches like ``batch`` (whose signature is ``signature``), or None
        for a batch of another shape (nested, non-tensor members, a tensor subclass).

        ``previous``: the matcher that did not match ``batch``. When it was made
        for this very ``signature`` object, the batch differs only in what the
        signature does not hold; after :attr:`MAX_MISSES` such batches in a row
        ``previous`` is returned as it is.
        """
        misses = 0
        if previous is not None and previous.signature is signature:
            if previous.misses >= cls.MAX_MISSES:
                return previous
            misses = previous.misses + 1
        if _TensorGuards is None:
            return None
        found = _plain_tensors(batch)
        if found is None:
            return None
        kind, keys, tensors = found
        try:
            check = _TensorGuards(
                *tensors,
                dynamic_dims_sizes=[list(t.shape) for t in tensors],
                dynamic_dims_strides=[list(t.stride()) for t in tensors],
            ).check
        except Exception:  # another torch's constructor: no fast path
            return None
        made = cls(kind, len(tensors), keys, check, signature)
        made.misses = misses
        return made

    def matches(self, batch: Any) -> bool:
        """Whether ``batch`` certainly has :attr:`signature` (False: compare it in full)."""
        kind = type(batch)
        if kind is not self._type:
            return False
        if self._keys is not None:
            return tuple(batch) == self._keys and self._check(*batch.values())  # type: ignore[no-any-return]
        if kind is torch.Tensor:
            return self._check(batch)  # type: ignore[no-any-return]
        return len(batch) == self._n and self._check(*batch)  # type: ignore[no-any-return]


def _plain_tensors(batch: Any) -> tuple[type, tuple[Any, ...] | None, tuple[Any, ...]] | None:
    """``(type, dict keys or None, tensors)`` of a tensor, or a tuple, list or dict (exact
    types) of plain strided tensors; None for any other batch."""
    kind = type(batch)
    keys = None
    if kind is torch.Tensor:
        tensors: tuple[Any, ...] = (batch,)
    elif kind is tuple or kind is list:
        tensors = tuple(batch)
    elif kind is dict:
        keys = tuple(batch)
        tensors = tuple(batch.values())
    else:
        return None
    if not tensors or not all(
        type(t) is torch.Tensor and t.layout is torch.strided for t in tensors
    ):
        return None
    return kind, keys, tensors


class _Tensors(tuple):
    """The metadata of every tensor nested in one member of a :class:`_Container`."""

    __slots__ = ()


class _Container(NamedTuple):
    """The signature of a container that is not a tuple, list or dict.

    ``names`` are a mapping's keys or a dataclass's field names (None for any
    other collection); ``members`` has one entry per name: a tensor's
    metadata, a :class:`_Tensors`, or the type of a member that holds no
    tensor. Any other collection has a single :class:`_Tensors` member.
    """

    type: type
    names: tuple[Any, ...] | None
    members: tuple[Any, ...]


_USER_DICT, _MAPPING, _OTHER = "user dict", "mapping", "other"
_KINDS: dict[type, Any] = {}
"""Per batch type: a dataclass's field names, or one of the kinds above."""


def _kind(cls: type) -> Any:
    kind = _KINDS.get(cls)
    if kind is None:
        if dataclasses.is_dataclass(cls):
            kind = tuple(f.name for f in dataclasses.fields(cls))
        elif issubclass(cls, UserDict):
            kind = _USER_DICT
        elif issubclass(cls, Mapping):
            kind = _MAPPING
        else:
            kind = _OTHER
        _KINDS[cls] = kind
    return kind


_LEAVES = frozenset((bool, int, float, str, type(None), torch.dtype, torch.device))
"""Values a signature counts by their type (they hold no tensor)."""


def _collect(tensor: torch.Tensor, into: list[Any]) -> None:
    into.append((tensor.shape, tensor.dtype, tensor.device))


def _nested_tensors(value: Any) -> _Tensors | None:
    """The metadata of the tensors in ``value`` as ``apply_to_collection`` visits them.

    Returns None when the walk fails: ``apply_to_collection`` rebuilds what it
    walks, and refuses a frozen dataclass or a collection whose constructor
    does not take its items.
    """
    found: list[Any] = []
    try:
        apply_to_collection(value, torch.Tensor, _collect, found)
    except Exception:
        return None
    return _Tensors(found)


def _member(value: Any) -> Any:
    """The signature of a member that is not a tensor.

    The metadata of the tensors nested in it, or its type when it holds none;
    where ``apply_to_collection`` cannot walk it, its :func:`batch_signature`.
    """
    found = _nested_tensors(value)
    if found is None:
        return batch_signature(value)
    return found if found else type(value)


def _container_signature(batch: Any) -> Any:
    """The signature of a batch that is not a tensor, tuple, list or dict.

    A dataclass instance is read field by field (``init=False`` fields
    included) and a ``Mapping`` item by item; a member that is not a tensor is
    walked by ``apply_to_collection``, which is never asked to rebuild the
    batch itself (no copy of a dataclass, frozen ones included, and no call of
    a mapping's constructor). Any other collection is walked whole; an object
    that is no collection, or a collection that ``apply_to_collection`` cannot
    rebuild, counts by its type.
    """
    cls = type(batch)
    if cls in _LEAVES or class_dicts(cls) is not None:
        # What apply_to_collection finds no tensor in, said without the walk: a plain
        # value, or a transformers cache (its tensors grow every decode call; the call's
        # own checks read them, H53).
        return cls
    kind = _kind(cls)
    if kind is _USER_DICT or kind is _MAPPING:
        items = batch.data.items() if kind is _USER_DICT else batch.items()
        names = []
        members = []
        for key, value in items:
            names.append(key)
            members.append(
                (value.shape, value.dtype, value.device)
                if isinstance(value, torch.Tensor)
                else _member(value)
            )
        return _Container(cls, tuple(names), tuple(members))
    if kind is _OTHER:
        found = _nested_tensors(batch)
        return _Container(cls, None, (found,)) if found else cls
    members = []
    for name in kind:
        value = getattr(batch, name, None)  # an init=False field may be unset
        members.append(
            (value.shape, value.dtype, value.device)
            if isinstance(value, torch.Tensor)
            else _member(value)
        )
    return _Container(cls, kind, tuple(members))


def _describe_tensor(signature: Any) -> str | None:
    if (
        isinstance(signature, tuple)
        and len(signature) == 3
        and isinstance(signature[0], torch.Size)
    ):
        shape, dtype, device = signature
        return f"{tuple(shape)} {str(dtype).replace('torch.', '')} {device}"
    return None


def describe_signature(signature: Any) -> str:
    """A short readable form of a :func:`batch_signature`.

    Tensors read as ``(16, 8) float32 cpu``; a tuple or list as ``(...)``; a
    dict as ``{'key': ...}``; a mapping of another type as
    ``BatchEncoding{'input_ids': ...}``; a dataclass or namedtuple as
    ``Batch(x=...)``; the tensors nested in one member as ``[...]``; anything
    else by its type's name.
    """
    tensor = _describe_tensor(signature)
    if tensor is not None:
        return tensor
    if isinstance(signature, _Tensors):
        return "[" + ", ".join(describe_signature(s) for s in signature) + "]"
    if isinstance(signature, _Container):
        return _describe_container(signature)
    if isinstance(signature, tuple) and len(signature) == 2 and isinstance(signature[0], type):
        return _describe_sequence_or_dict(*signature)
    if isinstance(signature, type):
        return signature.__name__
    return repr(signature)


def _describe_container(signature: _Container) -> str:
    """``Name{'key': ...}`` for a mapping, ``Name(field=...)`` for another container."""
    name = signature.type.__name__
    if signature.names is None:
        return name + "".join(describe_signature(m) for m in signature.members)
    pairs = zip(signature.names, (describe_signature(m) for m in signature.members))
    if issubclass(signature.type, Mapping):
        return name + "{" + ", ".join(f"{k!r}: {p}" for k, p in pairs) + "}"
    return name + "(" + ", ".join(f"{k}={p}" for k, p in pairs) + ")"


def _describe_sequence_or_dict(cls: type, inner: tuple[Any, ...]) -> str:
    """``{...}`` / ``(...)`` for a dict / tuple or list, prefixed by a subclass's name."""
    if issubclass(cls, dict):
        body = "{" + ", ".join(f"{k!r}: {describe_signature(v)}" for k, v in inner) + "}"
        return body if cls is dict else cls.__name__ + body
    body = "(" + ", ".join(describe_signature(s) for s in inner) + ")"
    return body if cls is tuple or cls is list else cls.__name__ + body
