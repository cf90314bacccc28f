"""Re-arm reasons and compile events name modules by the path the user knows."""

from __future__ import annotations

from typing import Any

import torch
from helpers import TinyModule, compare, guard
from torch import nn


class Config:
    """A configuration object, as transformers' ``PretrainedConfig``."""

    def __init__(self) -> None:
        self.problem_type: str | None = None


class Head(nn.Module):
    """Sets ``config.problem_type`` on its first call, as transformers' classification heads do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.config = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            self.config.problem_type = "regression"
        return self.lin(x)


class HeadModule(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        del self.backbone, self.head
        self.net = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_rearm_reasons_use_the_users_names() -> None:
    """H25: the attribute set on the first call is named ``net.config.problem_type``."""
    cb, _ = compare(HeadModule, lambda: guard())
    s = cb.summary()
    texts: list[Any] = [r["reason"] for r in s["rearms"]] + [
        e["reason"] for e in s["compile_events"]
    ]
    assert not any("bound." in t or "_modules[" in t for t in texts), texts
    assert any("net.config.problem_type: None -> 'regression'" in t for t in texts), texts
