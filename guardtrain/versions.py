"""The torch versions guardtrain is tested on, and what differs between them.

guardtrain relies on private Dynamo APIs (cache entries, guard managers,
``TensorGuards``, ``GlobalStateGuard``, the eval-frame callback), so each torch
release in :data:`TESTED` runs the test suite (``scripts/matrix.sh``; the table is
in docs/versions.md). A newer torch is allowed, with one warning (H36).
"""

from __future__ import annotations

import re
from typing import Callable

import torch

__all__ = [
    "DICT_TAGS_FIXED",
    "dict_tags_override_reason",
    "dict_tags_warning",
    "TESTED",
    "release",
    "risky_dict_tags_default",
    "untested_warning",
    "warn_if_untested",
]

TESTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 15))
"""The oldest and the newest torch minor version that the matrix has run."""

DICT_TAGS_FIXED = (2, 12)
"""The first torch with the fixes for the segfaults in guard evaluation with recursive
dict tags (pytorch/pytorch#181873, #181925); 2.10 and 2.11 have them on by default."""


def release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch).

    Raises:
        ValueError: ``version`` does not start with ``MAJOR.MINOR``.
    """
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise ValueError(f"cannot read a torch version from {text!r}: expected 'MAJOR.MINOR...'")
    return int(match.group(1)), int(match.group(2))


def _name(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def risky_dict_tags_default(version: str | None = None) -> bool:
    """Whether this torch has recursive dict tags on by default and still segfault-prone:
    a default of ``True`` before :data:`DICT_TAGS_FIXED` (2.10, 2.11)."""
    from guardtrain._torch import dynamo_config

    default = bool(getattr(dynamo_config, "use_recursive_dict_tags_for_guards", False))
    return default and release(version) < DICT_TAGS_FIXED


def untested_warning(version: str | None = None) -> str | None:
    """The warning for a torch newer than the newest tested one, or None."""
    text = torch.__version__ if version is None else version
    if release(text) <= TESTED[1]:
        return None
    return (
        f"guardtrain: torch {text} is newer than the versions guardtrain was tested on "
        f"(torch {_name(TESTED[0])} to {_name(TESTED[1])}). guardtrain relies on private "
        "Dynamo APIs that a torch release may change: please run its tests on this torch "
        "(scripts/matrix.sh) or report what fails."
    )


_warned: list[str] = []


def warn_if_untested(warn: Callable[[str], None]) -> None:
    """Give :func:`untested_warning` through ``warn`` once per process."""
    message = untested_warning()
    if message is not None and message not in _warned:
        _warned.append(message)
        warn(message)


def dict_tags_override_reason(release_text: str) -> str:
    """Why guardtrain turned recursive dict tags off on a torch that defaults to on."""
    return (
        f"guardtrain turned off torch {release_text}'s default: its guard evaluation "
        "with them can segfault, pytorch/pytorch#181873, fixed in torch "
        f"{_name(DICT_TAGS_FIXED)}; recursive_dict_tags=True keeps them on"
    )


def dict_tags_warning(release_text: str, default: bool) -> str:
    """The warning for ``recursive_dict_tags=True`` where they are off by default or
    segfault-prone (``default``: torch's own default)."""
    if default:
        why = (
            f"which torch {release_text} has on by default without the fixes for segfaults "
            f"in guard evaluation that came in torch {_name(DICT_TAGS_FIXED)} "
            "(pytorch/pytorch#181873, #181925). Leave recursive_dict_tags unset and "
            "guardtrain turns them off."
        )
    else:
        why = (
            f"which torch {release_text} leaves off by default: PyTorch switched it off "
            "after segfaults in guard evaluation (pytorch/pytorch#181873, #181925). Leave "
            "recursive_dict_tags unset to keep torch's default."
        )
    return (
        "guardtrain: recursive_dict_tags=True turns on Dynamo's "
        f"use_recursive_dict_tags_for_guards, {why}"
    )
