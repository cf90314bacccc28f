"""guardtrain: fast and correct ``torch.compile``d training with Lightning.

Add one callback::

    from guardtrain import GuardTuneCallback
    trainer = L.Trainer(callbacks=[GuardTuneCallback(preset="aggressive")])

or, with a Hugging Face ``transformers.Trainer``::

    from guardtrain import GuardTrainerCallback
    trainer = Trainer(..., callbacks=[GuardTrainerCallback("aggressive")])

or, in a loop of your own (or with Lightning Fabric)::

    from guardtrain import GuardTuner
    with GuardTuner(model, preset="aggressive") as tuner:
        for batch in loader:
            with tuner.step(batch):
                ...

Importing this package has no side effects: nothing is compiled and no Dynamo
setting changes until a run starts. torch, Lightning and transformers are imported only
when :class:`GuardTuneCallback`, :class:`GuardTuner` or :class:`GuardTrainerCallback` is first
used, so Hydra can read the bundled config
group (``guardtrain.conf``) without loading them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guardtrain import filters
from guardtrain._version import __version__
from guardtrain.errors import (
    GuardTrainError,
    GuardTrainRuntimeError,
    GuardTrainTypeError,
    GuardTrainValueError,
)
from guardtrain.presets import PRESET_NAMES, PRESETS, GuardPreset, get_preset

if TYPE_CHECKING:  # pragma: no cover
    from guardtrain.callback import GuardTuneCallback
    from guardtrain.hf import GuardTrainerCallback
    from guardtrain.tuner import GuardTuner

__all__ = [
    "PRESETS",
    "PRESET_NAMES",
    "GuardPreset",
    "GuardTrainError",
    "GuardTrainRuntimeError",
    "GuardTrainTypeError",
    "GuardTrainValueError",
    "GuardTrainerCallback",
    "GuardTuneCallback",
    "GuardTuner",
    "__version__",
    "filters",
    "get_preset",
]


def __getattr__(name: str) -> Any:
    if name == "GuardTuneCallback":
        from guardtrain.callback import GuardTuneCallback

        return GuardTuneCallback
    if name == "GuardTrainerCallback":
        from guardtrain.hf import GuardTrainerCallback

        return GuardTrainerCallback
    if name == "GuardTuner":
        from guardtrain.tuner import GuardTuner

        return GuardTuner
    raise AttributeError(f"module 'guardtrain' has no attribute {name!r}")
