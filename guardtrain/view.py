"""What every adapter shows of its run: the arguments as validated, the engine, its phase.

``GuardTuneCallback``, ``GuardTuner`` and ``GuardTrainerCallback`` each hold a
``config`` (:class:`~guardtrain.engine.config.GuardConfig`) and the engine they drive;
:class:`EngineView` gives all three the same read-only properties.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guardtrain.engine.config import GuardConfig
    from guardtrain.engine.engine import GuardEngine
    from guardtrain.presets import GuardPreset

__all__ = ["EngineView"]


class EngineView:
    """Read-only views of an adapter's ``config`` and ``_engine``."""

    __slots__ = ()

    config: GuardConfig
    _engine: GuardEngine

    @property
    def settings(self) -> GuardPreset:
        """The preset's levers with the explicit arguments applied."""
        return self.config.levers

    @property
    def engine(self) -> GuardEngine:
        """The engine (read it; the adapter drives it)."""
        return self._engine

    @property
    def phase(self) -> str:
        """The training loop's phase: ``"warmup"``, ``"steady"``, or ``"off"`` (no stance)."""
        return self._engine.phase

    @property
    def disabled(self) -> bool:
        """``GUARDTRAIN_DISABLE`` was set when the adapter was made: it does nothing."""
        return self.config.disabled

    def summary(self) -> dict[str, Any]:
        """Counters and history of the runs so far, as a plain dict (the same keys for
        every adapter)."""
        return self._engine.summary()

    def format_summary(self) -> str:
        """The end-of-run table that the adapter logs once, on the main process."""
        return self._engine.format_summary()
