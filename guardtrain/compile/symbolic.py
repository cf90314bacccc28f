"""What a cache entry's guard tree says beyond the call's arguments, and which input sizes
it holds symbolic: read once per entry for direct dispatch (H30, H53).

A harvested entry (:class:`~guardtrain.compile.direct.DirectEntry`) serves calls whose key
equals the harvested call's and whose tensors pass ``TensorGuards``. Two things are read
from the entry's guards for that:

* :func:`symbolic_dims`: the dimensions of each input tensor whose size or stride the
  entry compiled symbolic (Dynamo's ``TENSOR_MATCH`` prints them as ``None``: a decode
  call's cache length). ``TensorGuards`` then leaves those dimensions to the entry's
  shape guards, so one entry serves every cache length it was compiled for.
* :func:`beyond_arguments`: the entry's *diff* guards (what the stance evaluates) without
  the subtrees of the call's arguments, which the key and ``TensorGuards`` check: the
  shape guards (a cache length inside the compiled range, sizes that must agree), global
  state, and the guards that tell the entries apart outside the arguments (a module
  attribute that failed once). One call into C.

Dynamo keeps both unchanged for an entry's life; :func:`symbolic_dims` memoises the
guard text it reads per entry.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Iterator

import torch

from guardtrain.compile.assertions import symbolic_sizes

__all__ = ["ARGUMENTS", "beyond_arguments", "has_shape_guards", "symbolic_dims"]

ARGUMENTS = ("L['args']", "L['kwargs']")
"""The guard sources of a trampoline frame's arguments (private and shared code alike)."""
Dims = tuple[tuple[int, ...], tuple[int, ...]]
"""``(symbolic size dims, symbolic stride dims)`` of one tensor."""
_READ: weakref.WeakKeyDictionary[types.CodeType, dict[str, Dims]] = weakref.WeakKeyDictionary()
"""Per entry (by its code object): each argument tensor's source and symbolic dims."""


def has_shape_guards(manager: Any) -> bool:
    """Whether an entry's guards hold symbolic sizes: shape guards, evaluated last by the
    root (False on a torch that keeps them elsewhere: its calls are then served only at the
    sizes harvested)."""
    epilogue = getattr(getattr(manager, "root", manager), "get_epilogue_lambda_guards", None)
    return epilogue is not None and bool(epilogue())


def beyond_arguments(manager: Any) -> Any:
    """The entry's diff guards without its arguments' subtrees (a new root manager), or
    None when this torch cannot make one."""
    diff = getattr(manager, "diff_guard_root", None)
    clone = getattr(diff, "clone_manager", None)
    if clone is None:
        return None
    return clone(lambda node: not node.get_source().startswith(ARGUMENTS))


def symbolic_dims(
    entry: Any, scope: dict[str, Any], tensors: list[torch.Tensor]
) -> list[Dims] | None:
    """For each of ``tensors`` (a call's inputs, ``scope`` its frame's locals), the dims the
    entry holds symbolic; ``((), ())`` for a tensor the guards hold static or do not name;
    None when none is symbolic."""
    read = _READ.get(entry.code)
    if read is None:
        read = _READ[entry.code] = dict(_tensor_guards(entry.guard_manager.root))
    if not any(size or stride for size, stride in read.values()):
        return None
    by_id: dict[int, Dims] = {}
    for source, dims in read.items():
        try:
            value = eval(source, {}, {"L": scope})
        except Exception:
            continue
        if isinstance(value, torch.Tensor):
            by_id[id(value)] = dims
    return [by_id.get(id(t), ((), ())) for t in tensors]


def _tensor_guards(root: Any) -> Iterator[tuple[str, Dims]]:
    """``(source, symbolic dims)`` of each tensor check under the arguments' subtrees."""
    for node in _nodes(root):
        source = node.get_source()
        if not source.startswith(ARGUMENTS):
            continue
        for leaf in node.get_leaf_guards():
            if type(leaf).__name__ != "TENSOR_MATCH":
                continue
            found = symbolic_sizes(leaf.verbose_code_parts()[0])
            if found is not None:
                yield source, found


def _nodes(root: Any) -> Iterator[Any]:
    """Every manager of a guard tree, dictionary managers' keys and values included, that
    lies on an argument's path (the root, the frame's locals, the arguments)."""
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        source = node.get_source()
        if source and source != "L" and not source.startswith(ARGUMENTS):
            continue
        yield node
        pairs = getattr(node, "get_key_value_managers", None)
        if pairs is not None:
            for key, value in pairs().values():
                stack.extend((key, value))
        stack.extend(node.get_child_managers())
