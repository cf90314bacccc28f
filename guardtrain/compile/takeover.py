"""Taking over the user's own compiles of a target: ``torch.compile``, ``Module.compile`` (H29)."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from guardtrain._torch import COMPILED_CALL, DYNAMO_ORIGINAL, OPTIMIZED_ORIGINAL
from guardtrain.compile.resolve import OptimizedModule

__all__ = ["TakeOver", "take_over_compiled"]

_MISSING = object()


class TakeOver:
    """Compiles of the user's own inside the targets, switched off while guardtrain runs.

    The lightning-hydra-template's ``compile=true`` does ``self.net =
    torch.compile(self.net)`` in the LightningModule's ``setup``, which Lightning
    runs after the callbacks' ``setup`` (H29). guardtrain compiles the original
    module once itself: each ``OptimizedModule`` wrapping a target (or inside one)
    calls its module plainly, ``nn.Module.compile()`` and a compiled ``forward``
    attribute are set aside. Module structure and ``state_dict`` keys
    (``net._orig_mod.*``) stay as the user's code made them. :meth:`restore` puts
    everything back.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        """What was taken over, e.g. ``"net (torch.compile)"``."""
        self._undo: list[tuple[dict[str, Any], str, Any]] = []

    def _set(self, module: nn.Module, key: str, value: Any) -> None:
        """Set (or, with ``_MISSING``, remove) an instance attribute, remembering the old one."""
        self._undo.append((module.__dict__, key, module.__dict__.get(key, _MISSING)))
        if value is _MISSING:
            module.__dict__.pop(key, None)
        else:
            module.__dict__[key] = value

    def take(self, name: str, module: nn.Module, root_label: str = "<model>") -> None:
        """Switch off every compile of the user's in ``module`` and below it (the root
        module is named ``root_label``)."""
        for sub_name, sub in module.named_modules(prefix=name):
            label = sub_name or root_label
            if isinstance(sub, OptimizedModule):
                self._set(sub, "forward", getattr(sub, OPTIMIZED_ORIGINAL).__call__)
                self.names.append(f"{label} (torch.compile)")
                continue
            if sub.__dict__.get(COMPILED_CALL) is not None:
                self._set(sub, COMPILED_CALL, None)
                self.names.append(f"{label} (nn.Module.compile)")
            original = _compiled_forward_source(sub)
            if original is None:
                continue
            if getattr(original, "__func__", None) is type(sub).forward:
                self._set(sub, "forward", _MISSING)  # the class's own forward
            else:
                self._set(sub, "forward", original)
            self.names.append(f"{label} (a compiled forward)")

    def restore(self) -> None:
        for owner, key, value in reversed(self._undo):
            if value is _MISSING:
                owner.pop(key, None)
            else:
                owner[key] = value
        self._undo = []


def _compiled_forward_source(module: nn.Module) -> Any:
    """For ``module.forward = torch.compile(module.forward)``: the bound method inside, or None."""
    original = getattr(module.__dict__.get("forward"), DYNAMO_ORIGINAL, None)
    for _ in range(8):  # torch.compile wraps a bound method in a function: unwrap it
        if original is None or getattr(original, "__self__", None) is module:
            return original
        original = getattr(original, "__wrapped__", None)
    return None


def take_over_compiled(
    root: nn.Module, targets: Sequence[tuple[str, nn.Module]], root_label: str = "<model>"
) -> TakeOver:
    """Switch off the user's own compiles of ``targets``, of modules inside them, and of the
    ``OptimizedModule`` wrappers around them (see :class:`TakeOver`; the root module is
    named ``root_label``)."""
    taken = TakeOver()
    modules = dict(root.named_modules(remove_duplicate=False))
    for name, module in targets:
        wrapper = name
        while wrapper.endswith(OPTIMIZED_ORIGINAL):  # the wrappers resolve_targets looked through
            wrapper = wrapper[: -len(OPTIMIZED_ORIGINAL)].rstrip(".")
            taken.take(wrapper, modules[wrapper] if wrapper else root, root_label)
        if wrapper == name:
            taken.take(name, module, root_label)
    return taken
