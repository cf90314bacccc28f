""":mod:`guardtrain.compile.call_mode` on its own: modes, argument keys and the checks of
the state outside a call's arguments, each answer pinned down without a compile.

How a key's function for a repeated key agrees with :func:`call_key` is in
``test_per_call_parts.py``; what the per-call path does with these answers is tested end
to end in ``test_midepoch.py``, ``test_turbo.py`` and ``test_global_guards.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from guardtrain.compile import call_mode
from guardtrain.compile.call_mode import (
    ONE_TENSOR,
    PLAIN_TYPES,
    call_key,
    callback_handler,
    describe_call_mode,
    dispatch_mode_active,
    inlined_hooks_active,
    key_sources,
    masked,
    mode_of,
    outside_state_clear,
    structure,
    top_saved_hooks,
    unambiguous_modes,
)

X = torch.randn(2, 3)
Y = torch.randn(4)
Z = torch.randn(1)


# -- modes (H1) ---------------------------------------------------------------------------------


def test_mode_of_reads_training_grad_inference_and_autocast() -> None:
    net = nn.Linear(2, 2)
    assert mode_of(net) == (True, True, False, False)
    net.eval()
    with torch.no_grad():
        assert mode_of(net) == (False, False, False, False)
    with torch.inference_mode():
        assert mode_of(net) == (False, False, True, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mode_of(net) == (False, True, False, True)


def test_unambiguous_modes_drop_both_training_values_of_one_grad_and_autocast() -> None:
    """The stance cannot tell entries apart by ``training`` (H1): a grad mode and autocast
    compiled with both training values is ambiguous, each with one value is not."""
    train, evaluate = (True, True, False, False), (False, True, False, False)
    no_grad_eval = (False, False, False, False)
    autocast_train = (True, True, False, True)
    modes = {train, evaluate, no_grad_eval, autocast_train}
    assert unambiguous_modes(modes) == {no_grad_eval, autocast_train}
    assert unambiguous_modes({train}) == {train}
    assert unambiguous_modes({train, (True, False, False, False)}) == {
        train,
        (True, False, False, False),
    }
    assert unambiguous_modes(set()) == set()


def test_describe_call_mode_says_why() -> None:
    mode = (False, True, False, True)
    ambiguous = describe_call_mode(mode, compiled=True)
    unseen = describe_call_mode(mode, compiled=False)
    for text in (ambiguous, unseen):
        assert "training=False, grad enabled=True, inference mode=False, autocast=True" in text
    assert "cannot tell them apart" in ambiguous
    assert "not compiled with full guards" in unseen


# -- argument keys (H30, H32, H40) ----------------------------------------------------------------


def _key(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    found = call_key(args, kwargs)
    assert found is not None
    return found[0]


def _ids(tensors: list[torch.Tensor]) -> list[int]:
    return [id(t) for t in tensors]


def test_one_tensor_is_the_shared_key_and_its_own_args() -> None:
    args = (X,)
    key, tensors = call_key(args, {})  # type: ignore[misc]
    assert key is ONE_TENSOR
    assert tensors is args
    assert _key(Y) is ONE_TENSOR  # any shape: the key holds no tensor metadata


def test_the_general_path_gives_the_one_tensor_key_an_equal_value() -> None:
    """``net(x)`` through the fast path equals the same structure built generally."""
    assert _key(X, k=1)[:2] == ONE_TENSOR
    assert _key((X,))[0] == 1  # one argument, but a tuple: not the fast path
    assert _key((X,)) != ONE_TENSOR


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((X, 3), (X, 4)),  # a value
        ((X, 1), (X, True)),  # equal values of other types (1 == True)
        ((X, 1), (X, 1.0)),
        ((X, "a"), (X, "b")),
        ((X, None), (X, Y)),  # None for a tensor
        ((X, torch.float32), (X, torch.float64)),
        ((X, torch.device("cpu")), (X, torch.device("meta"))),
        ((X, (Y, Z)), (X, [Y, Z])),  # tuple or list
        ((X, (Y,)), (X, (Y, Z))),  # length
        ((X, Y), (X,)),  # count
    ],
)
def test_a_plain_difference_changes_the_key(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    """The stance does not check plain arguments itself (H32): each one is in the key."""
    assert _key(*a) != _key(*b)


def test_keywords_are_in_the_key_by_name_and_order() -> None:
    assert _key(X, scale=2.0) != _key(X, shift=2.0)
    assert _key(X, a=1, b=2) != _key(X, b=2, a=1)
    assert _key(X, a=1) != _key(X, 1)
    assert _key(X, a=1) == _key(Y, a=1)  # tensors by type only: their guards check them


def test_tensors_are_collected_in_order_through_containers() -> None:
    found = call_key((X, (Y, [Z]), {"k": X.T}), {"w": Y * 2})
    assert found is not None
    key, tensors = found
    assert key[0] == 3
    assert len(tensors) == 5
    assert _ids(tensors[:3]) == _ids([X, Y, Z]) and tensors[3].shape == (3, 2)
    assert key[-2:] == (("w",), torch.Tensor)
    assert (dict, ("k",)) in key


def test_a_tensor_subclass_is_keyed_by_its_exact_class() -> None:
    """TensorGuards do not check a subclass, so the key does."""
    p = nn.Parameter(torch.randn(2))
    key, tensors = call_key((p,), {})  # type: ignore[misc]
    assert key == (1, nn.Parameter) and _ids(tensors) == [id(p)]
    assert _key(p) != _key(X)
    assert _key(X, w=p) != _key(X, w=Y)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((X, nn.Linear(1, 1)), {}),  # a module
        ((X, object()), {}),  # a custom object
        ((X, {1, 2}), {}),  # a set
        ((X, (1, object())), {}),  # inside a container
        ((X,), {"m": nn.Linear(1, 1)}),  # a keyword
        ((X,), {"d": {"a": object()}}),
    ],
)
def test_other_arguments_have_no_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Their state could change without a visible difference: not dispatched directly."""
    assert call_key(args, kwargs) is None


def test_a_repeated_tensor_is_one_tensor_and_the_key_says_so() -> None:
    """Dynamo merges a tensor passed twice into one input (H40): ``(x, x)`` and ``(x, y)``
    have different keys, and only distinct tensors are returned."""
    twice, tensors = call_key((X, X), {})  # type: ignore[misc]
    assert _ids(tensors) == [id(X)]
    assert twice[-1] == (0, 0)
    distinct, both = call_key((X, Y), {})  # type: ignore[misc]
    assert _ids(both) == _ids([X, Y]) and distinct == (2, torch.Tensor, torch.Tensor)
    assert twice != distinct
    labels, found = call_key((), {"input_ids": X, "labels": X})  # type: ignore[misc]
    assert _ids(found) == [id(X)] and labels[-1] == (0, 0)


def test_a_repeat_among_more_tensors_names_its_positions() -> None:
    key, tensors = call_key((X, Y, X, Z), {})  # type: ignore[misc]
    assert key[-1] == (0, 1, 0, 3)
    assert _ids(tensors) == _ids([X, Y, Z])
    other, _ = call_key((X, Y, Y, Z), {})  # type: ignore[misc]
    assert other[-1] == (0, 1, 1, 3) and other != key
    assert len(_key(X, Y, Z)) == 4  # no pattern without a repeat


def test_plain_types_are_the_ones_keyed_by_value() -> None:
    for value in (True, 3, 0.5, "s", None, torch.int8, torch.device("cpu")):
        assert type(value) in PLAIN_TYPES
        assert _key(X, value)[-1] == (type(value), value)


# -- key sources, masks and structure (H32) --------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((X,), {}),
        ((X, 3, None), {}),
        ((X, (Y, 2.0), [Z]), {}),
        ((X,), {"scale": 2.0, "d": {"a": Y, "b": 1}}),
        ((X, {"k": (1, 2)}), {"t": Y}),
    ],
)
def test_key_sources_name_each_element_of_the_key(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """One source per key element (no tensor repeats here), None exactly at structure."""
    key = _key(*args, **kwargs)
    sources = key_sources(args, kwargs)
    assert len(sources) == len(key)
    for element, source in zip(key, sources):
        structural = type(element) is tuple and element[0] not in PLAIN_TYPES
        assert (source is None) == (structural or type(element) is int), (element, source)


def test_key_sources_are_dynamos_names() -> None:
    sources = key_sources((X, (1, Y)), {"d": {"a": 2}})
    assert sources == [
        None,
        "L['args'][0]",
        None,
        "L['args'][1][0]",
        "L['args'][1][1]",
        None,
        None,
        "L['kwargs']['d']['a']",
    ]


def test_masked_keys_differ_only_outside_the_masked_positions() -> None:
    three, four = _key(X, 3, "a"), _key(X, 4, "a")
    other = _key(X, 4, "b")
    delegated = frozenset({2})
    assert masked(three, delegated) == masked(four, delegated)
    assert masked(three, delegated) != masked(other, delegated)
    assert masked(three, delegated)[2][0] is int  # the type stays
    assert masked(three, delegated) != masked(_key(X, 3.0, "a"), delegated)
    assert masked(three, frozenset()) == three


def test_structure_keeps_everything_but_plain_values() -> None:
    assert structure(_key(X, 3, "a")) == structure(_key(Y, 4, "b"))
    assert structure(_key(X, 3)) != structure(_key(X, 3.0))
    assert structure(_key(X, (1, 2))) != structure(_key(X, [1, 2]))
    assert structure(_key(X, (1, 2))) == (2, torch.Tensor, (tuple, 2), int, int)
    assert structure(_key(X, 1)) != structure(_key(X, Y))


# -- the state outside a call's arguments (H18, H31) -------------------------------------------------


def _plain() -> Any:
    return torch._dynamo.eval_frame._stance


def _graph_module() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(nn.Identity())


def test_no_hooks_are_no_inlined_hooks() -> None:
    assert top_saved_hooks(True) is None
    assert inlined_hooks_active() is False


def test_plain_saved_tensor_hooks_run_at_run_time_and_serve_every_entry() -> None:
    """Hooks that Dynamo does not trace read as ``None`` in its guard (H31)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, pack):
        assert top_saved_hooks(True) == (pack, pack)
        assert inlined_hooks_active() is False


def test_graph_module_hooks_are_inlined_and_checked() -> None:
    pack, unpack = _graph_module(), _graph_module()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert inlined_hooks_active() is True
    assert inlined_hooks_active() is False


def test_a_torch_without_the_hooks_function_always_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(call_mode, "has_saved_hooks_check", False)
        assert inlined_hooks_active() is True
    assert inlined_hooks_active() is False


def test_without_aot_autograds_test_any_hooks_are_inlined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call_mode, "hooks_inlineable", lambda pair: None)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert inlined_hooks_active() is True


def test_the_outside_state_is_clear_under_the_stance_the_run_found() -> None:
    plain = _plain()
    assert outside_state_clear(plain) is True
    assert outside_state_clear(object()) is False  # another stance than the run's


def test_a_stance_the_user_set_is_not_clear() -> None:
    plain = _plain()
    with torch.compiler.set_stance("force_eager"):
        assert outside_state_clear(plain) is False
    assert outside_state_clear(plain) is True


def test_a_torch_function_mode_is_not_clear() -> None:
    plain = _plain()
    with TorchFunctionMode():
        assert outside_state_clear(plain) is False


def test_saved_tensor_hooks_are_not_clear() -> None:
    """Any hooks, inlineable or not: a harvested entry would not run what Dynamo runs."""
    plain = _plain()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert outside_state_clear(plain) is False


def test_a_compile_callback_is_not_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _plain()
    monkeypatch.setattr(call_mode, "_frame_callback", lambda: object())
    assert outside_state_clear(plain) is False


def test_a_dispatch_mode_makes_dynamo_skip_the_frame() -> None:
    """H18: a TorchDispatchMode on the stack (as ModelSummary's FLOP counter) is seen."""
    assert dispatch_mode_active() is False
    with TorchDispatchMode():
        assert dispatch_mode_active() is True
    assert dispatch_mode_active() is False


@pytest.mark.parametrize("inline", [True, False])
def test_dispatch_mode_follows_dynamos_config(
    inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test Dynamo's ``convert_frame`` uses under each value of its config."""
    # Dynamo's config module, not monkeypatch: its undo would delete the option.
    with torch._dynamo.config.patch(inline_torch_dispatch_torch_compile=inline):
        monkeypatch.setattr(call_mode, "dispatch_mode_on_stack", lambda: inline)
        monkeypatch.setattr(call_mode, "any_dispatch_mode", lambda: not inline)
        assert dispatch_mode_active() is True
        on = "dispatch_mode_on_stack" if inline else "any_dispatch_mode"
        monkeypatch.setattr(call_mode, on, lambda: 0)
        assert dispatch_mode_active() is False
    assert torch._dynamo.config.inline_torch_dispatch_torch_compile is True


def test_callback_handler_is_dynamos_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert callback_handler() is torch._dynamo.callback_handler
    handler = torch._dynamo.callback_handler
    with monkeypatch.context() as patch:
        patch.delattr(torch._dynamo, "callback_handler")
        assert callback_handler() is None
    assert callback_handler() is handler
