"""Exceptions raised by guardtrain.

One base class, :class:`GuardTrainError`; each subclass also inherits the
built-in exception a caller would expect (``ValueError``, ``TypeError``,
``RuntimeError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "GuardTrainError",
    "GuardTrainValueError",
    "GuardTrainTypeError",
    "GuardTrainRuntimeError",
]


class GuardTrainError(Exception):
    """Base class of every error guardtrain raises on purpose."""


class GuardTrainValueError(GuardTrainError, ValueError):
    """An argument has the right type but a value that is not allowed."""


class GuardTrainTypeError(GuardTrainError, TypeError):
    """An argument has a type that is not allowed."""


class GuardTrainRuntimeError(GuardTrainError, RuntimeError):
    """The run reached a state guardtrain cannot handle soundly."""
