"""The model and the process when the run starts: taken over, or refused with a clear error.

* the user's own compile of a target (``nn.Module.compile``, a compiled
  ``forward``, ``torch.compile`` of a child, also in ``__init__``) is switched off
  for the run, and the run equals an uncompiled one; it is put back afterwards;
* a bad model (``torch.compile`` of the LightningModule, a ``forward`` that is not
  a method, unknown or aliased targets, a target without ``forward``), two
  callbacks on one target, or the unsafe stance already set are refused when the
  run starts, each with its error class and message (``docs/errors.md`` lists
  them with these tests), leaving the model, the stance and Dynamo's config as
  they were.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    EAGER,
    Net,
    NetModule,
    TinyModule,
    assert_restored,
    compare,
    fit,
    guard_without_lookup,
)
from torch import nn

from guardtrain import (
    GuardTrainRuntimeError,
    GuardTrainTypeError,
    GuardTrainValueError,
    GuardTuneCallback,
)
from guardtrain.engine.process import stance_is_unsafe


def _lm_compiled(m: NetModule) -> Any:
    return torch.compile(m, backend="eager")


def _net_compile(m: NetModule) -> NetModule:
    m.net.compile(backend="eager")
    return m


def _lm_compile(m: TinyModule) -> TinyModule:
    m.compile(backend="eager")
    return m


def _forward_compiled(m: TinyModule) -> TinyModule:
    m.forward = torch.compile(m.forward, backend="eager")  # type: ignore[method-assign]
    return m


def _net_forward_compiled(m: NetModule) -> NetModule:
    m.net.forward = torch.compile(m.net.forward, backend="eager")  # type: ignore[method-assign]
    return m


def _net_wrapped(m: NetModule) -> NetModule:
    m.net = torch.compile(m.net, backend="eager")  # type: ignore[assignment]
    return m


def _net_forward_lambda(m: NetModule) -> NetModule:
    inner = m.net
    m.net.forward = lambda x: Net.forward(inner, x)  # type: ignore[method-assign]
    return m


class Aliased(NetModule):
    def __init__(self) -> None:
        super().__init__()
        self.alias = self.net


class WithList(NetModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])


def forwards(model: nn.Module) -> dict[str, Any]:
    return {n: m.__dict__.get("forward") for n, m in model.named_modules()}


@pytest.mark.parametrize(
    ("make", "kwargs", "took_over"),
    [
        (lambda: _net_compile(NetModule()), {}, ["net (nn.Module.compile)"]),
        (lambda: _lm_compile(TinyModule()), {}, ["<LightningModule> (nn.Module.compile)"]),
        (lambda: _forward_compiled(TinyModule()), {}, ["<LightningModule> (a compiled forward)"]),
        (lambda: _net_forward_compiled(NetModule()), {}, ["net (a compiled forward)"]),
        (lambda: _net_wrapped(NetModule()), {"targets": ["net"]}, ["net (torch.compile)"]),
    ],
    ids=[
        "net_dot_compile",
        "lightningmodule_dot_compile",
        "forward_eq_torch_compile",
        "net_forward_eq_torch_compile",
        "net_eq_torch_compile_net_as_target",
    ],
)
def test_users_own_compile_is_taken_over(
    make: Any, kwargs: dict[str, Any], took_over: list[str]
) -> None:
    """The user's own compile of a target is switched off for the run and put back after."""
    model = make()
    before = {
        n: (m.__dict__.get("forward"), m.__dict__.get("_compiled_call_impl"))
        for n, m in model.named_modules()
    }
    with pytest.warns(UserWarning, match="took over the compile of"):
        cb, _ = compare(make, lambda: guard_without_lookup(**kwargs), max_epochs=2)
    assert cb.summary()["took_over"] == took_over
    assert cb.summary()["steady_steps"] > 0 and cb.summary()["compiles"] >= 2
    fit(model, [guard_without_lookup(**kwargs)], max_epochs=1)
    after = {
        n: (m.__dict__.get("forward"), m.__dict__.get("_compiled_call_impl"))
        for n, m in model.named_modules()
    }
    assert after == before  # the user's compiles are back


@pytest.mark.parametrize(
    ("make", "kwargs", "error", "match"),
    [
        (
            lambda: _lm_compiled(NetModule()),
            {},
            GuardTrainValueError,
            "compiled with torch.compile",
        ),
        (
            lambda: _net_forward_lambda(NetModule()),
            {},
            GuardTrainTypeError,
            "instance attribute `forward` of type function",
        ),
        (NetModule, {"targets": ["nope"]}, GuardTrainValueError, "'nope' matches no submodule"),
        (
            Aliased,
            {"targets": ["net", "alias"]},
            GuardTrainValueError,
            "`targets` names the same module twice: 'net' and 'alias'",
        ),
        (WithList, {"targets": ["blocks"]}, GuardTrainValueError, "defines no `forward`"),
    ],
    ids=[
        "torch_compile_lightningmodule",
        "forward_not_a_method",
        "unknown_target",
        "aliased_module_named_twice",
        "target_without_forward",
    ],
)
def test_bad_model_is_refused_when_the_run_starts(
    make: Any, kwargs: dict[str, Any], error: type, match: str
) -> None:
    model = make()
    inner = getattr(model, "_orig_mod", model)
    before = forwards(inner)
    with pytest.raises(error, match=match):
        fit(model, [guard_without_lookup(**kwargs)], max_epochs=1)
    after = forwards(inner)
    # Lightning itself installs a compiled forward on the module passed as torch.compile(lm).
    if inner is model:
        assert after == before
    assert not any(getattr(f, "_guardtrain_target", None) for f in after.values())
    assert_restored()  # the stance and Dynamo's config


class WrappedNet(NetModule):
    """``self.net = torch.compile(self.net)`` in ``__init__`` (H8's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="eager")  # type: ignore[assignment]


def test_child_compiled_by_the_user_is_taken_over_by_default() -> None:
    """With ``targets=None`` the default rule looks through a child wrapped by
    ``torch.compile``: its original module is the target, compiled once by guardtrain
    (H29), not the LightningModule around the user's compiled net. Equal to eager."""
    L.seed_everything(0, verbose=False)
    eager = WrappedNet()
    fit(eager, max_epochs=2)
    L.seed_everything(0, verbose=False)
    model = WrappedNet()
    before = forwards(model)
    cb = guard_without_lookup()
    fit(model, [cb], max_epochs=2)
    assert cb.summary()["targets"] == ["net._orig_mod"]
    assert cb.summary()["took_over"] == ["net (torch.compile)"]
    assert len(eager.train_losses) == len(model.train_losses) > 0
    for a, b in zip(eager.train_losses, model.train_losses):
        assert torch.equal(a, b)
    assert forwards(model) == before


class NamedGuard(GuardTuneCallback):
    @property
    def state_key(self) -> str:
        return "NamedGuard"


def test_two_callbacks_on_one_target_are_refused() -> None:
    """Lightning refuses two callbacks with one state key; with distinct keys guardtrain does."""
    model = NetModule()
    with pytest.raises(RuntimeError, match="more than one stateful callback of type"):
        fit(model, [guard_without_lookup(), guard_without_lookup()], max_epochs=1)
    assert_restored(model)
    second = NamedGuard("aggressive", compile_kwargs=EAGER)
    with pytest.raises(
        GuardTrainRuntimeError,
        match="the LightningModule.s `net` is compiled by a GuardTuneCallback whose run is still going",
    ):
        fit(model, [guard_without_lookup(), second], max_epochs=1)
    assert_restored(model)


def test_unsafe_stance_set_before_fit_is_refused() -> None:
    model = NetModule()
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    try:
        with pytest.raises(GuardTrainRuntimeError, match="already set when the run starts"):
            fit(model, [guard_without_lookup()], max_epochs=1)
        assert stance_is_unsafe()  # the caller's stance is left as it was
    finally:
        torch.compiler.set_stance("default")
    assert_restored(model)
