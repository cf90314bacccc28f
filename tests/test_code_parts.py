"""Dynamo's own guard text (``GuardFilterEntry.code_parts``, torch 2.15 on) in the messages.

A re-check at a boundary or audit (a dropped or stance-skipped guard that changed,
or a floor guard that no entry passes any more) names the attribute as the user
knows it and, where torch gives it, the check Dynamo built (H36).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import lightning as L
import pytest
from helpers import TinyModule, compare, guard
from torch._dynamo.types import GuardFilterEntry

from guardtrain.compile import Assertion, guard_code, plain_attributes, user_path

HAS_CODE_PARTS = "code_parts" in {f.name for f in dataclasses.fields(GuardFilterEntry)}


def _assertion(code: str) -> Assertion:
    expr = compile("x.p", "<guard>", "eval")
    return Assertion("x.p", "value", 0.3, False, expr, "net.drop.p", code=code)


def test_guard_code_joins_the_parts() -> None:
    assert guard_code(types.SimpleNamespace(code_parts=("a == 1", "b is c"))) == "a == 1; b is c"
    assert guard_code(types.SimpleNamespace(code_parts=())) == ""
    assert guard_code(types.SimpleNamespace()) == ""  # a torch before 2.15


def test_describe_adds_dynamos_guard_when_known() -> None:
    scope = {"x": types.SimpleNamespace(p=0.0)}
    assert _assertion("").describe(scope) == "net.drop.p: 0.3 -> 0.0"
    with_code = _assertion("L['x'].p == 0.3").describe(scope)
    assert with_code == "net.drop.p: 0.3 -> 0.0 (Dynamo's guard: x.p == 0.3)"
    # Named as the user knows it, like the attribute: the target's path, no Dynamo sources.
    expr = compile("bound.__self__._modules['drop'].p", "<guard>", "eval")
    a = Assertion(
        "bound.__self__._modules['drop'].p",
        "value",
        0.3,
        False,
        expr,
        "net.drop.p",
        code="L['bound'].__self__._modules['drop'].p == 0.3",
    )
    bound = types.SimpleNamespace(__self__=types.SimpleNamespace(_modules={"drop": scope["x"]}))
    assert a.describe({"bound": bound}, "net") == (
        "net.drop.p: 0.3 -> 0.0 (Dynamo's guard: net.drop.p == 0.3)"
    )


class ChangeDropout(L.Callback):
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 2:
            pl_module.backbone[3].p = 0.0


@pytest.mark.skipif(
    not HAS_CODE_PARTS, reason="GuardFilterEntry has no code_parts before torch 2.15"
)
def test_boundary_message_names_dynamos_guard() -> None:
    cb, _ = compare(TinyModule, lambda: guard(), extra=lambda: [ChangeDropout()], max_epochs=3)
    reasons = [r["reason"] for r in cb.summary()["rearms"] if ".p: 0.3 -> 0.0" in r["reason"]]
    assert reasons, cb.summary()["rearms"]
    assert all("(Dynamo's guard: self.backbone.3.p == 0.3)" in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("bound.__self__._modules['drop'].p", "net.drop.p"),
        # torch 2.11 writes some reads through object.__getattribute__ (BERT's config, H25)
        (
            "object.__getattribute__(bound.__self__._modules['model'].config, 'problem_type')"
            " is None",
            "net.model.config.problem_type is None",
        ),
        (
            'object.__getattribute__(object.__getattribute__(bound.__self__, "a"), "b")',
            "net.a.b",
        ),
    ],
)
def test_user_path_names_attributes_as_the_user_knows_them(source: str, expected: str) -> None:
    assert user_path(source, "net") == expected


def test_plain_attributes_reads_getattribute_as_an_attribute() -> None:
    """torch 2.11/2.12 name BERT's config.problem_type through object.__getattribute__: the
    guard is recorded (and re-checked at boundaries) under the plain expression."""
    source = "object.__getattribute__(bound.__self__.config, 'problem_type')"
    assert plain_attributes(source) == "bound.__self__.config.problem_type"
    assert plain_attributes("bound.__self__.p") == "bound.__self__.p"
