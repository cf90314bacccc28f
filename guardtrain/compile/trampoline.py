"""Trampolines: the template code objects Dynamo compiles, their one globals dict, frame tests.

A target's compiled ``forward`` is a *trampoline*: a fresh copy of a template code
object (``code.replace()``) that calls the module's ``forward`` from a closure cell.
Dynamo compiles the trampoline's frame and inlines the module's ``forward``. The
templates are defined in this file, so their frames name it
(:mod:`guardtrain.engine.breaks` recognises them by :data:`TRAMPOLINE_NAME`,
:data:`SHARED_TRAMPOLINE_NAME` and this module's ``__file__``).

:data:`TRAMPOLINE_GLOBALS` is the one globals dict every trampoline function and
every directly dispatched entry runs with (:mod:`guardtrain.compile.direct`): Dynamo
installs the names its compiled code reads (``__compiled_fn_*``, ``__resume_at_*``,
``__import_*``) into the globals of the frame it compiled, a guard's ``G[...]``
names them, and a harvested entry's code finds them there only if it runs with the
same dict. It is this module's namespace.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from guardtrain._torch import cache_entry_list, compiling_frame

__all__ = [
    "CLOSURE_NAME",
    "SHARED_NAME",
    "SHARED_TRAMPOLINE_NAME",
    "TRAMPOLINE_GLOBALS",
    "TRAMPOLINE_NAME",
    "cache_entry_list",
    "compiling_frame",
    "new_trampoline",
    "trampoline_function",
]

TRAMPOLINE_GLOBALS: dict[str, Any] = globals()
"""The globals of every trampoline and every directly dispatched entry (``G`` in a
guard's source): where Dynamo installs the ``__import_*`` names its global guards
read. One dict: see the module docstring."""

CLOSURE_NAME = "bound"
"""The closure variable of a private trampoline: the module's bound ``forward``."""
SHARED_NAME = "module"
"""The first argument of a shared trampoline: the module a call is for."""
TRAMPOLINE_NAME = "guardtrain_forward"
SHARED_TRAMPOLINE_NAME = "guardtrain_shared_forward"


def _make_template() -> types.CodeType:
    bound: Callable[..., Any] = print

    def guardtrain_forward(*args: Any, **kwargs: Any) -> Any:
        return bound(*args, **kwargs)

    return guardtrain_forward.__code__


def _make_shared_template() -> types.CodeType:
    forward: Callable[..., Any] = print

    def guardtrain_shared_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(module, *args, **kwargs)

    return guardtrain_shared_forward.__code__


_TEMPLATE = _make_template()
_SHARED_TEMPLATE = _make_shared_template()


def new_trampoline(shared: bool) -> types.CodeType:
    """A new code object that calls its closure variable (``bound``, or ``forward`` with
    the module as first argument when ``shared``).

    Its file is guardtrain's, so Dynamo does not wrap it in its shared ``inner`` frame
    (which it does for functions in torch's own files, e.g. ``nn.Sequential``), and
    each copy has a cache of its own.
    """
    return (_SHARED_TEMPLATE if shared else _TEMPLATE).replace()


def trampoline_function(
    code: types.CodeType, closure: tuple[types.CellType, ...], shared: bool
) -> types.FunctionType:
    """The trampoline ``code`` as a function, with :data:`TRAMPOLINE_GLOBALS`."""
    name = SHARED_TRAMPOLINE_NAME if shared else TRAMPOLINE_NAME
    return types.FunctionType(code, TRAMPOLINE_GLOBALS, name, None, closure)
