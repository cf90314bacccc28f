"""The per-call path's parts on their own: the stance values, polled dictionaries and lists,
a repeated key's function, and the parameters' ``requires_grad`` pattern.

End-to-end behaviour (eager equality under every preset) is in ``test_stance_scope.py``,
``test_midepoch.py``, ``test_alternating.py`` and ``test_dpo.py``; these pin down each
part's answer, so that a part that stops seeing a change fails here by name.
"""

from __future__ import annotations

import gc
import types
from typing import Any, Callable

import pytest
import torch
from torch import nn

from guardtrain.compile import grads
from guardtrain.compile.call_mode import ONE_TENSOR, call_key
from guardtrain.compile.polled import Polled
from guardtrain.compile.repeat import promoting, repeat_key, same_as_call_key
from guardtrain.compile.stances import NO_STANCE, Stances
from guardtrain.compile.watch import class_dict

X = torch.randn(4, 8)
Y = torch.randn(2)


# -- stances -----------------------------------------------------------------------------------


def test_stances_of_the_default_stance() -> None:
    plain = torch._dynamo.eval_frame._stance
    s = Stances.of(plain)
    assert s.plain is plain
    assert s.unsafe.skip_guard_eval_unsafe and s.unsafe.stance == "default"
    assert not plain.skip_guard_eval_unsafe  # the run's own value is not touched


@pytest.mark.parametrize("name", ["force_eager", "eager_on_recompile", "fail_on_recompile"])
def test_a_stance_the_user_set_is_never_replaced(name: str) -> None:
    with torch.compiler.set_stance(name):
        s = Stances.of(torch._dynamo.eval_frame._stance)
    assert s.plain is NO_STANCE and s.unsafe is None


# -- polled dictionaries and lists ---------------------------------------------------------------


class Obj:
    pass


class Gain:
    GAIN = 1.0


@pytest.mark.parametrize("n_dicts", [1, 2, 3, 8])  # the sum below 3, one guard tree from 3
def test_polled_dictionaries_move_on_every_write(n_dicts: int) -> None:
    objs = [Obj() for _ in range(n_dicts)]
    p = Polled([o.__dict__ for o in objs])
    assert not p.moved() and len(p) == n_dicts
    objs[-1].x = 1
    assert p.moved()
    p.reset()
    assert not p.moved()
    objs[0].y = 2.0
    assert p.moved()


def test_a_class_attribute_write_moves_the_class_dict() -> None:
    d = class_dict(Gain)
    assert d is not None and d["GAIN"] == 1.0
    p = Polled([d, Obj().__dict__, Obj().__dict__])
    try:
        Gain.GAIN = 2.0
        assert p.moved()
    finally:
        Gain.GAIN = 1.0


def test_polled_lists() -> None:
    scales, active, objects = [1.0, 2], [0], [nn.Linear(2, 2)]
    p = Polled([], [scales, active, objects])
    assert not p.moved() and len(p) == 3
    scales[0] = 1.0  # the same value again
    assert not p.moved()
    scales[0] = 2.5
    assert p.moved()
    p.reset()
    active.append(1)
    assert p.moved()
    p.reset()
    active.pop()
    assert p.moved()
    p.reset()
    objects[0] = nn.Linear(2, 2)  # another object, compared by identity
    assert p.moved()
    p.reset()
    tensors = [torch.ones(3), torch.ones(3)]
    q = Polled([], [tensors])
    tensors[1] = torch.ones(3)  # equal values, another tensor: no ambiguous comparison
    assert q.moved()


def test_nothing_polled() -> None:
    assert not Polled().moved() and len(Polled()) == 0


# -- a repeated key's own function ---------------------------------------------------------------

TEMPLATES = [
    ((X, 3, 0.5, "a"), {}),
    ((X, Y), {}),
    ((X,), {"scale": 2.0}),
    ((X, None, True), {"mode": "eval"}),
]
OTHERS = [
    ((X, 3, 0.5, "a"), {}),
    ((Y, 3, 0.5, "a"), {}),
    ((X, 4, 0.5, "a"), {}),
    ((X, 3.0, 0.5, "a"), {}),
    ((X, True, 0.5, "a"), {}),
    ((X, 3, 0.5, "b"), {}),
    ((X, 3, 0.5), {}),
    ((X, 3, 0.5, "a"), {"z": 1}),
    ((X, X), {}),
    ((X, Y), {}),
    ((X,), {"scale": 2.0}),
    ((X,), {"scale": 2}),
    ((X,), {"shift": 2.0}),
    ((X, None, True), {"mode": "eval"}),
    ((X, Y, True), {"mode": "eval"}),
    ((X, None, 1), {"mode": "eval"}),
    ((X,), {}),
    ((X, (3, 1)), {}),
]


@pytest.mark.parametrize(("args", "kwargs"), TEMPLATES)
def test_a_repeated_keys_function_gives_call_keys_answer(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    found = call_key(args, kwargs)
    assert found is not None
    key, _ = found
    key_of = repeat_key(key, args, kwargs)
    assert key_of is not call_key and key_of is not same_as_call_key
    for other_args, other_kwargs in OTHERS:
        want = call_key(other_args, other_kwargs)
        got = key_of(other_args, other_kwargs)
        assert (got is None) == (want is None)
        if want is None:
            continue
        assert got[0] == want[0], (args, kwargs, other_args, other_kwargs)
        assert [id(t) for t in got[1]] == [id(t) for t in want[1]]
        # The same key object exactly when the call repeats the template's key.
        assert (got[0] is key) == (want[0] == key)


def test_the_key_function_is_made_at_the_first_repeat_of_the_admitted_key() -> None:
    """Until the last admitted key repeats, ``call_key``'s answer; at the repeat the target's
    key function becomes the one made for that key (the steady path never asks)."""
    target = types.SimpleNamespace(last_key=None)
    target.key_of = first = promoting(target)
    args = (X, 3, 0.5)
    found = target.key_of(args, {})
    assert found == call_key(args, {}) and target.key_of is first  # no key admitted yet
    target.last_key = found[0]
    again = target.key_of(args, {})
    assert again[0] == found[0] and target.key_of not in (first, call_key, same_as_call_key)
    assert target.key_of((X, 3, 0.5), {})[0] is again[0]  # recognised without a new key
    one = types.SimpleNamespace(last_key=ONE_TENSOR)
    one.key_of = promoting(one)
    one.key_of((X,), {})
    assert one.key_of is same_as_call_key  # call_key's own fast path


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((X,), {}), ((X, X), {}), ((X, (3, 1)), {}), ((X, 1, 2, 3, 4, 5, 6), {})],
)
def test_calls_that_keep_call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """One tensor (call_key's own fast path), a repeated tensor, a container, a long call."""
    found = call_key(args, kwargs)
    assert found is not None
    assert repeat_key(found[0], args, kwargs) is same_as_call_key
    assert call_key((X,), {})[0] is ONE_TENSOR  # type: ignore[index]


# -- the requires_grad pattern --------------------------------------------------------------------


def test_the_pattern_reads_the_tensors_own_flag() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    params = list(net.parameters())
    assert grads.pattern(params) == (True, True, True, True)
    net[0].weight.requires_grad_(False)
    torch.Tensor.requires_grad_(net[1].bias, False)  # no event; the pattern sees it
    assert grads.pattern(params) == (False, True, True, False)


def test_the_pattern_is_read_past_a_torch_function_mode() -> None:
    from torch.overrides import TorchFunctionMode

    seen: list[Any] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    params = list(nn.Linear(2, 2).parameters())
    with Spy():
        assert grads.pattern(params) == (True, True)
    assert seen == []


def test_class_dict_of_a_builtin_type() -> None:
    d = class_dict(nn.Linear)
    assert d is not None and "forward" in d
    assert d is gc.get_referents(nn.Linear.__dict__)[0]


# -- code per requires_grad pattern ----------------------------------------------------------------


def _target(module: nn.Module, **kwargs: Any) -> Any:
    from guardtrain.compile import CompiledTarget

    hooks: dict[str, Any] = {"on_compile": lambda t, r: None, "on_miss": lambda t, r: True}
    return CompiledTarget("", module, {"backend": "aot_eager"}, None, False, **hooks, **kwargs)


def test_each_pattern_runs_code_of_its_own_and_keeps_it() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    target = _target(net)
    try:
        first = target.code
        assert first.pattern == (True, True, True, True)
        net[0].requires_grad_(False)
        assert grads.moved(target) and grads.use_variant(target)
        frozen = target.code
        assert frozen is not first and frozen.pattern == (False, False, True, True)
        assert target.compiled is frozen.compiled and target in frozen.members
        net(torch.randn(2, 4)).sum().backward()
        assert net[0].weight.grad is None and net[2].weight.grad is not None
        net[0].requires_grad_(True)
        assert grads.use_variant(target) and target.code is first  # kept, not rebuilt
        assert not grads.use_variant(target)  # nothing moved
        net(torch.randn(2, 4)).sum().backward()
        assert net[0].weight.grad is not None  # the unfrozen layer gets its gradient
        # A change that makes entries stale rebuilds the code in use and drops the others.
        target.rebuild()
        assert list(target.code.variants) == [(first.pattern, False)]
    finally:
        target.uninstall()


def test_at_most_variant_limit_patterns_are_kept() -> None:
    from guardtrain.compile.code import VARIANT_LIMIT

    net = nn.Sequential(*[nn.Linear(2, 2, bias=False) for _ in range(VARIANT_LIMIT + 2)])
    target = _target(net)
    try:
        for i in range(VARIANT_LIMIT + 2):
            net[i].weight.requires_grad_(False)
            grads.use_variant(target)
        assert len(target.code.variants) == VARIANT_LIMIT
        assert (target.code.pattern, False) in target.code.variants  # the one in use is kept
    finally:
        target.uninstall()


def test_a_requires_grad_flip_marks_its_target_and_its_bits_follow() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    target = _target(net)
    weight = net[0].weight
    try:
        target.changed = False
        weight.requires_grad = True  # the value it holds: no flip
        weight.requires_grad_(True)
        assert not target.changed and bytes(target.flips.grad_bits) == b"\x01\x01\x01\x01"
        weight.requires_grad = False
        assert target.changed and target.dirty and target.flips.only
        assert target.change_note == "requires_grad of a parameter was set to False"
        assert bytes(target.flips.grad_bits) == b"\x00\x01\x01\x01"
        target.changed = False
        target.dirty = False
        net[2].bias.requires_grad_(False)  # the method form too
        assert (
            target.changed and target.dirty and bytes(target.flips.grad_bits) == b"\x00\x01\x01\x00"
        )
        target.changed = False
        nn.Linear(2, 2).weight.requires_grad = False  # a parameter of no target
        assert not target.changed
    finally:
        target.uninstall()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _double(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


CHANGE_STEP = 6


def _scale_to_three(model: nn.Module) -> Any:
    model.scale = 3.0  # a plain attribute the guards read: an event


def _hook(model: nn.Module) -> Any:
    return model.lin.register_forward_hook(_double)  # an event


@pytest.mark.parametrize("change", [_scale_to_three, _hook], ids=["attribute", "hook"])
@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
def test_an_event_between_two_calls_of_one_batch_is_seen_by_the_second(
    preset: str, change: Callable[[nn.Module], Any]
) -> None:
    """In a steady batch whose first call ran with nothing changed, a change lands between
    the first and second calls: only the dirty flag carries it to the second call (the
    batch's first call is past). A hook is removed again before the third."""
    import copy

    from helpers import guard_tuner, stance_on

    torch.manual_seed(0)
    net = _Scaled()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 4)
    with guard_tuner(net, preset, compile_kwargs={"backend": "aot_eager"}) as tuner:
        for step in range(CHANGE_STEP + 1):
            with tuner.step(x), torch.no_grad():
                steady = stance_on()
                outs = [(net(x), ref(x))]
                handles = []
                if step == CHANGE_STEP:
                    handles = [change(net), change(ref)]
                outs.append((net(x), ref(x)))
                for handle in handles:
                    if handle is not None:
                        handle.remove()
                outs.append((net(x), ref(x)))
            for i, (out, expected) in enumerate(outs):
                assert torch.equal(out, expected), (step, i)
    assert steady, "the batch with the change ran steady"
    assert not torch.equal(outs[1][1], outs[0][1])  # the change changes what eager computes
