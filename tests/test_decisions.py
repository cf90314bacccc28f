"""The engine's pure decisions (``guardtrain/engine/decisions.py``): plain values in and out."""

from __future__ import annotations

import pytest

from guardtrain.engine import decisions


def test_next_and_due_checks() -> None:
    assert decisions.next_check(0, 4, None) == 4
    assert decisions.next_check(4, 4, 6) == 6
    assert decisions.next_check(7, None, None) == 1 << 62
    assert decisions.due_check(0, 4, 2) is None  # never before the first batch
    assert decisions.due_check(4, 4, 2) == decisions.CHECK_AUDIT  # an audit wins
    assert decisions.due_check(6, 4, 2) == decisions.CHECK_VERIFY
    assert decisions.due_check(5, 4, 2) is None
    assert decisions.due_check(8, None, None) is None


def test_audit_verdict() -> None:
    """H26: a compile in an audit batch with an unseen signature is for its new inputs."""
    assert decisions.audit_verdict(False, False) == decisions.AUDIT_CLEAN
    assert decisions.audit_verdict(False, True) == decisions.AUDIT_CLEAN
    assert decisions.audit_verdict(True, False) == decisions.AUDIT_REARM
    assert decisions.audit_verdict(True, True) == decisions.AUDIT_AGAIN
    # A compile that leaves a target unfit for the stance re-arms as before (H4, H5, H20).
    assert decisions.audit_verdict(True, True, "target 'net' has graph breaks") == (
        decisions.AUDIT_REARM
    )


def test_leave_reason() -> None:
    assert decisions.leave_reason("train", None, True) is None
    assert decisions.leave_reason("validate", None, False) is None
    assert decisions.leave_reason("train", "(4, 8) float32 cpu", True) == (
        "unseen batch signature (4, 8) float32 cpu"
    )
    assert decisions.leave_reason("train", None, False) == (
        "module.training is False in the train loop"
    )
    assert decisions.leave_reason("validate", None, True) == (
        "module.training is True in the validate loop"
    )
    # A plain loop compares with the flag the loop warmed up with.
    assert decisions.leave_reason("validate", None, True, warmed_training=True) is None
    assert decisions.leave_reason("train", None, True, warmed_training=False) is not None


class FakeTarget:
    def __init__(
        self, name: str, calls: int, breaks: bool, entries: int, mixed: bool = False
    ) -> None:
        self.name, self.calls, self.graph_breaks, self._entries = name, calls, breaks, entries
        self.mixed = mixed

    def cache_entries(self) -> int:
        return self._entries


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        ([FakeTarget("a", 3, False, 1)], None),
        ([FakeTarget("a", 3, False, 0)], "no target has compiled code"),
        ([FakeTarget("a", 3, False, 1), FakeTarget("b", 2, False, 0)], "'b' ran uncompiled"),
        ([FakeTarget("a", 3, False, 1), FakeTarget("b", 0, False, 0)], None),  # never called
        ([FakeTarget("a", 3, True, 2)], "'a' has graph breaks"),
        ([FakeTarget("a", 3, True, 2, mixed=True)], None),  # broken entries: full guards
        ([FakeTarget("", 3, False, 8)], None),  # at the recompile limit: misses run eagerly
        ([], None),
    ],
)
def test_blocker(targets: list[FakeTarget], expected: str | None) -> None:
    got = decisions.blocker(targets)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got


@pytest.mark.parametrize(
    ("unseen", "training", "warmed", "paired", "expected"),
    [
        (None, True, None, False, (None, None, False)),  # the usual steady batch
        ("(x: 4)", True, None, False, (None, "(x: 4)", False)),  # stays, checks its calls (H26)
        ("(x: 4)", True, None, True, ("unseen batch signature (x: 4)", None, True)),  # a probe
        (None, False, None, False, ("module.training is False in the train loop", None, False)),
        # Another mode leaves the stance, whatever the signature (no probe).
        ("(x: 4)", False, None, True, ("module.training is False in the train loop", None, False)),
        (None, False, False, False, (None, None, False)),  # a plain loop warmed in eval
    ],
)
def test_steady_batch(
    unseen: str | None,
    training: bool,
    warmed: bool | None,
    paired: bool,
    expected: tuple[str | None, str | None, bool],
) -> None:
    assert decisions.steady_batch("train", unseen, training, warmed, paired) == expected
