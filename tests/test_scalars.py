"""Scalar attributes read in `forward` join the soundness floor (H19).

Under the stance every guard is skipped, kept or not (H1): a scalar that first
changes there is caught at the next audit or boundary, and the training batches
in between run the old value (README, "Known limits"). The tests below pin down
which batch catches it and that the run equals eager around that window.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    PhaseSpy,
    TinyModule,
    assert_same_run,
    compare,
    fit,
    guard,
    guard_without_lookup,
    without_dynamos_guard,
)

from guardtrain import PRESETS

#: The presets that enter the stance, where guards are skipped.
STANCE_PRESETS = [name for name, preset in PRESETS.items() if preset.use_stance]


class Tempered(TinyModule):
    """Divides the output by ``self.temperature``, a float changed every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)) / self.temperature


class Anneal(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        pl_module.temperature = 1.0 + 0.1 * trainer.global_step


@pytest.mark.parametrize("preset", ["off", "safe", "balanced", "aggressive", "turbo"])
def test_an_annealed_temperature_matches_eager(preset: str) -> None:
    """The float changes every step; no preset runs a stale constant."""
    cb, _ = compare(Tempered, lambda: guard(preset), extra=lambda: [Anneal()])
    s = cb.summary()
    if preset in ("balanced", "aggressive", "turbo"):
        # After one recompile Dynamo reads the float as an input: the stance is safe.
        assert s["steady_steps"] > 0


class Step(L.Callback):
    """Changes the temperature once, at the start of epoch 2 (a boundary)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 2:
            pl_module.temperature = 2.0


def test_a_scalar_changed_at_a_boundary_is_seen() -> None:
    cb, _ = compare(Tempered, lambda: guard("aggressive"), extra=lambda: [Step()], max_epochs=3)
    texts = [r["reason"] for r in cb.summary()["rearms"]] + [
        e["reason"] for e in cb.summary()["compile_events"]
    ]
    assert any("temperature" in t for t in texts), texts


# -- a scalar that first changes under the stance (H1, H19) ----------------------------------


class Scalars(TinyModule):
    """Reads a float, an int, a bool and a str attribute in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0
        self.repeats = 1
        self.scaled = False
        self.activation = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        for _ in range(self.repeats):
            h = h * 0.9
        if self.scaled:
            h = h * 2.0
        if self.activation == "tanh":
            h = torch.tanh(h)
        return self.head(h) / self.temperature


#: kind -> (attribute, old value, new value)
CHANGES = {
    "float": ("temperature", 1.0, 2.0),
    "int": ("repeats", 1, 2),
    "bool": ("scaled", False, True),
    "str": ("activation", "relu", "tanh"),
}

#: 8 training batches of 16 per epoch, 3 epochs: global steps 0..23. With the tests'
#: warm-up (3 steps, 2 stable) training runs under the stance from step 3 on.
DATA = {"n_train": 128}
NO_VAL = {"limit_val_batches": 0}


class Change(L.Callback):
    """Sets one attribute from ``old`` to ``new`` at training step ``at``.

    The change happens in ``on_train_batch_start``, after guardtrain's own hook,
    so batch ``at`` already runs under the stance. Validation sees ``new`` from
    step ``at`` on.

    With ``stale_until=c`` this is the eager reference of a guarded run that
    caught the change at step ``c``: training batches ``at`` to ``c - 1`` still
    see ``old``, as the stale compiled code did.
    """

    def __init__(
        self, name: str, old: Any, new: Any, at: int, stale_until: int | None = None
    ) -> None:
        self.name, self.old, self.new, self.at = name, old, new, at
        self.start = at if stale_until is None else stale_until

    def _set(self, module: Any, value: Any) -> None:
        if getattr(module, self.name) != value:  # only real changes touch the module
            setattr(module, self.name, value)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self._set(pl_module, self.new if trainer.global_step >= self.start else self.old)

    def on_validation_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._set(pl_module, self.new if trainer.global_step >= self.at else self.old)


_EAGER_RUNS: dict[tuple[Any, ...], Scalars] = {}


def eager_run(kind: str, at: int, stale_until: int | None, **fit_kwargs: Any) -> Scalars:
    """An uncompiled run with :class:`Change`; kept for the next test (each preset needs it)."""
    key = (kind, at, stale_until, tuple(sorted(fit_kwargs.items())))
    if key not in _EAGER_RUNS:
        L.seed_everything(0, verbose=False)
        model = Scalars()
        fit(model, [Change(*CHANGES[kind], at, stale_until=stale_until)], data=DATA, **fit_kwargs)
        _EAGER_RUNS[key] = model
    return _EAGER_RUNS[key]


def changed_under_the_stance(
    preset: str, kind: str, at: int, catch: int, audit_every: int | None, **fit_kwargs: Any
) -> tuple[Any, PhaseSpy]:
    """Run eager and guarded with ``kind``'s attribute changed at step ``at``; assert the catch.

    Asserts that the guarded run equals, bitwise, an eager run whose training
    batches ``at`` to ``catch - 1`` still see the old value, and that a plain
    eager run (the change seen at once) differs from step ``at`` on. Returns the
    callback and the phase spy.
    """
    name, old, new = CHANGES[kind]
    plain = eager_run(kind, at, None, **fit_kwargs)
    stale = eager_run(kind, at, catch, **fit_kwargs)
    L.seed_everything(0, verbose=False)
    guarded = Scalars()
    cb = guard_without_lookup(preset, audit_every=audit_every)
    spy = PhaseSpy(cb)
    fit(guarded, [cb, spy, Change(name, old, new, at)], data=DATA, **fit_kwargs)
    assert getattr(guarded, name) == new
    assert_same_run(stale, guarded)
    same = [torch.equal(a, b) for a, b in zip(plain.train_losses, guarded.train_losses)]
    if catch > at:
        # The documented limit: the stale batches ran the old constant, not what eager computes.
        assert same.index(False) == at, same
    else:
        assert all(same), same
    return cb, spy


def assert_caught(
    cb: Any,
    spy: PhaseSpy,
    kind: str,
    at: int,
    catch: int,
    audit_batch: bool = False,
    mid_batch: bool = False,
) -> None:
    """One re-arm and one recompile, both at step ``catch`` and naming the attribute."""
    name = CHANGES[kind][0]
    s = cb.summary()
    assert [r["step"] for r in s["rearms"]] == [catch], s["rearms"]
    (rearm,) = s["rearms"]
    assert rearm["loop"] == "train"
    if audit_batch:
        assert rearm["reason"].startswith("audit batch compiled with full guards"), rearm
        assert f"self.{name} ==" in rearm["reason"], rearm
    else:
        old, new = CHANGES[kind][1:]
        reason = without_dynamos_guard(rearm["reason"], f"self.{name}")
        assert reason == f"<LightningModule>: self.{name}: {old!r} -> {new!r}", rearm
    assert [e["step"] for e in s["compile_events"]] == [0, catch], s["compile_events"]
    assert f"self.{name} ==" in s["compile_events"][1]["reason"], s["compile_events"]
    # Steady from step 3; the changed value ran under the stance until the catch. An
    # audit batch runs with full guards in the steady phase and re-arms at its end.
    assert set(spy.phases[3:catch]) == {"steady"}, spy.phases
    # Caught before a call (mid_batch): the batch began under the stance, as a spy sees it.
    rewarm = catch + 1 if audit_batch or mid_batch else catch
    assert spy.phases[catch:rewarm] == ["steady"] * (rewarm - catch), spy.phases
    assert spy.phases[rewarm : catch + 3] == ["warmup"] * (catch + 3 - rewarm), spy.phases
    assert set(spy.phases[catch + 3 :]) == {"steady"}, spy.phases


@pytest.mark.parametrize("audit_every", [4, None], ids=["audits", "no-audits"])
@pytest.mark.parametrize("kind", list(CHANGES))
@pytest.mark.parametrize("preset", STANCE_PRESETS)
def test_a_scalar_first_changed_under_the_stance_is_caught_before_the_next_call(
    preset: str, kind: str, audit_every: int | None
) -> None:
    """Changed at step 10 (epoch 1, third batch), under the stance, with or without audits.

    The assignment marks the target (H33); before the step's call guardtrain
    re-checks the recorded guards, finds the kept value guard failing and leaves
    the stance, so the call recompiles with full guards: every batch equals eager.
    """
    cb, spy = changed_under_the_stance(
        preset, kind, at=10, catch=10, audit_every=audit_every, **NO_VAL
    )
    assert_caught(cb, spy, kind, at=10, catch=10, mid_batch=True)
    assert cb.summary()["caught_changes"]["module_state"]["count"] == 1


@pytest.mark.parametrize("preset", STANCE_PRESETS)
def test_a_scalar_changed_in_an_audit_batch_runs_the_new_value_at_once(preset: str) -> None:
    """Changed at step 12, an audit batch: it runs with full guards, so nothing is stale.

    The audit batch recompiles (the kept value guard fails) and re-arms with
    that compile's reason; every batch equals eager.
    """
    cb, spy = changed_under_the_stance(preset, "float", at=12, catch=12, audit_every=4, **NO_VAL)
    assert_caught(cb, spy, "float", at=12, catch=12, audit_batch=True)


@pytest.mark.parametrize("preset", STANCE_PRESETS)
def test_with_validation_a_scalar_changed_under_the_stance_is_caught_before_the_next_call(
    preset: str,
) -> None:
    """As above, with a validation pass after each epoch: the training call at step 10
    leaves the stance and recompiles; every training and validation loss equals eager's."""
    cb, spy = changed_under_the_stance(preset, "float", at=10, catch=10, audit_every=None)
    s = cb.summary()
    assert [(r["step"], r["loop"]) for r in s["rearms"]] == [(10, "train")], s["rearms"]
    assert set(spy.phases[3:11]) == {"steady"}, spy.phases  # batch 10 began under it
    assert spy.phases[11:13] == ["warmup"] * 2, spy.phases


def test_with_validation_the_rearm_names_the_changed_scalar() -> None:
    """With a validation entry too, the re-arm names the scalar, not `.training`."""
    cb, _ = changed_under_the_stance("aggressive", "float", at=10, catch=10, audit_every=None)
    (rearm,) = cb.summary()["rearms"]
    reason = without_dynamos_guard(rearm["reason"], "self.temperature")
    assert reason == "<LightningModule>: self.temperature: 1.0 -> 2.0", rearm


@pytest.mark.parametrize("preset", STANCE_PRESETS)
def test_a_scalar_changed_in_the_last_epoch_is_caught_before_the_next_call(
    preset: str,
) -> None:
    """Changed at step 18 (epoch 2), no audits and no training boundary after it: the
    call at step 18 leaves the stance and recompiles; everything equals eager."""
    cb, _ = changed_under_the_stance(preset, "float", at=18, catch=18, audit_every=None)
    s = cb.summary()
    assert [(r["step"], r["loop"]) for r in s["rearms"]][0] == (18, "train"), s["rearms"]
    reason = without_dynamos_guard(s["rearms"][0]["reason"], "self.temperature")
    assert reason == "<LightningModule>: self.temperature: 1.0 -> 2.0", s["rearms"]
