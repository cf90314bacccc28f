"""What guardtrain cannot tell, it treats as unsafe: the guard filter keeps every guard when
it cannot tell which frame compiles, and only a module's ``training`` flag counts as one."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from helpers import guard_tuner
from torch import nn

import guardtrain.compile.code as code_module

AOT = {"backend": "aot_eager"}


class Tempered(nn.Module):
    """Linear -> Dropout -> times ``temperature`` (a float read in ``forward``) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 1)
        self.temperature = 1.0
        self.training_frac = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.training_frac  # read before `drop.training`: its guard comes first
        h = self.drop(torch.relu(self.lin(x))) * self.temperature
        return self.out(h)


def test_the_filter_keeps_every_guard_when_the_compiling_frame_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch that lays out Dynamo's ``_compile`` otherwise: ``compiling_frame()`` finds no
    frame, and the filter must not drop guards for whatever frame compiles (resume frames
    included), so every compile keeps all of them."""
    monkeypatch.setattr(code_module, "compiling_frame", lambda: (None, None))
    kept: list[list[bool]] = []
    track = code_module.TargetCode._track

    def spy(self: Any, entries: Any) -> list[bool]:
        keep = track(self, entries)
        kept.append(list(keep))
        return keep

    monkeypatch.setattr(code_module.TargetCode, "_track", spy)
    model = Tempered()
    x = torch.randn(4, 8)
    with guard_tuner(model, "aggressive", compile_kwargs=AOT) as tuner:
        for _ in range(6):
            with tuner.step((x,)):
                model(x).sum().backward()
    assert kept, "nothing compiled"
    assert all(all(keep) for keep in kept), [keep.count(False) for keep in kept]


@pytest.mark.parametrize("preset", ["aggressive", "turbo", "auto"])
def test_an_attribute_named_training_something_is_not_the_training_flag(preset: str) -> None:
    """A recompile for ``self.training_frac`` is no failed ``.training`` guard. Training
    calls compile one entry; eval calls with another ``training_frac`` compile a second,
    whose recompile reason names only ``.training_frac``; then training calls with that
    value come under the stance: the stance evaluates ``training_frac`` (it failed once)
    but not ``training``, so it must not serve them, or they run the eval entry (no
    dropout)."""
    torch.manual_seed(0)
    eager = Tempered()
    guarded = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(4, 8, generator=g) for _ in range(16)]

    def run(model: Tempered, step: Any) -> list[torch.Tensor]:
        outs = []
        torch.manual_seed(1)
        for i, x in enumerate(batches):
            if i == 5:
                model.training_frac = 0.25
            evaluating = 5 <= i < 10
            with step((x,)):
                model.train(not evaluating)
                out = model(x)
                if not evaluating:
                    out.sum().backward()
            outs.append(out.detach().clone())
        model.train()
        return outs

    served: list[tuple[str, int]] = []
    note_mode = code_module.TargetCode._note_mode

    def spy(self: Any, mode: Any, reason: str | None) -> None:
        note_mode(self, mode, reason)
        if reason is not None and ".training_frac" in reason:
            # Two modes that differ in `training` alone, neither told apart by a guard
            # that failed: the stance may serve neither.
            served.append((reason.splitlines()[0], len(self.stance_modes)))

    expected = run(eager, lambda batch: contextlib.nullcontext())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(code_module.TargetCode, "_note_mode", spy)
        with guard_tuner(guarded, preset, compile_kwargs=AOT) as tuner:
            got = run(guarded, tuner.step)
            steady = tuner.summary()["steady_steps"]
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"call {i}: eager {a.flatten()} vs {b.flatten()}"
    assert steady > 0
    assert served and all(n == 0 for _, n in served), served
