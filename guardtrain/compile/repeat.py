"""A steady call that repeats the last one's plain arguments, recognised without a new key.

:func:`~guardtrain.compile.call_mode.call_key` builds a call's key afresh on every call:
a list, a tuple per plain value, then a tuple. Most steady calls repeat the previous
call's plain values exactly (``model(x, k, t, "mode")`` with the same ``k``, ``t`` and
mode), so once a key has been admitted under the stance and then repeated, the target's
key function (:func:`promoting` until then) becomes one made for that key (:func:`repeat_key`): it compares the call's
argument types and plain values with the key's, each as one tuple, and returns the same key
object, or falls back to ``call_key``. It is made only for flat calls (exact tensors and plain values, no
containers, tensors all distinct), and only after a repeat, so an argument that takes a
new value on every call (a step counter) never pays for making one.
"""

from __future__ import annotations

import types
from operator import itemgetter
from typing import Any, Callable

import torch

from guardtrain.compile.call_mode import ONE_TENSOR, PLAIN_TYPES, call_key

__all__ = ["REPEAT_LIMIT", "promoting", "repeat_key", "same_as_call_key"]

REPEAT_LIMIT = 6
"""At most this many arguments (positional and keyword) in a key that gets its own
function; longer calls keep ``call_key``."""
KeyFunction = Callable[[tuple[Any, ...], dict[str, Any]], Any]
same_as_call_key: KeyFunction = types.FunctionType(
    call_key.__code__, call_key.__globals__, "call_key", call_key.__defaults__
)
"""``call_key`` itself, as another object: the key function of a target whose repeated key
gets no function of its own (one tensor, containers), so it is not made again."""


def repeat_key(key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> KeyFunction:
    """A key function for calls like this one (whose key is ``key``): the same key and the
    call's tensors when its arguments are this call's types and plain values, else what
    ``call_key`` returns; :data:`same_as_call_key` where the call is not flat.

    The comparison is two tuple comparisons made by C functions (the argument types, and
    the plain values taken by one ``itemgetter``), with no Python step per argument;
    tensors must be distinct, as when the key was made (a repeated tensor adds a pattern to
    the key). A call without a tensor keeps ``call_key``.
    """
    if key is ONE_TENSOR:
        return same_as_call_key  # call_key's own fast path already
    values = (*args, *kwargs.values())
    if len(values) > REPEAT_LIMIT or len(key) != len(values) + 1 + bool(kwargs):
        return same_as_call_key  # containers, an aliasing pattern, or too long
    kinds = tuple(map(type, values))
    if any(kind is not torch.Tensor and kind not in PLAIN_TYPES for kind in kinds):
        return same_as_call_key
    tensor_at = [i for i, kind in enumerate(kinds) if kind is torch.Tensor]
    plain_at = [i for i, kind in enumerate(kinds) if kind is not torch.Tensor]
    if not tensor_at:
        return same_as_call_key
    return _key_function(key, kinds, tuple(kwargs) if kwargs else None, values, plain_at, tensor_at)


def _key_function(
    key: tuple[Any, ...],
    kinds: tuple[type, ...],
    names: tuple[str, ...] | None,
    values: tuple[Any, ...],
    plain_at: list[int],
    tensor_at: list[int],
) -> KeyFunction:
    """:func:`repeat_key`'s function for a flat call of argument types ``kinds`` (with
    keyword ``names``, or None for none), whose plain values sit at ``plain_at`` and
    tensors at ``tensor_at``."""
    # One index gives the item itself, several a tuple: the expected value has the same form.
    plains = itemgetter(*plain_at) if plain_at else itemgetter(slice(0, 0))
    expected = plains(values)
    count = len(tensor_at)
    # One tensor: a one-item slice of the arguments. Several: an itemgetter's tuple.
    tensors_of = (
        itemgetter(slice(tensor_at[0], tensor_at[0] + 1)) if count == 1 else itemgetter(*tensor_at)
    )

    # The types' tuple fixes the number of arguments (with the keyword names, how many
    # are positional), and is compared before the values are taken by position.
    if names is not None:

        def key_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            values = (*args, *kwargs.values())
            if (
                tuple(map(type, values)) == kinds
                and tuple(kwargs) == names
                and plains(values) == expected
            ):
                found = tensors_of(values)
                if count == 1 or len(set(map(id, found))) == count:
                    return key, found
            return call_key(args, kwargs)

    elif count == 1:  # one tensor: nothing to tell apart

        def key_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not kwargs and tuple(map(type, args)) == kinds and plains(args) == expected:
                return key, tensors_of(args)
            return call_key(args, kwargs)

    else:

        def key_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not kwargs and tuple(map(type, args)) == kinds and plains(args) == expected:
                found = tensors_of(args)
                if len(set(map(id, found))) == count:
                    return key, found
            return call_key(args, kwargs)

    return key_of


def promoting(target: Any) -> KeyFunction:
    """``target``'s key function until a key repeats: ``call_key``, and on a call whose key
    is the last admitted one, ``target.key_of`` becomes :func:`repeat_key`'s function for
    it. The steady path then never asks whether to make one: the function in place is
    either this one (until a repeat) or the one made."""

    def key_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        found = call_key(args, kwargs)
        if found is not None and found[0] == target.last_key:
            target.key_of = repeat_key(found[0], args, kwargs)
        return found

    return key_of
