"""Preset ``turbo``: harvested entries run directly in the steady state (H30).

Each per-call check is shown to catch its change: a call that fails one takes the
normal path (counted: ``direct_calls`` does not move) and matches an eager run of
the same weights. Refusals name their reason in the summary.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import (
    Net,
    NetModule,
    assert_restored,
    compare,
    guard,
    guard_tuner,
    guard_without_lookup,
    stance_on,
)
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from guardtrain import GuardTuner, versions
from guardtrain.engine import GuardEngine
from guardtrain.engine.config import make_config


class Scaled(nn.Module):
    """Linear -> ReLU -> Linear, times a float argument: no randomness, no buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * scale


class Marked(torch.Tensor):
    """A tensor subclass with torch's default behaviour."""


def _direct_calls(tuner: GuardTuner) -> int:
    return tuner.engine.targets.counts.direct_calls  # type: ignore[no-any-return]


@contextlib.contextmanager
def _steady(model: nn.Module, **kwargs: Any) -> Iterator[GuardTuner]:
    """A turbo tuner warmed up on training steps until calls run directly."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    with guard_tuner(model, "turbo", warmup_steps=2, stable_steps=1, **kwargs) as tuner:
        for _ in range(6):
            with tuner.step((x,)):
                model(x).sum().backward()
        assert tuner.phase == "steady" and stance_on()
        assert _direct_calls(tuner) > 0, "turbo never dispatched directly"
        yield tuner


def _counting_function_mode() -> tuple[Callable[[], Any], list[int]]:
    seen = [0]

    class Count(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            seen[0] += 1
            return func(*args, **(kwargs or {}))

    return Count, seen


def _hooks() -> tuple[Callable[[], Any], list[int]]:
    packed = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed[0] += 1
        return t

    return (lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)), packed


def _call(case: str, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """One training call of ``model`` changed as ``case`` says; returns the output and what
    the change observes (gradient of the input, ops seen, flops, packed tensors)."""
    if case == "input requires grad":
        x = x.clone().requires_grad_()
        out = model(x)
        out.sum().backward()
        return out, x.grad
    if case == "strides":
        x = x.t().contiguous().t()  # the same values, column-major
        out = model(x)
        return out, x.stride()
    if case == "float argument":
        return model(x, 2.5), None
    if case == "tensor subclass":
        return model(x.as_subclass(Marked)).as_subclass(torch.Tensor), None
    if case == "torch-function mode":
        mode, seen = _counting_function_mode()
        with mode():
            out = model(x)
        return out, seen[0]
    if case == "dispatch mode":
        with FlopCounterMode(display=False) as flops:
            out = model(x)
        return out, flops.get_total_flops()
    if case == "saved-tensor hooks":
        hooks, packed = _hooks()
        with hooks():
            out = model(x)
        out.sum().backward()
        return out, packed[0]
    if case == "deterministic algorithms":
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(not before)  # a change, whatever the state
        try:
            return model(x), None
        finally:
            torch.use_deterministic_algorithms(before)
    if case == "force_eager stance":
        with torch.compiler.set_stance("force_eager"):
            return model(x), None
    if case == "dynamo reset":
        torch._dynamo.reset()
        return model(x), None
    raise AssertionError(case)


CASES = [
    "input requires grad",
    "strides",
    "float argument",
    "tensor subclass",
    "torch-function mode",
    "dispatch mode",
    "saved-tensor hooks",
    "deterministic algorithms",
    "force_eager stance",
    "dynamo reset",
]


@pytest.mark.parametrize("case", CASES)
def test_each_per_call_check_sends_a_changed_call_the_normal_way(case: str) -> None:
    if case == "torch-function mode" and versions.release() < (2, 12):
        pytest.skip(
            "torch 2.11's Dynamo raises 'Guard failed on the same frame it was created' "
            "under a torch-function mode that counts its calls, also for plain torch.compile"
        )
    model = Scaled()
    eager = copy.deepcopy(model)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    with _steady(model) as tuner:
        before = _direct_calls(tuner)
        with tuner.step((x,)):
            got, seen = _call(case, model, x)
        assert _direct_calls(tuner) == before, f"{case}: the changed call ran directly"
        # An ordinary call afterwards runs directly again (or, after a re-arm, normally).
        with tuner.step((x,)):
            again = model(x)
    want, expected = _call(case, eager, x)
    assert torch.equal(got, want), f"{case}: differs from eager"
    if isinstance(expected, torch.Tensor):
        assert torch.equal(seen, expected)
    else:
        assert seen == expected
    if case in ("torch-function mode", "dispatch mode", "saved-tensor hooks"):
        assert seen, f"{case}: nothing observed, the test would not catch a skipped check"
    assert torch.equal(again, eager(x))
    assert_restored(model)


class Doubling(nn.Module):
    """Doubles its second input in place: the result depends on whether both are one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.mul_(2)
        return self.a(x) + y


def test_one_tensor_passed_twice_is_not_run_by_an_entry_for_two() -> None:
    """Dynamo guards aliasing between inputs; so does ``TensorGuards`` (it refuses a tensor
    passed twice), and the harvest's guard evaluation rejects the entry: the call leaves
    the stance."""
    model = Doubling()
    eager = copy.deepcopy(model)
    # No lookup window: its batches run with full guards, and 5 steps must reach direct calls.
    with (
        torch.no_grad(),
        guard_tuner(model, "turbo", warmup_steps=2, stable_steps=1, measure_lookup=False) as t,
    ):
        model.eval()
        eager.eval()
        for _ in range(5):
            x, y = torch.randn(4, 8), torch.randn(4, 8)
            with t.step((x, y)):
                got = model(x, y.clone())
            assert torch.equal(got, eager(x, y.clone()))
        assert _direct_calls(t) > 0
        before = _direct_calls(t)
        x = torch.randn(4, 8)
        x_eager = x.clone()
        with t.step((x, x)):
            got = model(x, x)
        assert _direct_calls(t) == before, "an entry for two tensors ran one tensor twice"
    want = eager(x_eager, x_eager)
    assert torch.equal(got, want) and torch.equal(x, x_eager)


FLAG = False
"""A global read in :class:`Toggled`'s forward (a value guard, kept per frame)."""


class Toggled(nn.Module):
    """Its output depends on an attribute, a submodule's ``training`` flag and a global:
    each value compiles an entry of its own, and the stance tells them apart by the
    guards that differ between entries."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.flag = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.lin(x))
        if self.flag:
            y = y * 2
        return y * 3 if FLAG else y


@pytest.mark.parametrize("what", ["attribute", "submodule training", "global"])
def test_entries_told_apart_by_diff_guards_run_their_own(what: str) -> None:
    """Two values alternate within every step, each with an entry since warm-up: each
    call runs its own value's entry, directly (the harvested entry's diff guards are
    checked per call, as the stance does)."""
    global FLAG
    torch.manual_seed(0)
    model = Toggled()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)

    def set_value(m: Toggled, on: bool) -> None:
        global FLAG
        if what == "attribute":
            m.flag = on
        elif what == "submodule training":
            m.bn.train(on)
        else:
            FLAG = on

    try:
        with torch.no_grad(), guard_tuner(model, "turbo", warmup_steps=2, stable_steps=1) as t:
            for _ in range(10):
                with t.step((x,)):
                    for on in (False, True):
                        set_value(model, on)
                        got = model(x)
                        set_value(eager, on)
                        assert torch.equal(got, eager(x)), (what, on)
            assert _direct_calls(t) >= 8
            assert [tt.cache_entries() for tt in t.engine.targets.installed] == [2]
    finally:
        FLAG = False


@pytest.mark.parametrize("first", ["x, x", "x, y"])
def test_one_tensor_twice_and_two_tensors_use_their_own_entries(first: str) -> None:
    """Dynamo merges a tensor passed twice into one graph input: an entry harvested from
    ``(x, x)`` must not serve ``(x, y)``, nor the reverse."""

    class Minus(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.lin(a) - b

    torch.manual_seed(0)
    model = Minus()
    eager = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    order = [(x, x), (x, y)] if first == "x, x" else [(x, y), (x, x)]
    with guard_tuner(model, "turbo", warmup_steps=2, stable_steps=1) as t:
        for _ in range(6):  # warm-up sees only the first kind
            with t.step((x,)):
                assert torch.equal(model(*order[0]), eager(*order[0]))
        assert _direct_calls(t) > 0
        for _ in range(4):
            with t.step((x,)):
                for args in order:
                    assert torch.equal(model(*args), eager(*args)), args


def test_direct_calls_match_the_normal_path_bitwise() -> None:
    """Train, no_grad and eval calls, directly and through Dynamo: the same numbers."""
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    xs = [torch.randn(16, 8) for _ in range(12)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)

    def step(m: nn.Module, o: torch.optim.Optimizer, x: torch.Tensor, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        loss = m(x).square().mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    with guard_tuner(model, "turbo", warmup_steps=2, stable_steps=1) as tuner:
        for epoch in range(3):
            model.train()
            eager.train()
            for i, x in enumerate(xs):
                with tuner.step((x,)):
                    got = step(model, opt, x, 100 * epoch + i)
                assert torch.equal(got, step(eager, opt_e, x, 100 * epoch + i))
            model.eval()
            eager.eval()
            with torch.no_grad(), tuner.loop("validate"):
                for x in xs[:4]:
                    with tuner.step((x,)):
                        assert torch.equal(model(x), eager(x))
        s = tuner.summary()
    assert s["direct_dispatch"]["on"] and s["direct_dispatch"]["calls"] >= 20
    assert s["direct_dispatch"]["refused"] is None
    for a, b in zip(model.state_dict().values(), eager.state_dict().values()):
        assert torch.equal(a, b)
    assert_restored(model)


@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
def test_lightning_run_matches_eager(preset: str) -> None:
    cb, _ = compare(NetModule, lambda: guard(preset, measure_lookup=True), max_epochs=3)
    s = cb.summary()
    assert s["steady_steps"] > 0
    direct = s["direct_dispatch"]
    if cb.settings.direct_dispatch:  # also `aggressive` under pytest --turbo-everywhere
        assert direct["on"] and direct["calls"] > 0
        assert "direct dispatch  on:" in cb.format_summary()
        # Profiled under turbo too: full guards, then what Dynamo's entry path still costs.
        assert "full_guards" in s["lookup_us"], (s["lookup_us"], s["step"])
        if "steady" in s["lookup_us"]:
            assert s["step"]["saved_us"] is not None and s["step"]["note"], s["step"]
    else:
        assert not direct["requested"] and direct["calls"] == 0
        assert "direct dispatch" not in cb.format_summary()


def test_verify_batches_take_the_normal_path() -> None:
    """A verify batch compares the compiled call with eager: it must not run directly."""
    model = Scaled()
    x = torch.randn(16, 8)
    with guard_tuner(model, "turbo", warmup_steps=2, stable_steps=1, verify_every=4) as tuner:
        counts = []
        for _ in range(12):
            with tuner.step((x,)):
                before = _direct_calls(tuner)
                model(x).sum().backward()
                counts.append((tuner.engine.run.checks.verify_batch, _direct_calls(tuner) - before))
    assert any(verify for verify, _ in counts)
    assert all(n == 0 for verify, n in counts if verify)
    assert any(n == 1 for verify, n in counts if not verify)


def test_shared_code_members_run_their_own_harvested_entries() -> None:
    """Blocks sharing code but differing in a kept scalar pick their own entries."""

    class Block(nn.Module):
        def __init__(self, temperature: float) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.temperature = temperature

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x) / self.temperature)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(t) for t in (1.0, 2.0, 1.0, 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = Stack()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with guard_tuner(model, "turbo", targets=["blocks.*"], warmup_steps=2, stable_steps=1) as t:
        for _ in range(8):
            with t.step((x,)):
                out = model(x)
                out.sum().backward()
        assert _direct_calls(t) > 0
        s = t.summary()
    assert torch.equal(out, eager(x))
    assert s["shared_code"], "the blocks did not share code"


def test_refused_with_guard_collectives_and_fsdp() -> None:
    collectives = GuardEngine(make_config("turbo", guard_collectives=True))
    with pytest.warns(UserWarning, match="direct dispatch \\(turbo\\) is refused"):
        collectives.setup(world_size=2, rank=0)
    s = collectives.summary()["direct_dispatch"]
    assert s["requested"] and not s["on"] and "guard_collectives=True" in s["refused"]

    fsdp = GuardEngine(make_config("turbo"))
    with pytest.warns(UserWarning, match="refused: FSDPStrategy gathers"):
        fsdp.setup(swaps_parameters="FSDPStrategy")
    s = fsdp.summary()["direct_dispatch"]
    assert not s["on"] and s["refused"].startswith("FSDPStrategy")
    assert "direct dispatch  refused: FSDPStrategy" in fsdp.format_summary()

    single = GuardEngine(make_config("turbo", guard_collectives=True))
    single.setup(world_size=1, rank=0)  # one process: no collectives, nothing to refuse
    assert single.summary()["direct_dispatch"]["on"]


def test_a_target_whose_every_entry_breaks_keeps_the_stance_off_and_is_named() -> None:
    class Breaking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            torch._dynamo.graph_break()
            return y * 2

    model = Breaking()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with (
        pytest.warns(UserWarning, match="graph breaks"),
        guard_tuner(model, "turbo", targets=[""], warmup_steps=1, stable_steps=1) as tuner,
    ):
        for _ in range(8):
            with tuner.step((x,)):
                out = model(x)
        s = tuner.summary()
    assert torch.equal(out, eager(x))
    # No entry to serve: every call runs with full guards, outside the steady state (H4).
    assert s["steady_steps"] == 0 and "graph breaks" in (s["stance_blocked"] or "")
    assert s["direct_dispatch"]["calls"] == 0
    assert s["direct_dispatch"]["broken_targets"] == ["<model>"]
    assert s["direct_dispatch"]["refused_targets"] == []
    [kept] = s["mixed_targets"]
    assert kept["target"] == "<model>" and not kept["mixed"], kept
    assert "<model>: Call to `torch._dynamo.graph_break()`" in tuner.format_summary()
    assert "every call breaks, so the stance stays off" in tuner.format_summary()
    assert s["compiled_again"] == {}, s  # nothing compiled again for the break


def test_turbo_after_a_second_fit_keeps_counting() -> None:
    model = NetModule()
    cb = guard_without_lookup("turbo")
    from helpers import fit

    fit(model, [cb], max_epochs=2)
    first = cb.summary()["direct_dispatch"]["calls"]
    fit(model, [cb], max_epochs=1)
    assert first > 0 and cb.summary()["direct_dispatch"]["calls"] > first
