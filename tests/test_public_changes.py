"""Every public way to change a model mid-run is seen before the next compiled call.

Each scenario trains a small model in a plain loop under ``GuardTuner``, changes it through
one public ``torch.nn`` API once the loop is steady (and some again later), and compares
every batch's loss and the final weights bitwise with an uncompiled run that makes the same
changes. ``aot_eager`` shows a stale entry that the eager backend would hide (H42, H43).
The list is docs/soundness.md's "Public ways to change a model". Writes that bypass the
public API (``__dict__``, ``_parameters``, ``_buffers``) stay out of reach until the next
audit or boundary: strict ``xfail``s in ``tests/test_midepoch.py``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import first_then_slow, guard_tuner
from torch import nn
from torch.nn.utils import parametrize, prune

PRESETS = first_then_slow("auto", "safe", "aggressive", "turbo")
BATCHES = 14
CHANGE_AT = (6, 10)
"""The batches before which a scenario changes the model: the loop is steady by the first
(a warm-up of 3 batches, then 2 stable ones)."""
AOT = {"backend": "aot_eager"}


class Scaled(nn.Module):
    """Linear -> ReLU -> times a buffer -> Linear, in the dtype of its first weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.lin.weight.dtype)
        return self.out(torch.relu(self.lin(x)) * self.scale)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(BATCHES)
    ]


def _new(shape: tuple[int, ...], seed: int, like: torch.Tensor | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(shape, generator=g) + 0.5
    return t.to(like.dtype) if like is not None else t


# -- the changes: each takes the model and the batch before which it is made ----------------


def buffer_registered_again(m: Scaled, i: int) -> None:
    m.register_buffer("scale", _new((16,), i, m.scale))


def buffer_registered_with_a_broadcast_shape(m: Scaled, i: int) -> None:
    m.register_buffer("scale", _new((1,), i, m.scale) if i == CHANGE_AT[0] else _new((16,), i))


def parameter_registered_again(m: Scaled, i: int) -> None:
    m.lin.register_parameter("weight", nn.Parameter(_new((16, 8), i, m.lin.weight) - 1.0))


def module_registered_again(m: Scaled, i: int) -> None:
    torch.manual_seed(i)
    if i == CHANGE_AT[0]:
        m.register_module("out", nn.Linear(16, 1))
    else:
        m.add_module("out", nn.Linear(16, 1))


def state_loaded(m: Scaled, i: int) -> None:
    state = {k: _new(tuple(v.shape), i + n, v) for n, (k, v) in enumerate(m.state_dict().items())}
    m.load_state_dict(state)


def state_loaded_with_assign(m: Scaled, i: int) -> None:
    state = {k: _new(tuple(v.shape), i + n, v) for n, (k, v) in enumerate(m.state_dict().items())}
    m.load_state_dict(state, assign=True)


class _Negated(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return -w


def parametrized(m: Scaled, i: int) -> None:
    if i == CHANGE_AT[0]:
        parametrize.register_parametrization(m.lin, "weight", _Negated())
    else:
        parametrize.remove_parametrizations(m.lin, "weight")


def pruned(m: Scaled, i: int) -> None:
    prune.l1_unstructured(m.lin, "weight", amount=0.3)  # the second prunes again
    prune.l1_unstructured(m.out, "weight", amount=0.5)


def pruned_then_made_permanent(m: Scaled, i: int) -> None:
    if i == CHANGE_AT[0]:
        torch.manual_seed(i)
        prune.random_unstructured(m.lin, "weight", amount=0.4)
    else:
        prune.remove(m.lin, "weight")


def tensors_swapped(m: Scaled, i: int) -> None:
    torch.utils.swap_tensors(m.lin.weight, nn.Parameter(_new((16, 8), i) - 1.0))
    torch.utils.swap_tensors(m.scale, _new((16,), i + 1))


def converted_to_double(m: Scaled, i: int) -> None:
    m.double() if i == CHANGE_AT[0] else m.float()


def converted_to_half(m: Scaled, i: int) -> None:
    m.half() if i == CHANGE_AT[0] else m.to(torch.float32)


def converted_with_to(m: Scaled, i: int) -> None:
    m.to(torch.float64) if i == CHANGE_AT[0] else m.to(dtype=torch.float32)


def requires_grad_changed(m: Scaled, i: int) -> None:
    m.lin.requires_grad_(i != CHANGE_AT[0])


def _double(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    return out * 2.0


def module_hook_added_and_removed(m: Scaled, i: int) -> None:
    if i == CHANGE_AT[0]:
        m._test_handle = m.lin.register_forward_hook(_double)  # type: ignore[assignment]
    else:
        m._test_handle.remove()  # type: ignore[operator]


def _global_double(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    return out * 2.0 if isinstance(module, nn.Linear) and module.out_features == 1 else out


_global_handles: list[Any] = []


def global_hook_added_and_removed(m: Scaled, i: int) -> None:
    if i == CHANGE_AT[0]:
        _global_handles.append(nn.modules.module.register_module_forward_hook(_global_double))
    else:
        _global_handles.pop().remove()


CHANGES: dict[str, Callable[[Scaled, int], None]] = {
    f.__name__: f
    for f in (
        buffer_registered_again,
        buffer_registered_with_a_broadcast_shape,
        parameter_registered_again,
        module_registered_again,
        state_loaded,
        state_loaded_with_assign,
        parametrized,
        pruned,
        pruned_then_made_permanent,
        tensors_swapped,
        converted_to_double,
        converted_to_half,
        converted_with_to,
        requires_grad_changed,
        module_hook_added_and_removed,
        global_hook_added_and_removed,
    )
}


@pytest.fixture(params=[False, True], ids=["assign", "swap"])
def swap_on_conversion(request: pytest.FixtureRequest) -> Any:
    """``torch.__future__.set_swap_module_params_on_conversion``: off (parameters converted
    through ``.data`` and dict writes) and on (``torch.utils.swap_tensors``)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param)
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(before)


def _train(
    model: Scaled, change: Callable[[Scaled, int], None], step: Callable[[Any], Any]
) -> list[torch.Tensor]:
    """Train ``model`` over the fixed batches, making ``change`` before the batches of
    :data:`CHANGE_AT`; ``step(batch)`` is the context each batch runs in. The losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i, (x, y) in enumerate(_data()):
        if i in CHANGE_AT:
            change(model, i)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        with step((x, y)):
            loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _compare(name: str, preset: str) -> dict[str, Any]:
    change = CHANGES[name]
    torch.manual_seed(0)
    eager = Scaled()
    guarded = copy.deepcopy(eager)
    expected = _train(eager, change, lambda batch: contextlib.nullcontext())
    with guard_tuner(guarded, preset, compile_kwargs=AOT) as tuner:
        got = _train(guarded, change, tuner.step)
        summary = tuner.summary()
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"{name} under {preset}, batch {i}: eager {a} vs {b}"
    state_e, state_g = eager.state_dict(), guarded.state_dict()
    assert list(state_e) == list(state_g)
    for key in state_e:
        assert torch.equal(state_e[key], state_g[key]), f"{name} under {preset}: {key} differs"
    return summary


_NOTHING_TO_CATCH = ("state_loaded", "requires_grad_changed", "tensors_swapped")
"""Changes that leave every entry right: values copied in place, a flip that selects code
kept for the pattern, tensors of the same dtype, device and shape swapped in place."""


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", [n for n in CHANGES if not n.startswith("converted")])
def test_a_public_change_is_seen_before_the_next_call(name: str, preset: str) -> None:
    summary = _compare(name, preset)
    if preset != "safe" and name not in _NOTHING_TO_CATCH:
        # The loop was steady when the change came: it was caught, not waited out.
        assert summary["caught_changes"] or summary["rearms"], summary


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", [n for n in CHANGES if n.startswith("converted")])
def test_a_conversion_is_seen_before_the_next_call(
    name: str, preset: str, swap_on_conversion: bool
) -> None:
    _compare(name, preset)


def test_the_registration_hooks_keep_their_keys_across_runs() -> None:
    """Code that Dynamo traced through a registration guards on the hooks' keys: each run
    registers them under the keys of the first, and takes them away at its end."""
    from torch.nn.modules import module as module_module

    from guardtrain.compile import watch

    dicts = (
        module_module._global_buffer_registration_hooks,
        module_module._global_parameter_registration_hooks,
        module_module._global_module_registration_hooks,
    )
    keys = []
    for _ in range(2):
        model = Scaled()
        x = torch.randn(4, 8)
        with guard_tuner(model, "auto", compile_kwargs=AOT) as tuner:
            with tuner.step((x,)):
                model(x).sum().backward()
            keys.append([[k for k, v in d.items() if v is watch._registered] for d in dicts])
        assert all(watch._registered not in d.values() for d in dicts)
    assert keys[0] == keys[1] and all(len(k) == 1 for k in keys[0]), keys
