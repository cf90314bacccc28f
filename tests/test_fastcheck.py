"""The generated assertion checks agree with the assertions checked one by one."""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import pytest
import torch
from torch import nn

from guardtrain.compile import CompiledTarget
from guardtrain.compile.assertions import Assertion, Recorded, check
from guardtrain.compile.fastcheck import EntryChecks, _Plan, entry_checks
from guardtrain.filters import skip_rechecked

SETTINGS = {"scale": 2.0}


def act(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


class Config:
    def __init__(self) -> None:
        self.flag = True
        self.mode = "a"


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.p = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.p


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Inner() for _ in range(2))
        self.cfg = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if self.cfg.flag and self.cfg.mode == "a":
            x = x + 1
        return act(x) * SETTINGS["scale"]


def compiled(guard_filter: Any) -> tuple[Outer, CompiledTarget]:
    m = Outer()
    target = CompiledTarget(
        "net",
        m,
        {"backend": "eager"},
        guard_filter,
        False,
        on_compile=lambda t, r: None,
        on_miss=lambda t, e: False,
    )
    m(torch.randn(2, 4))
    return m, target


def one_by_one(entry: tuple[Assertion, ...], scope: dict[str, Any], kept: bool | None) -> bool:
    return all(a.holds(scope) for a in entry if kept is None or a.kept is kept)


def set_attr(obj: Any, name: str, value: Any) -> Callable[[], None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old)


def pop_module(parent: nn.Module, name: str) -> Callable[[], None]:
    child = parent._modules.pop(name)
    return lambda: parent._modules.__setitem__(name, child)


CHANGES: dict[str, Callable[[Outer], Callable[[], None]]] = {
    "nothing": lambda m: lambda: None,
    "a value on a submodule": lambda m: set_attr(m.blocks[1], "p", 0.25),
    "a value of another type": lambda m: set_attr(m.blocks[0], "p", 1),
    "a plain object's field": lambda m: set_attr(m.cfg, "mode", "b"),
    "a flag": lambda m: set_attr(m.cfg, "flag", False),
    "a submodule of another type": lambda m: set_attr(m.blocks[0], "lin", nn.Identity()),
    "a global function": lambda m: set_attr(sys.modules[__name__], "act", torch.sigmoid),
    "a hook": lambda m: m.blocks[1].register_forward_hook(lambda *a: None).remove,
    "a removed submodule (the read raises)": lambda m: pop_module(m.blocks[0], "lin"),
}


@pytest.mark.parametrize("guard_filter", [None, skip_rechecked], ids=["keep", "drop"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_generated_checks_agree_with_each_assertion(guard_filter: Any, change: str) -> None:
    m, target = compiled(guard_filter)
    entries = target.code.assertions
    assert entries and all(type(e) is Recorded for e in entries)
    scope = target.scope()
    undo = CHANGES[change](m)
    try:
        for entry in entries:
            checks = entry_checks(entry)
            assert entry_checks(entry) is checks  # made once, kept on the entry
            assert checks.kept(scope) == one_by_one(entry, scope, True)
            assert checks.dropped(scope) == one_by_one(entry, scope, False)
            locals_ = tuple(a for a in entry if not a.glob)
            assert checks.dropped_locals(scope) == one_by_one(locals_, scope, False)
        if change == "nothing":
            assert target.check_assertions() == (None, None)
        else:
            assert any(not one_by_one(e, scope, None) for e in entries), change
            # The per-assertion check names what changed, as before.
            assert target.check_assertions() != (None, None)
    finally:
        undo()
    assert target.check_assertions() == (None, None)


def test_a_changed_global_is_found_by_both() -> None:
    _, target = compiled(skip_rechecked)
    before = SETTINGS["scale"]
    SETTINGS["scale"] = 3.0
    try:
        scope = target.scope()
        for entry in target.code.assertions:
            checks = entry_checks(entry)
            assert checks.kept(scope) == one_by_one(entry, scope, True)
            assert checks.dropped(scope) == one_by_one(entry, scope, False)
    finally:
        SETTINGS["scale"] = before


def test_plain_tuple_entries_are_checked_each_time() -> None:
    expr = compile("module.p", "<guard>", "eval")
    entry = (Assertion("module.p", "value", 0.5, True, expr),)
    inner = Inner()
    assert check([entry], {"module": inner}, "net", True) == (None, None, None)
    inner.p = 0.75
    stale, unmatched, failed = check([entry], {"module": inner}, "net", True)
    assert stale is None and unmatched is not None and "0.5 -> 0.75" in unmatched
    assert failed is entry[0]


def test_each_kind_and_an_empty_group() -> None:
    inner = Inner()

    def assertion(name: str, kind: str, value: Any, kept: bool = True) -> Assertion:
        return Assertion(name, kind, value, kept, compile(name, "<guard>", "eval"))

    entry = [
        assertion("module.p", "value", 0.5),
        assertion("module._modules['lin']", "identity", inner.lin),
        assertion("module._modules['lin']", "type", nn.Linear),
        assertion("module._forward_hooks", "empty", None),
    ]
    checks = EntryChecks(entry)
    assert checks.kept({"module": inner}) and checks.dropped({"module": inner})  # no dropped: True
    inner.p = True  # equal to 1.0 by ==, another type: the value guard fails
    assert not checks.kept({"module": inner})
    inner.p = 0.5
    lin = inner.lin
    inner.lin = nn.Linear(4, 4)  # the same type, another object: the identity guard fails
    assert not checks.kept({"module": inner})
    inner.lin = lin
    assert checks.kept({"module": inner})
    inner.register_forward_hook(lambda *a: None)
    assert not checks.kept({"module": inner})


def test_a_name_missing_from_the_scope_fails_as_evaluating_it_does() -> None:
    a = Assertion("module", "type", type(None), True, compile("module", "<guard>", "eval"))
    assert a.holds({}) is False  # NameError
    assert EntryChecks([a]).kept({}) is False
    assert EntryChecks([a]).kept({"module": None}) is True


def test_reads_are_shared_and_odd_sources_kept() -> None:
    plan = _Plan()

    def typed(name: str) -> Assertion:
        return Assertion(name, "type", int, False, compile(name, "<test>", "eval"))

    assert plan.add(typed("bound._modules['a']._modules['b'].x"))
    assert plan.add(typed("bound._modules['a']._modules['c'].y"))
    roots, levels, _ = plan._freeze()
    assert roots == ("bound",)
    # ._modules, ['a'], ._modules shared; ['b'] and ['c'] apart, then .x and .y
    assert [len(getters) for getters, _ in levels] == [1, 1, 1, 2, 2]
    assert not plan.add(typed("len(bound.x)"))  # not a chain of reads: evaluated as it is
    assert not plan.add(typed("other.x"))  # not a name of the scope
    assert plan.add(typed("bound._modules['a.b'][0]"))  # a dot inside a key


def test_recorded_entries_copy_without_their_checks() -> None:
    import copy

    _, target = compiled(skip_rechecked)
    entry = target.code.assertions[0]
    entry_checks(entry)
    assert hasattr(entry, "checks")
    twin = copy.copy(entry)
    assert type(twin) is Recorded and tuple(twin) == tuple(entry)
    assert not hasattr(twin, "checks")  # made afresh when it is checked
    assert entry_checks(twin).kept(target.scope())


def test_the_grouped_check_answers_as_each_assertion_would() -> None:
    """Per kind, on one object: the grouped answer is :meth:`Assertion.holds`'s for each (a
    NaN recorded by value never holds, even as the same object)."""
    nan = float("nan")
    holder = types.SimpleNamespace(x=nan, n=3, items=[1, 2], hooks={})
    scope = {"bound": holder}

    def made(name: str, kind: str, value: Any) -> Assertion:
        return Assertion(name, kind, value, False, compile(name, "<test>", "eval"))

    cases = [
        made("bound.x", "value", nan),
        made("bound.n", "value", 3),
        made("bound.n", "value", 3.0),
        made("bound.n", "type", int),
        made("bound.items", "length", 2),
        made("bound.hooks", "empty", None),
        made("bound.items", "identity", holder.items),
        made("bound.missing", "value", 1),
    ]
    for a in cases:
        assert EntryChecks([a]).dropped(scope) is a.holds(scope), a
