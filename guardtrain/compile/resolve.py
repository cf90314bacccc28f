"""Target resolution: names and patterns to modules, each target's ``forward``, nested regions.

``targets=None`` picks a default (:func:`resolve_targets`); a user's own
``torch.compile`` wrapper is looked through (its module is the target, H29).
"""

from __future__ import annotations

import fnmatch
import types
from typing import Sequence

from torch import nn

from guardtrain._torch import COMPILED_CALL, DYNAMO_ORIGINAL, OPTIMIZED_ORIGINAL
from guardtrain._torch import OptimizedModule as _OptimizedModule
from guardtrain.errors import GuardTrainRuntimeError, GuardTrainTypeError, GuardTrainValueError

__all__ = ["OptimizedModule", "forward_function", "nested_compile_region", "resolve_targets"]

OptimizedModule = _OptimizedModule
_MISSING = object()


def forward_function(
    name: str, module: nn.Module, owner: str = "guardtrain", known_as: str | None = None
) -> types.FunctionType:
    """The plain function behind ``module.forward``, with clear errors that name the
    adapter (``owner``) and the module as the user knows it (``known_as``; default:
    its name in the root)."""
    label = known_as or (f"`{name}`" if name else "the root module")
    if isinstance(module, OptimizedModule):
        raise GuardTrainValueError(
            f"Target {label} is already compiled (torch.compile returned an OptimizedModule). "
            f"Pass the plain module: {owner} compiles it."
        )
    attr = module.__dict__.get("forward", _MISSING)
    if attr is not _MISSING:
        if getattr(attr, "_guardtrain_target", None) is not None:
            raise GuardTrainRuntimeError(
                f"Target {label} is compiled by another guardtrain run already; {owner} "
                "cannot compile it too. Let that run finish (or call its restore()) first."
            )
        if hasattr(attr, DYNAMO_ORIGINAL) or hasattr(attr, COMPILED_CALL):
            raise GuardTrainValueError(
                f"Target {label} has a compiled `forward` already. Remove your torch.compile "
                f"call: {owner} compiles it."
            )
        func = getattr(attr, "__func__", None)
        if getattr(attr, "__self__", None) is module and isinstance(func, types.FunctionType):
            return func
        raise GuardTrainTypeError(
            f"Target {label} has an instance attribute `forward` of type "
            f"{type(attr).__name__}; guardtrain compiles plain methods only."
        )
    if getattr(module, COMPILED_CALL, None) is not None:
        raise GuardTrainValueError(
            f"Target {label} was compiled with nn.Module.compile() already. Remove that call: "
            f"{owner} compiles it."
        )
    func = type(module).forward
    if not isinstance(func, types.FunctionType) or func is nn.Module.forward:
        raise GuardTrainValueError(
            f"Target {label} ({type(module).__name__}) defines no `forward` to compile."
        )
    return func


def resolve_targets(root: nn.Module, targets: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """Resolve target names and glob patterns to ``(name, module)`` pairs.

    ``None`` picks the default: the one direct child that owns parameters when
    there is exactly one (the network the LightningModule delegates to; its
    ``__dict__`` is not written by Lightning on every hook, so recursive dict
    tags keep working, H15), else the LightningModule itself. A pattern
    (``"blocks.*"``) keeps its outermost matches only. ``""`` names the root.
    """
    if targets is None:
        return [_default_target(root)]
    modules = dict(root.named_modules())
    aliases = dict(root.named_modules(remove_duplicate=False))  # a module under two names
    chosen: dict[str, nn.Module] = {}
    for pattern in targets:
        for n in _matching(pattern, root, modules, aliases):
            n, m = _look_through(n, aliases[n])
            chosen.setdefault(n, m)
    # Outermost matches only: drop a name whose ancestor is also chosen.
    outer = {
        n: m
        for n, m in chosen.items()
        if not any(n != o and (o == "" or n.startswith(o + ".")) for o in chosen)
    }
    _refuse_duplicates(outer)
    return list(outer.items())


def _default_target(root: nn.Module) -> tuple[str, nn.Module]:
    """The one direct child that owns parameters and has a ``forward``, else the root."""
    children = [
        _look_through(n, m)
        for n, m in root.named_children()
        if next(m.parameters(), None) is not None
    ]
    if len(children) == 1 and type(children[0][1]).forward is not nn.Module.forward:
        return children[0]
    return ("", root)


def _matching(
    pattern: str, root: nn.Module, modules: dict[str, nn.Module], aliases: dict[str, nn.Module]
) -> list[str]:
    """The names one ``targets`` entry matches; raises when it matches none."""
    if any(ch in pattern for ch in "*?["):  # globs see each module once, by its first name
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
    else:
        names = [pattern] if pattern in aliases else []
    if not names:
        sample = [n for n in modules if n and n.count(".") < 2][:12]
        raise GuardTrainValueError(
            f"`targets` entry {pattern!r} matches no submodule of "
            f"{type(root).__name__}; some names: {sample}."
        )
    return names


def _refuse_duplicates(outer: dict[str, nn.Module]) -> None:
    """Raise when two chosen names are one module."""
    seen: dict[int, str] = {}
    for n, m in outer.items():
        if id(m) in seen:
            raise GuardTrainValueError(
                f"`targets` names the same module twice: {seen[id(m)]!r} and {n!r}."
            )
        seen[id(m)] = n


def _look_through(name: str, module: nn.Module) -> tuple[str, nn.Module]:
    """``torch.compile(module)`` returns a wrapper: the target is the module inside it."""
    while isinstance(module, OptimizedModule):
        inner = f"{name}.{OPTIMIZED_ORIGINAL}" if name else OPTIMIZED_ORIGINAL
        name, module = inner, getattr(module, OPTIMIZED_ORIGINAL)
    return name, module


def nested_compile_region(module: nn.Module) -> str | None:
    """Name a nested compile region in ``module`` (H23), or None.

    Looks at each submodule's ``forward`` and at the globals its code names.
    """
    for name, sub in module.named_modules():
        forward = type(sub).forward
        if hasattr(forward, "__marked_compile_region_fn__"):
            return f"{type(sub).__name__}.forward" + (f" of {name!r}" if name else "")
        code = getattr(forward, "__code__", None)
        scope = getattr(forward, "__globals__", {})
        for global_name in code.co_names if code is not None else ():
            if hasattr(scope.get(global_name), "__marked_compile_region_fn__"):
                return f"{global_name} in {type(sub).__name__}.forward"
    return None
