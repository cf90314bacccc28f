"""A target handed over to full guards for the rest of the run (H51).

* The decisions, on plain values: a rebuild that would compile more entries again than
  the compile margin allows (:func:`~guardtrain.engine.handover.rebuild_over`), and which
  targets' checks cost more than the guard time saved
  (:func:`~guardtrain.engine.handover.checks_over`).
* Checks that cost more than they save: a module attribute that is assigned a new list
  on every step (not a flip: a list is no plain value) makes every call take the general
  check before it (fingerprint, assertions, re-watch), which on a small model outweighs
  the guards the stance skips. When the checks outweigh them in two cost windows in a
  row (a one-off check, the first of a state, falls in one alone), the target is handed
  over: its calls run with full guards, with no per-call check of guardtrain's,
  eager-equal throughout, and the summary says why.
* The decisions read counts, never a clock: the same runs with every clock of the
  process made ten times slower decide the same.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
from helpers import assert_restored, guard_tuner
from torch import nn

from guardtrain.engine.changes import Action, Change, Found
from guardtrain.engine.handover import (
    CHECK_WEIGHT,
    CHECK_WINDOW,
    COMPILE_MARGIN,
    Ledger,
    checks_over,
    rebuild_over,
)

STEPS = 96


def test_a_rebuild_past_the_compile_margin_is_not_made() -> None:
    """A rebuild is made while the margin holds it and a hand-over of as many entries."""
    half = COMPILE_MARGIN // 2
    assert rebuild_over(rebuilds=0, spent=0, dropping=0) is None  # nothing compiled yet
    assert rebuild_over(rebuilds=0, spent=0, dropping=half) is None
    assert rebuild_over(rebuilds=0, spent=0, dropping=half + 1) == (
        f"a rebuild and a hand-over would compile its {half + 1} entries twice, past the "
        f"margin of {COMPILE_MARGIN} compiles above plain compile"
    )
    assert rebuild_over(rebuilds=3, spent=COMPILE_MARGIN - 2, dropping=1) is None
    over = rebuild_over(rebuilds=2, spent=COMPILE_MARGIN - 1, dropping=1)
    assert over is not None and over.startswith(
        f"rebuilt 2 times for changes, compiling {COMPILE_MARGIN - 1} entries again; "
        "one more rebuild and a hand-over would compile 2 more"
    ), over


def test_the_ledger_counts_rebuilds_and_what_they_dropped() -> None:
    hook = Found(Action.REBUILD, Change.HOOKS, "a forward hook was added to 'embed'", "embed")
    replaced = Found(Action.REBUILD, Change.PARAMETERS, "parameter 'w' was replaced")
    ledger = Ledger()
    assert ledger.rebuilt("net", hook, dropping=1) is None
    ledger.dropped("net", 1)  # the rebuild, made
    assert ledger.rebuilt("net", hook, dropping=1) is None
    ledger.dropped("net", 1)
    assert ledger.rebuilt("net", replaced, dropping=2) is not None
    assert (ledger.rebuilds["net"], ledger.spent["net"]) == (2, 2)
    assert ledger.repeated("net") == hook  # a record: whose hooks, not words
    assert ledger.repeated("other") is None


def test_checks_over_weighs_the_checks_rows_against_the_guards_skipped() -> None:
    """Counts only: each target's general checks in a window, times the fingerprint rows
    each walks (weighed by CHECK_WEIGHT) and the assertions it evaluates (one guard each),
    against the window's steady batches times the guards plain compile evaluates for a
    call."""
    assert checks_over({}, 32, {}) == []
    rare = (1, 12, 0)  # one check in the window: a change, not a recurring cost
    every = (32, 12, 0)  # a check before every call
    assert checks_over({"a": rare, "b": every}, 32, {"a": 60, "b": 60}) == ["b"]
    assert checks_over({"a": every}, 32, {"a": 12 * CHECK_WEIGHT}) == []  # as many: not over
    assert checks_over({"a": every}, 32, {"a": 12 * CHECK_WEIGHT - 1}) == ["a"]
    assert checks_over({"a": (32, 0, 60)}, 32, {"a": 60}) == []  # an assertion: one guard
    assert checks_over({"a": (32, 0, 61)}, 32, {"a": 60}) == ["a"]
    assert checks_over({"a": (0, 50, 9)}, 32, {}) == []  # no check: nothing to weigh
    assert checks_over({"a": rare}, 32, {}) == ["a"]  # no guard skipped: any check costs
    # TRL's GRPO (one check in a window of 32 model calls, a tiny Llama: 15 fingerprint
    # rows, 2235 assertions of its 20 compiles, 663 guards a call under plain compile):
    # the check costs far less than what the window's calls skipped.
    assert checks_over({"grpo": (1, 15, 2235)}, 32, {"grpo": 663}) == []


def test_only_checks_over_in_two_windows_in_a_row_hand_over() -> None:
    ledger = Ledger()
    assert ledger.over_again(["a", "b"]) == []  # a first window over: maybe one-off checks
    assert ledger.over_again(["b", "c"]) == ["b"]
    assert ledger.over_again([]) == []
    assert ledger.over_again(["c"]) == []  # not in the window just before
    ledger.restart(compiles=3)  # a compile: the windows start again
    assert (ledger.window_start, ledger.compiles, ledger.over) == (None, 3, set())
    assert ledger.over_again(["c"]) == []


class Offsets(nn.Module):
    """Reads a list attribute that the loop replaces on every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
        self.offsets = [0.5]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + self.offsets[0]


def train(
    model: nn.Module,
    data: list[torch.Tensor],
    change: Callable[[], None],
    preset: str | None,
    **kwargs: Any,
) -> tuple[list[torch.Tensor], dict[str, Any] | None]:
    """SGD steps on ``data`` with ``change()`` before each, under ``preset`` (None: eager);
    the outputs, and the summary."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outs: list[torch.Tensor] = []
    tuner = guard_tuner(model, preset, audit_every=None, **kwargs) if preset else None
    with tuner if tuner is not None else torch.enable_grad():
        for x in data:
            change()
            with tuner.step((x,)) if tuner is not None else torch.enable_grad():
                out = model(x)
                out.square().mean().backward()
                opt.step()
                opt.zero_grad()
            outs.append(out.detach().clone())
    return outs, tuner.summary() if tuner is not None else None


def run(preset: str | None) -> tuple[list[torch.Tensor], dict[str, Any] | None]:
    model = Offsets()
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, generator=g) for _ in range(STEPS)]

    def new_list() -> None:
        model.offsets = [0.5]  # a new list, equal: every call checks again

    return train(model, data, new_list, preset)


@pytest.mark.parametrize("preset", ["balanced", "aggressive"])
def test_checks_that_cost_more_than_they_save_hand_the_target_over(preset: str) -> None:
    eager, _ = run(None)
    got, s = run(preset)
    assert s is not None
    assert all(torch.equal(a, b) for a, b in zip(eager, got)), "outputs differ from eager"
    assert s["full_guard_targets"], s["caught_changes"]
    (handed,) = s["full_guard_targets"]
    assert handed["target"] == "<model>"
    assert re.match(
        rf"its checks before calls \({CHECK_WINDOW} in {CHECK_WINDOW} steady batches, \d+ rows "
        r"each\) outweigh the \d+ guards a call skips in the steady state",
        handed["why"],
    ), handed
    # Handed over after the second cost window after the lookup windows: from then on
    # the stance is off for good (every target has full guards), with no re-arm per step.
    assert s["stance_blocked"] and "full guards" in s["stance_blocked"], s["stance_blocked"]
    assert len(s["rearms"]) <= 2, s["rearms"]
    assert 2 * CHECK_WINDOW < STEPS
    assert_restored()


# -- a default target rebuilt too often is split first ---------------------------------------


class HookedEmbedding(nn.Module):
    """An embedding, then blocks; the loop adds a forward hook on the embedding every step,
    as TRL's gradient-checkpointing switch does (H47)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x))


def _scale(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 1.0


def run_hooked(preset: str | None, steps: int = 24, **kwargs: Any) -> tuple[list[Any], Any]:
    model = HookedEmbedding()
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 16, (4, 5), generator=g) for _ in range(steps)]

    def hook() -> None:
        model.embed.register_forward_hook(_scale)  # one more every step, never removed

    return train(model, data, hook, preset, **kwargs)


@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
def test_a_default_target_rebuilt_too_often_hands_over_only_its_changing_part(
    preset: str,
) -> None:
    """The hook on ``embed`` rebuilds the whole model every step (one entry each time);
    once one more rebuild would go past the compile margin the model is split into its
    parts and ``embed`` alone, whose hooks keep changing, is handed over: the blocks run
    steady. Every output equal to eager's."""
    eager, _ = run_hooked(None)
    # One entry a rebuild: rebuilt while the margin holds one more and the hand-over.
    times = COMPILE_MARGIN - 1
    rebuilt = rf"'<model>' was rebuilt {times} times for changes, .* its parts instead"
    with pytest.warns(UserWarning, match=rebuilt):
        got, s = run_hooked(preset)
    assert all(torch.equal(a, b) for a, b in zip(eager, got, strict=True)), "differ from eager"
    (handed,) = s["full_guard_targets"]
    assert handed["target"] == "embed", handed
    assert "a forward hook was added to 'embed'" in handed["change"], handed
    assert s["targets"] == ["embed", "blocks"], s["targets"]
    assert s["phase"] == "steady" and s["steady_steps"] >= 8, (s["steady_steps"], s["rearms"])
    assert_restored()


def test_targets_given_are_handed_over_whole() -> None:
    """With ``targets=`` the user chose the regions: no split, the target is handed over;
    every output equal to eager's."""
    eager, _ = run_hooked(None, steps=12)
    with pytest.warns(UserWarning, match="runs with full guards for the rest of the run"):
        got, s = run_hooked("aggressive", steps=12, targets=[""])
    assert all(torch.equal(a, b) for a, b in zip(eager, got, strict=True)), "differ from eager"
    (handed,) = s["full_guard_targets"]
    assert handed["target"] == "<model>", handed
    assert s["targets"] == ["<model>"], s["targets"]
    assert_restored()


# -- decisions from counts, never from clocks ------------------------------------------------


def _decisions(s: dict[str, Any]) -> dict[str, Any]:
    """What a run decided: re-arms, hand-overs, targets, compiles, the steady steps."""
    return {
        "rearms": [(r["step"], r["reason"]) for r in s["rearms"]],
        "full_guard_targets": s["full_guard_targets"],
        "targets": s["targets"],
        "compiles": s["compiles_by_target"],
        "compiled_again": s["compiled_again"],
        "steady_steps": s["steady_steps"],
        "caught_changes": s["caught_changes"],
    }


def test_a_slowed_clock_takes_the_same_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks' hand-over (the Offsets run) and the compile margin (a hook added every
    step), each run again with every clock the process reads made ten times slower:
    every decision is the same."""
    import time

    original = time.perf_counter
    normal = [_decisions(run("aggressive")[1]), _decisions(run_hooked("turbo")[1])]
    for name in (
        "perf_counter",
        "perf_counter_ns",
        "monotonic",
        "monotonic_ns",
        "time",
        "time_ns",
        "thread_time",
        "thread_time_ns",
        "process_time",
        "process_time_ns",
    ):
        clock = getattr(time, name)
        monkeypatch.setattr(time, name, lambda clock=clock: clock() * 10)
    slowed = [_decisions(run("aggressive")[1]), _decisions(run_hooked("turbo")[1])]
    assert time.perf_counter() >= 9 * original()  # every read of the clock is ten times on
    assert slowed == normal
    assert normal[0]["full_guard_targets"] and normal[1]["full_guard_targets"], normal
