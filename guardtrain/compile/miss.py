"""Why a call under the stance leaves it: the reasons a miss hook is told.

The per-call wrapper and the shared code's checks call the target's miss hook with a
:class:`Miss`: its :class:`MissReason` says what happened (the engine acts on it),
its ``text`` is what the messages and re-arm reasons show.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Miss", "MissReason"]


class MissReason(enum.Enum):
    """What made a call leave the stance. A value is the text of a miss of that kind
    unless the miss carries its own (a call mode, a change, shared code)."""

    MODE = "the call's mode was never compiled, or the stance cannot tell its entries apart"
    """A ``(training, grad, inference, autocast)`` the stance cannot serve."""
    UNSEEN_ARGUMENTS = "the call's plain arguments are new, and no compiled entry accepts them"
    """Plain values, ``None``, keywords or structure no entry was shown to accept (H32)."""
    UNACCEPTED = "no compiled entry's guards accept the call's inputs"
    """New inputs (an unseen batch, H26, or turbo's check, H30) that no entry accepts."""
    CHANGED = "a watched module changed"
    """A module event before the call (H33), and the entry the stance would run does
    not accept the call; the text is the event."""
    WRITTEN = "a global or an object its guards read was written"
    """A namespace or object that the guards read moved its version before the call,
    and the entry the stance would run does not accept the call."""
    STANCE_MISS = "no compiled entry accepted the call"
    """Dynamo's own miss under the stance (H4)."""
    SHARED_CODE = "left its class's shared code"
    """The target left its shared code for code of its own (H24); the text says why."""
    SAVED_HOOKS = "saved-tensor hooks that Dynamo inlines are active; compiling with their guard"
    """Saved-tensor hooks that need their guard (H31)."""
    NEW_PATTERN = "compiling the code of the new requires_grad pattern or autocast state"
    """The parameters' ``requires_grad`` took a pattern, or the call's autocast a state,
    whose code has no entry for the call yet (H42, H44); the text says what changed."""


@dataclass(frozen=True, slots=True)
class Miss:
    """One miss: what happened, and its text."""

    reason: MissReason
    text: str

    def __str__(self) -> str:
        return self.text

    @classmethod
    def of(cls, reason: MissReason) -> Miss:
        """A miss whose text is its reason's."""
        return cls(reason, reason.value)
