"""The per-batch fast path: ``SameSignature`` recognises a batch with the previous batch's
signature without reading its tensors' metadata in Python, and never loses a check."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from torch import nn

from guardtrain import GuardTuner
from guardtrain.signatures import SameSignature, batch_signature


def _pair(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8), torch.randn(n, 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _pair(),
        lambda: list(_pair()),
        lambda: dict(zip(("x", "y"), _pair())),
        lambda: torch.randn(4, 3),
    ],
    ids=["tuple", "list", "dict", "tensor"],
)
def test_matches_fresh_tensors_of_the_same_signature(make: Any) -> None:
    first = make()
    same = SameSignature.of(first, batch_signature(first))
    assert same is not None
    second = make()  # new tensor objects, as from a DataLoader
    assert same.matches(second)
    assert batch_signature(second) == same.signature


def _variants() -> dict[str, Any]:
    x, y = _pair()
    return {
        "shape": (torch.randn(15, 8), y),
        "rank": (x.unsqueeze(0), y),
        "dtype": (x.double(), y),
        "device": (x.to("meta"), y),
        "requires_grad": (x.clone().requires_grad_(True), y),
        "strides": (torch.randn(8, 16).t(), y),
        "length": (x, y, y),
        "shorter": (x,),
        "list": [x, y],
        "order": (y, x),
        "non-tensor": (x, 3),
        "nested": (x, (y,)),
        "namedtuple": namedtuple("B", "x y")(x, y),
        "subclass": (x.as_subclass(nn.Parameter), y),
    }


@pytest.mark.parametrize("name", sorted(_variants()))
def test_a_match_always_has_an_equal_signature(name: str) -> None:
    """Stricter than the signature (strides, requires_grad): a batch that differs in what
    the signature holds never matches; one that differs elsewhere may fail to match."""
    base = _pair()
    same = SameSignature.of(base, batch_signature(base))
    assert same is not None
    other = _variants()[name]
    if same.matches(other):
        assert batch_signature(other) == same.signature, name
    if name in ("strides", "requires_grad"):
        assert not same.matches(other)  # stricter: compared in full then
        assert batch_signature(other) == same.signature


def test_dict_keys_and_their_order() -> None:
    x, y = _pair()
    same = SameSignature.of({"x": x, "y": y}, batch_signature({"x": x, "y": y}))
    assert same is not None
    assert same.matches({"x": torch.randn(16, 8), "y": torch.randn(16, 1)})
    assert not same.matches({"y": y, "x": x})  # another signature: key order counts
    assert not same.matches({"x": x, "z": y})
    assert not same.matches(OrderedDict(x=x, y=y))  # another type


@pytest.mark.parametrize(
    "batch",
    [
        (torch.randn(2, 2), "text"),
        (torch.randn(2, 2), (torch.randn(2),)),
        (),
        {"x": [torch.randn(2)]},
        namedtuple("B", "x")(torch.randn(2)),
        OrderedDict(x=torch.randn(2)),
        (torch.randn(2).as_subclass(nn.Parameter),),
        (torch.randn(4, 4).to_sparse(),),
        "not a batch",
    ],
)
def test_no_fast_path_for_other_batches(batch: Any) -> None:
    assert SameSignature.of(batch, batch_signature(batch)) is None


def test_equal_signatures_that_never_match_stop_remaking_it() -> None:
    """Strides that alternate: after MAX_MISSES remakes in a row the matcher is kept."""
    a = (torch.randn(8, 4), torch.randn(8, 1))
    b = (torch.randn(4, 8).t(), torch.randn(8, 1))
    signature = batch_signature(a)
    assert batch_signature(b) == signature
    same = SameSignature.of(a, signature)
    assert same is not None and same.misses == 0
    for i in range(SameSignature.MAX_MISSES):
        batch = b if i % 2 == 0 else a
        assert not same.matches(batch)
        made = SameSignature.of(batch, signature, same)
        assert made is not same and made is not None and made.misses == i + 1
        same = made
    assert SameSignature.of(b if same.matches(a) else a, signature, same) is same
    # A new signature starts counting again.
    c = (torch.randn(3, 4), torch.randn(3, 1))
    fresh = SameSignature.of(c, batch_signature(c), same)
    assert fresh is not None and fresh.misses == 0


def _steps(tuner: GuardTuner, model: nn.Module, batches: list[Any]) -> None:
    for batch in batches:
        with tuner.step(batch):
            model(batch[0]).sum().backward()


def test_steady_loop_sees_every_signature_change() -> None:
    """With the fast path, an unseen shape is still caught before the step; a batch with
    another stride but an equal signature stays in the steady state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
    with GuardTuner(
        model,
        "aggressive",
        warmup_steps=3,
        stable_steps=2,
        compile_kwargs={"backend": "eager"},
        measure_lookup=False,
        audit_every=None,
    ) as tuner:
        _steps(tuner, model, [_pair() for _ in range(6)])
        assert tuner.phase == "steady"
        engine = tuner.engine
        same = engine.run.machine.loops["train"].same
        assert (
            same is not None and same.signature is engine.run.machine.loops["train"].last_signature
        )
        _steps(tuner, model, [_pair() for _ in range(3)])
        assert tuner.phase == "steady" and engine.run.machine.loops["train"].same is same
        # Other strides (of the target, which the model does not see), the same
        # signature: compared in full, no re-arm, no check.
        other = (torch.randn(16, 8), torch.randn(1, 16).t())
        assert not same.matches(other) and batch_signature(other) == same.signature
        _steps(tuner, model, [other])
        assert tuner.phase == "steady" and not tuner.summary()["rearms"]
        assert tuner.summary()["checked_batches"] == 0
        # An unseen shape: each call is checked against the entries under the stance
        # (H26), as without the fast path; none accepts (5, 8), so the loop re-arms.
        _steps(tuner, model, [_pair(5)])
        rearms = tuner.summary()["rearms"]
        assert (
            len(rearms) == 1 and "unseen batch signature ((5, 8) float32 cpu" in rearms[0]["reason"]
        )
        # Back to the usual shape: steady again, on the fast path.
        _steps(tuner, model, [_pair() for _ in range(4)])
        assert tuner.phase == "steady" and len(tuner.summary()["rearms"]) == 1
        # A rebuilt target forgets every signature: the matcher must not survive it.
        engine._repairs.rebuild(engine.targets.installed[0], "test")
        assert engine.run.machine.loops["train"].last_signature is None
        assert engine.run.machine.loops["train"].same is not None
        _steps(tuner, model, [_pair() for _ in range(6)])
        assert tuner.phase == "steady"
        assert _pair()[0].shape in {
            s[1][0][0] for s in engine.run.machine.loops["train"].signatures
        }  # the signature was remembered again


def test_no_matcher_for_shapes_that_change_every_batch() -> None:
    """A matcher is made only when a signature repeats: varying shapes (H26) pay nothing."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    with GuardTuner(
        model, "aggressive", warmup_steps=2, stable_steps=1, compile_kwargs={"backend": "eager"}
    ) as tuner:
        engine = tuner.engine
        _steps(tuner, model, [_pair(4)])
        assert engine.run.machine.loops["train"].same is None  # seen once
        _steps(tuner, model, [_pair(4)])
        first = engine.run.machine.loops["train"].same
        assert first is not None and first.matches(_pair(4))
        for n in (5, 6, 7, 5):
            _steps(tuner, model, [_pair(n)])
            assert engine.run.machine.loops["train"].same is first  # none made for a change
        _steps(tuner, model, [_pair(5)])  # 5 twice in a row
        made = engine.run.machine.loops["train"].same
        assert made is not first and made is not None and made.matches(_pair(5))
