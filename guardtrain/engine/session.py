"""The process-wide state a run changes, saved once and restored once (H11, H41).

:class:`StanceSession` owns what a run changes outside its own objects: Dynamo's
config values, the guard-collectives hook, and the two stance values that the
targets' per-call path writes inline (:class:`~guardtrain.compile.stances.Stances`). The stance is never set
for the process: each steady call of a target sets it around its own compiled call
and puts the previous value back (:mod:`guardtrain.compile.forward`), so every
other compiled function in the process runs with full guards (H41).
:meth:`StanceSession.restore` puts the config back, also after an exception.
"""

from __future__ import annotations

from typing import Any

import torch

from guardtrain.compile.stances import Stances
from guardtrain.errors import GuardTrainRuntimeError

__all__ = ["StanceSession", "stance_is_unsafe"]


def stance_is_unsafe() -> bool:
    """Whether ``skip_guard_eval_unsafe`` is set in this process now."""
    return bool(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)


class StanceSession:
    """Save, set and restore the Dynamo config values of one run; hand out its stances.

    Args:
        owner: named in the error when the unsafe stance is already set.
    """

    def __init__(self, owner: str = "guardtrain") -> None:
        self.owner = owner
        self.active = False
        self.stances = Stances()
        """What the targets' steady calls write (:meth:`begin` sets them)."""
        self._saved_config: dict[str, Any] = {}
        self._collectives_prev: bool | None = None

    def begin(self) -> None:
        """Take the stance values from torch's stance now; refuse to start under the
        unsafe stance (warm-up needs guards).

        Raises:
            GuardTrainRuntimeError: ``skip_guard_eval_unsafe`` is already set.
        """
        stance = torch._dynamo.eval_frame._stance
        if stance.skip_guard_eval_unsafe:
            raise GuardTrainRuntimeError(
                "The unsafe stance (skip_guard_eval_unsafe=True) is already set when the run "
                f"starts; {self.owner} needs full guards while it warms up. Call "
                "torch.compiler.set_stance('default') before the run, or drop it."
            )
        self.stances = Stances.of(stance)
        self.active = True

    def set_config(self, key: str, value: Any) -> None:
        """Set ``torch._dynamo.config.<key>`` for the run (saved the first time)."""
        cfg = torch._dynamo.config
        if key not in self._saved_config:
            self._saved_config[key] = getattr(cfg, key)
        setattr(cfg, key, value)

    def set_guard_collectives(self, on: bool) -> None:
        """Dynamo's per-call guard collective (H7); the caller toggles it where every rank is."""
        if on == (self._collectives_prev is not None):
            return
        if on:
            self._collectives_prev = torch.compiler.set_enable_guard_collectives(True)
        else:
            torch.compiler.set_enable_guard_collectives(bool(self._collectives_prev))
            self._collectives_prev = None

    def restore(self) -> None:
        """Put back the config values and the guard-collectives hook."""
        self.set_guard_collectives(False)
        cfg = torch._dynamo.config
        for key, value in self._saved_config.items():
            setattr(cfg, key, value)
        self._saved_config = {}
        self.active = False
