"""The two stance values a steady call writes: :class:`Stances` (H41).

Torch's stance is one value for the whole process. guardtrain never sets it for the
process: a steady call of a target sets ``unsafe`` around its own compiled call and
puts back what it found (:func:`guardtrain.compile.forward.steady`). The values are
made once per run (:class:`~guardtrain.engine.process.DynamoSettings`), so the
per-call path only assigns a prebuilt object and compares identities.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["NO_STANCE", "Stances"]

NO_STANCE: Any = object()
"""Stands for the plain stance when there is none to replace: never torch's stance
object, so a steady call takes the path that leaves the user's stance as it is."""


@dataclasses.dataclass(frozen=True, slots=True)
class Stances:
    """Torch's stance as the run found it (``plain``: what a steady call expects to find
    and puts back) and the same with ``skip_guard_eval_unsafe`` (``unsafe``: set for the
    call).

    ``plain`` is :data:`NO_STANCE` when the run found a stance that is not torch's
    default (``force_eager``, ``fail_on_recompile``, a forced backend): that stance is the
    user's, and steady calls run under it with full guards."""

    plain: Any = NO_STANCE
    unsafe: Any = None

    @classmethod
    def of(cls, stance: Any) -> Stances:
        """The values for a run that starts under ``stance`` (a ``DynamoStance``)."""
        if stance.stance != "default" or stance.backend is not None:
            return cls()
        return cls(stance, dataclasses.replace(stance, skip_guard_eval_unsafe=True))
