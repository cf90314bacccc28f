"""guardtrain: fast and correct ``torch.compile``d training with Lightning.

Add one callback::

    from guardtrain import GuardTuneCallback
    trainer = L.Trainer(callbacks=[GuardTuneCallback(preset="aggressive")])

Importing this package has no side effects: nothing is compiled and no
Dynamo setting changes until a run starts.
"""

from guardtrain import filters
from guardtrain._version import __version__
from guardtrain.callback import GuardTuneCallback
from guardtrain.errors import (
    GuardTrainError,
    GuardTrainRuntimeError,
    GuardTrainTypeError,
    GuardTrainValueError,
)
from guardtrain.presets import PRESETS, GuardPreset

__all__ = [
    "PRESETS",
    "GuardPreset",
    "GuardTrainError",
    "GuardTrainRuntimeError",
    "GuardTrainTypeError",
    "GuardTrainValueError",
    "GuardTuneCallback",
    "__version__",
    "filters",
]
