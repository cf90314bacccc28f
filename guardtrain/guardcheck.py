"""Evaluating a Dynamo guard manager outside Dynamo's entry path (H26, H30, H36).

Through torch 2.14, ``GuardManager.check`` disables torch functions while it
runs and leaves them disabled if it raises (a scope that is not a dict, a guard
whose Python code raises): every later ``__torch_function__`` override and
torch-function mode would then be skipped silently. :func:`check` puts the
state back before the error propagates.
"""

from __future__ import annotations

from typing import Any

from guardtrain._torch import set_torch_function_state as _set_state
from guardtrain._torch import torch_function_state as _get_state

__all__ = ["check"]


def check(manager: Any, scope: Any) -> bool:
    """``manager.check(scope)``; on an error, the torch-function state is restored first."""
    state = _get_state()
    try:
        return bool(manager.check(scope))
    except BaseException:
        _set_state(state)
        raise
