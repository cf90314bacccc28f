"""What the bench measures: its configurations, its built-in models, user factories."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from guardtrain.errors import GuardTrainValueError

__all__ = [
    "CONFIGS",
    "ENGINE_CONFIGS",
    "MODELS",
    "QUICK_MODELS",
    "MLP",
    "BenchModel",
    "Block",
    "Transformer",
    "build_model",
    "check_model_specs",
    "parse_configs",
]

CONFIGS = (
    "eager",
    "compile",
    "off",
    "safe",
    "balanced",
    "aggressive",
    "turbo",
    "auto",
    "aot",
    "floor",
)
"""Every configuration, in table order."""
ENGINE_CONFIGS = ("off", "safe", "balanced", "aggressive", "turbo", "auto")
"""The presets, each run by a whole engine with its phases (warm-up, entry, the steady
state), as in training."""
MODELS = ("mlp", "transformer", "regional")
"""Built-in models; ``package.module:factory`` names a user model."""
QUICK_MODELS = ("transformer",)


class MLP(nn.Module):
    """Deep and narrow: ``depth`` modules (Linear(16, 16), ReLU alternating), then dropout.

    Host-bound: each Linear is a tiny kernel, so guards and Python dominate.
    """

    def __init__(self, depth: int = 96, width: int = 16, p: float = 0.1) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for i in range(depth):
            mods.append(nn.Linear(width, width) if i % 2 == 0 else nn.ReLU())
        self.layers = nn.Sequential(*mods)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.layers(x))


class Block(nn.Module):
    """A pre-norm transformer block with dropout."""

    def __init__(self, d: int = 64, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.drop(self.attn(y, y, y, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer(nn.Module):
    """An input projection (16 -> d) and ``depth`` pre-norm blocks."""

    def __init__(self, depth: int = 12, d: int = 64, heads: int = 4, d_in: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


@dataclasses.dataclass
class BenchModel:
    """A model to measure: the pristine module (copied per configuration) and its input."""

    name: str
    module: nn.Module
    args: tuple[Any, ...]
    targets: list[str] = dataclasses.field(default_factory=lambda: [""])
    """What the presets compile: ``[""]`` the whole model, ``["blocks.*"]`` each block."""


def _builtin(name: str, tiny: bool) -> BenchModel:
    if name == "mlp":
        return BenchModel(name, MLP(depth=8 if tiny else 96), (torch.randn(8, 16),))
    depth = 2 if tiny else 12
    targets = ["blocks.*"] if name == "regional" else [""]
    return BenchModel(name, Transformer(depth=depth), (torch.randn(4, 8, 16),), targets)


def _model_error(spec: str, why: str) -> GuardTrainValueError:
    return GuardTrainValueError(
        f"--model {spec!r}: {why}; allowed: {', '.join(MODELS)}, or package.module:factory "
        "(a function returning a module and an example input)."
    )


def _working_directory_on_path() -> None:
    """Put the working directory first on ``sys.path`` unless it is there already, as
    ``python -m`` does and as uvicorn and gunicorn do for their ``module:attr`` specs: the
    ``guardtrain`` console script starts with its own directory there instead, so a
    ``mymodule:factory`` beside the user would not be found."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)


def check_model_specs(specs: Sequence[str]) -> None:
    """Fail on an unknown built-in name before anything is compiled.

    Raises:
        GuardTrainValueError: names the value and the allowed ones.
    """
    for spec in specs:
        if ":" not in spec and spec not in MODELS:
            raise _model_error(spec, "unknown model")


def build_model(spec: str, tiny: bool = False) -> BenchModel:
    """Build a built-in model by name, or call a user factory ``package.module:factory``.

    The factory takes no argument and returns ``(module, example_input)``; the
    input is a tensor or a tuple of positional arguments. The module is imported with
    the working directory on ``sys.path`` (:func:`_working_directory_on_path`).

    Raises:
        GuardTrainValueError: an unknown name, or a factory that cannot be imported
            or returns something else; the message names the value and the allowed ones.
    """
    if not isinstance(spec, str) or not spec:
        raise _model_error(str(spec), "not a model name")
    if ":" not in spec:
        check_model_specs([spec])
        torch.manual_seed(0)
        return _builtin(spec, tiny)
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise _model_error(spec, "expected package.module:factory")
    _working_directory_on_path()
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise _model_error(
            spec, f"cannot import {mod_name!r} ({err}; working directory {os.getcwd()})"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _model_error(spec, f"{mod_name!r} has no callable {attr!r}")
    torch.manual_seed(0)
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise _model_error(
            spec, f"the factory returned {type(made).__name__}, not (module, example_input)"
        )
    net, example = made
    args = example if isinstance(example, tuple) else (example,)
    return BenchModel(spec, net, args)


def parse_configs(values: Sequence[str] | None) -> list[str]:
    """Configuration names from ``--configs`` values (comma-separated or repeated), in table order."""
    if not values:
        return list(CONFIGS)
    names = [n.strip() for value in values for n in value.split(",") if n.strip()]
    allowed = ", ".join(CONFIGS)
    for name in names:
        if name not in CONFIGS:
            raise GuardTrainValueError(
                f"--configs: unknown configuration {name!r}; allowed: {allowed}."
            )
    if not names:
        raise GuardTrainValueError(f"--configs is empty; allowed: {allowed}.")
    return [c for c in CONFIGS if c in names]
