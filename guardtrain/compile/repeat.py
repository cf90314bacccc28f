"""A steady call that repeats the last one's plain arguments, recognised without a new key.

:func:`~guardtrain.compile.call_mode.call_key` builds a call's key afresh on every call:
a list, a tuple per plain value, then a tuple. Most steady calls repeat the previous
call's plain values exactly (``model(x, k, t, "mode")`` with the same ``k``, ``t`` and
mode), so once a key has been admitted under the stance and then repeated, the target's
key function becomes one made for that key (:func:`repeat_key`): it compares the call's
arguments with the key's values in one expression and returns the same key object, or
falls back to ``call_key``. It is made only for flat calls (exact tensors and plain values, no
containers, tensors all distinct), and only after a repeat, so an argument that takes a
new value on every call (a step counter) never pays for making one.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from guardtrain.compile.call_mode import ONE_TENSOR, PLAIN_TYPES, call_key

__all__ = ["REPEAT_LIMIT", "repeat_key", "same_as_call_key"]

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
    ``call_key`` returns; :data:`same_as_call_key` where the call is not flat."""
    if key is ONE_TENSOR:
        return same_as_call_key  # call_key's own fast path already
    values = [*args, *kwargs.values()]
    if len(values) > REPEAT_LIMIT or len(key) != len(values) + 1 + bool(kwargs):
        return same_as_call_key  # containers, an aliasing pattern, or too long
    namespace: dict[str, Any] = {"KEY": key, "T": torch.Tensor, "fallback": call_key}
    terms = [f"len(args) == {len(args)}"]
    if kwargs:
        namespace["NAMES"] = tuple(kwargs)
        terms.append("tuple(kwargs) == NAMES")
    else:
        terms.append("not kwargs")
    tensors = []
    for i, value in enumerate(values):
        source = f"args[{i}]" if i < len(args) else f"kwargs[{list(kwargs)[i - len(args)]!r}]"
        kind = type(value)
        if kind is torch.Tensor:
            terms.append(f"type({source}) is T")
            tensors.append(source)
        elif kind in PLAIN_TYPES:
            namespace[f"t{i}"], namespace[f"v{i}"] = kind, value
            terms.append(f"type(a{i} := {source}) is t{i} and a{i} == v{i}")
        else:
            return same_as_call_key
    if len(tensors) > 1:
        # Distinct tensors, as when the key was made (a repeated tensor adds a pattern).
        pairs = [(a, b) for n, a in enumerate(tensors) for b in tensors[n + 1 :]]
        terms.extend(f"{a} is not {b}" for a, b in pairs)
    source = (
        "def key_of(args, kwargs):\n"
        f"    if {' and '.join(terms)}:\n"
        f"        return KEY, [{', '.join(tensors)}]\n"
        "    return fallback(args, kwargs)\n"
    )
    exec(compile(source, "<guardtrain repeat key>", "exec"), namespace)
    return namespace["key_of"]  # type: ignore[no-any-return]
