"""Lightning's stock callbacks that change the model, under ``auto`` and ``turbo``.

Each test runs one stock callback twice, with the same model, data and seed: once
uncompiled, once with a :class:`~guardtrain.GuardTuneCallback`. The two runs must agree
bitwise at every training and validation loss and in the final weights
(:func:`helpers.compare`). The guarded run compiles with ``aot_eager``: the ``eager``
backend follows ``requires_grad`` and autocast at run time, so it would hide an entry
that has gone stale, while ``aot_eager`` traces them into the graph. ``aot_eager`` is
bitwise equal to eager, dropout included, so the comparison is exact.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    TinyModule,
    assert_same_run,
    compare,
    first_then_slow,
    guard,
    loaders,
    make_trainer,
)
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BatchSizeFinder,
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelPruning,
    StochasticWeightAveraging,
)

try:  # Lightning >= 2.6
    from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
except ImportError:  # pragma: no cover - older Lightning
    EMAWeightAveraging = WeightAveraging = None  # type: ignore[assignment,misc]

needs_weight_averaging = pytest.mark.skipif(
    WeightAveraging is None,
    reason="WeightAveraging and EMAWeightAveraging are in lightning.pytorch.callbacks from "
    "Lightning 2.6 on",
)

AOT_EAGER = {"backend": "aot_eager"}
PRESETS = first_then_slow("auto", "turbo")


def guarded(preset: str) -> Any:
    """The guarded run's callback: ``preset`` on ``aot_eager``, with the tests' short warm-up."""
    return lambda: guard(preset, compile_kwargs=AOT_EAGER)


def assert_guarded(cb: Any) -> None:
    """The guarded run compiled, and some of its training steps ran steady (the stance)."""
    s = cb.summary()
    assert s["compiles"] > 0 and s["steady_steps"] > 0, (s["compiles"], s["steady_steps"])


# -- pruning, averaging, finetuning, accumulation -----------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_model_pruning(preset: str) -> None:
    """Pruning at epochs 0 and 2 turns each pruned ``weight`` into ``weight_orig`` times a
    ``weight_mask`` buffer, set by a forward pre-hook; the end of training makes it permanent."""
    cb, _ = compare(
        TinyModule,
        guarded(preset),
        extra=lambda: [
            ModelPruning(
                "l1_unstructured", amount=0.3, apply_pruning=lambda e: e in (0, 2), verbose=0
            )
        ],
        max_epochs=4,
    )
    assert_guarded(cb)


@pytest.mark.parametrize("preset", PRESETS)
def test_stochastic_weight_averaging(preset: str) -> None:
    """SWA from epoch 2: a new learning rate schedule, averaged weights copied in at the end,
    and an extra pass over the training data to refresh BatchNorm's statistics."""
    cb, _ = compare(
        TinyModule,
        guarded(preset),
        extra=lambda: [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)],
        max_epochs=4,
    )
    assert_guarded(cb)


class HeadOnly(TinyModule):
    """What BackboneFinetuning expects: a ``backbone``, and an optimizer over the rest only
    (the callback freezes the backbone before ``configure_optimizers`` and adds its
    parameters as a new param group when it unfreezes it)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.05)


@pytest.mark.parametrize("train_bn", [True, False], ids=["train_bn", "frozen_bn"])
@pytest.mark.parametrize("preset", PRESETS)
def test_backbone_finetuning(preset: str, train_bn: bool) -> None:
    """The backbone is frozen (``requires_grad=False``; with ``train_bn=False`` BatchNorm too,
    with ``track_running_stats=False``) for epoch 0 and unfrozen at epoch 1."""
    cb, _ = compare(
        HeadOnly,
        guarded(preset),
        extra=lambda: [
            BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=train_bn, verbose=False)
        ],
        max_epochs=3,
    )
    assert_guarded(cb)


@pytest.mark.parametrize("preset", PRESETS)
def test_gradient_accumulation_scheduler(preset: str) -> None:
    """One batch per optimizer step in epoch 0, two from epoch 1 on."""
    cb, _ = compare(
        TinyModule,
        guarded(preset),
        extra=lambda: [GradientAccumulationScheduler(scheduling={0: 1, 1: 2})],
        max_epochs=3,
    )
    assert_guarded(cb)


@needs_weight_averaging
@pytest.mark.parametrize("preset", PRESETS)
def test_weight_averaging(preset: str) -> None:
    """An AveragedModel (a deep copy) updated every step; validation runs the averaged
    weights (copied in place, and back after), and the end of training copies them in."""
    cb, _ = compare(TinyModule, guarded(preset), extra=lambda: [WeightAveraging()], max_epochs=3)
    assert_guarded(cb)


@needs_weight_averaging
@pytest.mark.parametrize("preset", PRESETS)
def test_ema_weight_averaging(preset: str) -> None:
    """WeightAveraging with an exponential moving average, from step 3 on."""
    cb, _ = compare(
        TinyModule,
        guarded(preset),
        extra=lambda: [EMAWeightAveraging(decay=0.9, update_starting_at_step=3)],
        max_epochs=3,
    )
    assert_guarded(cb)


# -- the tuner's callbacks: a search inside fit, then the checkpoint restored ------------------


class OwnData(TinyModule):
    """TinyModule with its own data, batched by a ``batch_size`` attribute (BatchSizeFinder
    refuses dataloaders passed to ``fit``)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2

    def train_dataloader(self) -> Any:
        return loaders(batch_size=self.batch_size)[0]

    def val_dataloader(self) -> Any:
        return loaders(batch_size=self.batch_size)[1]


def fit_own_data(model: L.LightningModule, callbacks: list[L.Callback], **kwargs: Any) -> None:
    L.seed_everything(0, verbose=False)
    make_trainer(callbacks, **kwargs).fit(model)


@pytest.mark.parametrize("preset", PRESETS)
def test_batch_size_finder(preset: str) -> None:
    """The finder's trials (run without the other callbacks) and the run at the size it
    found, 2 -> 4 -> 8 -> 16, each the same as the uncompiled run's."""

    def finder() -> BatchSizeFinder:
        return BatchSizeFinder(mode="power", steps_per_trial=2, init_val=2, max_trials=4)

    L.seed_everything(0, verbose=False)
    eager = OwnData()
    eager_finder = finder()
    fit_own_data(eager, [eager_finder], max_epochs=2)
    L.seed_everything(0, verbose=False)
    model = OwnData()
    guarded_finder = finder()
    cb = guarded(preset)()
    fit_own_data(model, [cb, guarded_finder], max_epochs=2)
    assert eager_finder.optimal_batch_size == guarded_finder.optimal_batch_size == 16
    assert eager.batch_size == model.batch_size == 16
    assert_same_run(eager, model)
    assert_guarded(cb)


class WithLR(TinyModule):
    """TinyModule whose optimizer reads ``self.lr``, which LearningRateFinder sets."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.05

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("preset", PRESETS)
def test_learning_rate_finder(preset: str) -> None:
    """A 16-step learning rate search at the start of fit, then the run at its suggestion."""
    finders: list[LearningRateFinder] = []

    def finder() -> list[L.Callback]:
        finders.append(LearningRateFinder(min_lr=1e-4, max_lr=0.5, num_training_steps=16))
        return [finders[-1]]

    cb, model = compare(WithLR, guarded(preset), extra=finder, max_epochs=3)
    assert_guarded(cb)
    eager_lr, guarded_lr = (f.optimal_lr.suggestion() for f in finders if f.optimal_lr)
    assert eager_lr == guarded_lr is not None and guarded_lr != 0.05
    assert model.lr == guarded_lr
