"""Audits and verify batches: changes inside an epoch that no per-batch or per-call check
can see. The change here is one the change tracking cannot see (H33): an attribute read
in ``forward``, written with ``object.__setattr__`` (no ``nn.Module.__setattr__`` event,
and a module's dictionary is not polled)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import TinyModule, assert_same_run, fit, guard
from torch import nn

from guardtrain import GuardTuneCallback

CHANGE_AT = 10


class Gain(L.LightningModule):
    """Checks every compiled output against the plain forward on the same input.

    Not :class:`helpers.NetModule`: the second, plain forward of each batch must give
    the same output, so the network has no Dropout (another mask) and no BatchNorm
    (batch statistics updated twice), and it reads ``self.gain``: Dynamo guards its
    value, the stance skips that guard, and ``object.__setattr__`` passes no
    ``nn.Module.__setattr__`` (out of reach between checks, H33).
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.matches: list[bool] = []
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.gain

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        with torch.no_grad():
            ref = type(self).forward(self, x)
        self.matches.append(torch.equal(out.detach(), ref))
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SetGain(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        object.__setattr__(pl_module, "gain", 2.0 if trainer.global_step >= CHANGE_AT else 1.0)


def run(**kwargs: Any) -> tuple[Gain, GuardTuneCallback]:
    model = Gain()
    cb = guard(targets=[""], **kwargs)
    fit(model, [cb, SetGain()], data={"n_train": 16 * 30}, max_epochs=1, limit_val_batches=0)
    return model, cb


def stale_steps(model: Gain) -> list[int]:
    return [i for i, ok in enumerate(model.matches) if not ok]


def test_without_audits_the_stance_stays_stale() -> None:
    """What the audits are for: nothing else notices the attribute changed."""
    model, cb = run(audit_every=None)
    assert cb.summary()["steady_steps"] > CHANGE_AT
    assert stale_steps(model) == list(range(CHANGE_AT, 30))


def test_audit_batch_catches_an_attribute_written_past_setattr() -> None:
    model, cb = run(audit_every=4)
    stale = stale_steps(model)
    assert len(stale) <= 4 and all(i >= CHANGE_AT for i in stale), stale
    assert model.matches[-10:] == [True] * 10
    reasons = [r["reason"] for r in cb.summary()["rearms"]]
    # The audit's re-check of the recorded guards names the item (the audit batch with
    # full guards would compile for it too).
    assert any("self.gain: 1.0 -> 2.0" in r for r in reasons), reasons


def test_verify_batch_catches_a_difference_from_eager() -> None:
    with pytest.warns(UserWarning, match="verify: compiled '<LightningModule>' differs from eager"):
        model, cb = run(audit_every=None, verify_every=3)
    stale = stale_steps(model)
    assert len(stale) <= 4 and all(i >= CHANGE_AT for i in stale), stale
    assert model.matches[-10:] == [True] * 10
    reasons = [r["reason"] for r in cb.summary()["rearms"]]
    assert any("verify found a difference from eager" in r for r in reasons), reasons


def test_verify_leaves_training_unchanged() -> None:
    """A verify batch restores RNG and buffers: the run equals one without verification."""
    L.seed_everything(0, verbose=False)
    plain = TinyModule()
    fit(plain, [guard()])
    L.seed_everything(0, verbose=False)
    verified = TinyModule()
    cb = guard(verify_every=1)
    fit(verified, [cb])
    assert_same_run(plain, verified)
    assert not [r for r in cb.summary()["rearms"] if "verify" in r["reason"]]


# -- an audit batch with new shapes (H26) ----------------------------------------------------


class Scaled(nn.Module):
    """Two layers and a ``gain`` read in ``forward``: Dynamo guards its value, the stance
    skips that guard, and ``object.__setattr__`` passes no event (H33)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.gain


#: 16 rows, but 12 at the audit (batch 8): a batch size that no entry accepts (dim 0 static).
ROWS = [16] * 8 + [12] + [16] * 7


def audited(preset: str, gain_after: int | None = None) -> tuple[Any, list[bool], list[bool]]:
    """Steps of ``ROWS`` with ``audit_every=8``; ``gain`` becomes 2.0 (past ``__setattr__``)
    after step ``gain_after``. Returns the tuner, the stance per step, and per step whether
    the output equals the plain ``forward``'s."""
    from helpers import guard_tuner, stance_on

    torch.manual_seed(0)
    net = Scaled()
    g = torch.Generator().manual_seed(1)
    stance, equal = [], []
    with guard_tuner(net, preset, warmup_steps=4, audit_every=8, measure_lookup=False) as tuner:
        for i, rows in enumerate(ROWS):
            x = torch.randn(rows, 8, generator=g)
            with tuner.step((x,)):
                out = net(x)
                stance.append(stance_on())
            equal.append(torch.equal(out, Scaled.forward(net, x)))
            if i == gain_after:
                object.__setattr__(net, "gain", 2.0)
    return tuner, stance, equal


@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
def test_an_audit_batch_with_new_shapes_compiles_for_them_and_stays_steady(preset: str) -> None:
    """The audit batch (8) is the first with 12 rows: it compiles with full guards for its
    new inputs, which says nothing of the entries the stance ran, so no re-arm; the next
    batch with a seen signature (9) is the audit's batch with full guards instead."""
    tuner, stance, equal = audited(preset)
    assert all(equal), equal
    s = tuner.summary()
    assert s["rearms"] == [] and s["compiles"] == 2, (s["rearms"], s["compile_events"])
    assert "size mismatch at index 0" in s["compile_events"][-1]["reason"]
    assert stance == [False] * 4 + [True] * 4 + [False, False] + [True] * 6, stance


def test_the_audit_repeated_after_new_shapes_finds_a_stale_entry() -> None:
    """``gain`` changes (past ``__setattr__``) after the audit batch that compiled for its
    new shapes (8): the audit's batch with full guards, repeated at the next seen
    signature (9), compiles for the new value and re-arms with the audit's reason.
    ``balanced`` keeps the guard on ``gain``; eager-equal at every step."""
    tuner, stance, equal = audited("balanced", gain_after=8)
    assert all(equal), equal
    reasons = [(r["step"], r["reason"]) for r in tuner.summary()["rearms"]]
    assert len(reasons) == 1 and reasons[0][0] == 9, reasons
    assert reasons[0][1].startswith("audit batch compiled with full guards"), reasons
    assert "gain" in reasons[0][1], reasons
    assert stance[9] is False and stance[-1] is True, stance
