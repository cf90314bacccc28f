"""A guard-manager check that raises leaves torch functions as they were (H36).

Through torch 2.14 ``GuardManager.check`` disables torch functions while it runs
and, when it raises, leaves them disabled; ``guardtrain.guardcheck.check`` (used
by turbo's dispatch and the H26 entry check) restores the state first.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from guardtrain import guardcheck

_State = torch._C._TorchFunctionState


def _add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + y


def _manager() -> Any:
    """The guard manager of a freshly compiled function's one cache entry."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    torch.compile(_add, backend="eager")(torch.ones(3), torch.ones(3))
    (entry,) = _debug_get_cache_entry_list(_add.__code__)
    return entry.guard_manager


def _scope(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    return {"x": x, "y": y, "G": globals()}


class Tagged(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` counts its calls."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_check_answers_like_the_manager() -> None:
    manager = _manager()
    assert guardcheck.check(manager, _scope(torch.ones(3), torch.ones(3))) is True
    assert guardcheck.check(manager, _scope(torch.ones(4), torch.ones(3))) is False
    assert torch._C._get_torch_function_state() == _State.ENABLED


@pytest.mark.parametrize("scope", [None, 42, ["x"]], ids=["none", "int", "list"])
def test_a_raising_check_restores_torch_functions(scope: Any) -> None:
    manager = _manager()
    with pytest.raises(TypeError):
        guardcheck.check(manager, scope)
    assert torch._C._get_torch_function_state() == _State.ENABLED
    before = Tagged.calls
    torch.ones(2).as_subclass(Tagged) + 1
    assert Tagged.calls > before, "__torch_function__ was skipped after the failed check"


class Raising:
    """A manager whose check disables torch functions and raises, as torch 2.14's can."""

    def check(self, scope: Any) -> bool:
        torch._C._set_torch_function_state(_State.ALL_DISABLED)
        raise RuntimeError("a guard raised")


def test_a_raising_check_keeps_a_state_the_caller_set() -> None:
    with torch._C.DisableTorchFunctionSubclass():
        state = torch._C._get_torch_function_state()
        assert state not in (_State.ENABLED, _State.ALL_DISABLED)
        with pytest.raises(RuntimeError, match="a guard raised"):
            guardcheck.check(Raising(), {})
        assert torch._C._get_torch_function_state() == state
    assert torch._C._get_torch_function_state() == _State.ENABLED


def test_the_raw_check_left_torch_functions_disabled_on_this_torch() -> None:
    """What guardcheck guards against: recorded for each torch the matrix runs."""
    manager = _manager()
    try:
        with pytest.raises(TypeError):
            manager.check(None)
        after = torch._C._get_torch_function_state()
    finally:
        torch._C._set_torch_function_state(_State.ENABLED)
    if after == _State.ENABLED:
        pytest.skip(f"torch {torch.__version__} restores the state itself")
    assert after == _State.ALL_DISABLED
