"""guardtrain: fast and correct ``torch.compile``d training with Lightning.

Add one callback::

    from guardtrain import GuardTuneCallback
    trainer = L.Trainer(callbacks=[GuardTuneCallback(preset="aggressive")])

Importing this package has no side effects: nothing is compiled and no Dynamo
setting changes until a run starts. torch and Lightning are imported only when
:class:`GuardTuneCallback` is first used, so Hydra can read the bundled config
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
from guardtrain.presets import PRESETS, GuardPreset

if TYPE_CHECKING:  # pragma: no cover
    from guardtrain.callback import GuardTuneCallback

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


def __getattr__(name: str) -> Any:
    if name == "GuardTuneCallback":
        from guardtrain.callback import GuardTuneCallback

        return GuardTuneCallback
    raise AttributeError(f"module 'guardtrain' has no attribute {name!r}")
