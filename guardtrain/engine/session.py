"""The process-wide state a run changes, saved once and restored once (H11).

:class:`StanceSession` owns the stance (``skip_guard_eval_unsafe``), Dynamo's
config values the run sets, and the guard-collectives hook. Every adapter goes
through one session per run; :meth:`StanceSession.restore` puts all of it
back, also after an exception.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch._dynamo.eval_frame as _eval_frame

from guardtrain.errors import GuardTrainRuntimeError

__all__ = ["StanceSession", "stance_is_unsafe"]


def stance_is_unsafe() -> bool:
    """Whether ``skip_guard_eval_unsafe`` is set in this process now."""
    return bool(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)


class StanceSession:
    """Save, set and restore the stance and Dynamo config values of one run.

    Args:
        owner: named in the error when the unsafe stance is already set.
    """

    def __init__(self, owner: str = "guardtrain") -> None:
        self.owner = owner
        self.stance_on = False
        self.active = False
        self._saved_stance: Any = None
        self._on_stance: Any = None
        self._paused = False
        self._saved_config: dict[str, Any] = {}
        self._collectives_prev: bool | None = None

    def begin(self) -> None:
        """Save the stance; refuse to start under the unsafe stance (warm-up needs guards).

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
        self._saved_stance = stance
        self._on_stance = dataclasses.replace(stance, skip_guard_eval_unsafe=True)
        self._paused = False
        self.active = True

    def set_config(self, key: str, value: Any) -> None:
        """Set ``torch._dynamo.config.<key>`` for the run (saved the first time)."""
        cfg = torch._dynamo.config
        if key not in self._saved_config:
            self._saved_config[key] = getattr(cfg, key)
        setattr(cfg, key, value)

    def set_stance(self, on: bool) -> bool:
        """Turn the unsafe stance on or off; True when it changed."""
        if on == self.stance_on or not self.active:
            return False
        prev = self._saved_stance
        torch.compiler.set_stance(
            prev.stance,
            skip_guard_eval_unsafe=on or prev.skip_guard_eval_unsafe,
            force_backend=prev.backend,
        )
        self.stance_on = on
        self._paused = False
        return True

    def pause(self) -> None:
        """Lift the stance process-wide while :attr:`stance_on` stays True, until
        :meth:`resume` (an adapter that sets it inside each forward call only).

        Cheaper than :meth:`set_stance` (one assignment, no ``DynamoStance`` made), and
        the compiled targets keep their fast state (turbo keeps its dispatch tables)."""
        if self.stance_on and not self._paused:
            _eval_frame._stance = self._saved_stance  # what _set_stance does, without its import
            self._paused = True

    def resume(self) -> None:
        """Set the stance again after :meth:`pause` (a no-op when it is not paused)."""
        if self._paused:
            _eval_frame._stance = self._on_stance
            self._paused = False

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
        """Put back the stance, the config values and the guard-collectives hook."""
        self.set_stance(False)
        self.set_guard_collectives(False)
        cfg = torch._dynamo.config
        for key, value in self._saved_config.items():
            setattr(cfg, key, value)
        self._saved_config = {}
        self.active = False
