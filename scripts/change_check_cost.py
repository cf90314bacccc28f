"""What the per-call change checks cost under the stance (H32, H33), part by part, in ns.

Brings a target to the steady state with ``aggressive`` (eager backend) and times,
on the call's own arguments, each check that issue 17 added to a steady call:

* ``changed``: the event flag that module assignments and hooks set (one read);
* ``versions``: the dictionary versions of the globals and plain objects that
  the target's guards read (:class:`guardtrain.compile.watch.DictVersions`);
* ``key``: the argument key (:func:`guardtrain.compile.call_key`) and its
  comparison with the previous call's, mode included.

Two targets: one ``Linear`` called with one tensor and three plain arguments
(an int, a float, a str), and a 49-module stack (24 ``Linear`` and 24 ``ReLU``)
called with one tensor: no per-call part may grow with the number of modules.
Medians of 7 repeats, minus an empty loop. Usage::

    .venv/bin/python scripts/change_check_cost.py
"""

from __future__ import annotations

from typing import Any

import torch
from direct_check_cost import per_call  # scripts/ is on sys.path when run as a script
from torch import nn

from guardtrain import GuardTuner
from guardtrain import compile as gc

SCALE = 1.0


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, k: int, t: float, flag: str) -> torch.Tensor:
        out = self.lin(x) * k * t * SCALE
        return out + 1 if flag == "b" else out


class Stack(nn.Module):
    def __init__(self, depth: int = 24) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(8, 8), nn.ReLU()]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * SCALE


def measure(model: nn.Module, args: tuple[Any, ...]) -> dict[str, float]:
    x = args[0]
    with (
        GuardTuner(
            model,
            preset="aggressive",
            compile_kwargs={"backend": "eager"},
            warmup_steps=2,
            stable_steps=2,
            audit_every=None,
        ) as tuner,
        torch.no_grad(),
    ):
        for _ in range(8):
            with tuner.step((x,)):
                model(*args)
        assert tuner.phase == "steady", tuner.summary()
        target = model.forward._guardtrain_target  # type: ignore[union-attr]
        with tuner.step((x,)):
            model(*args)  # the last key is this call's
        mode = (model.training, torch.is_grad_enabled(), False, False)
        kwargs: dict[str, Any] = {}
        versions = target.versions

        def empty() -> None:
            pass

        def changed() -> None:
            if target.changed:
                pass

        def moved() -> None:
            versions.moved()

        def key() -> None:
            found = gc.call_key(args, kwargs)
            assert found is not None
            if found[0] != target.last_key or mode != target.last_mode:
                raise AssertionError("the key should match the last call's")

        base = per_call(empty)
        return {
            "changed": per_call(changed) - base,
            "versions": per_call(moved) - base,
            "dicts": float(len(versions)),
            "key": per_call(key) - base,
        }


def main() -> None:
    torch.manual_seed(0)
    rows = [
        ("Linear, 1 tensor + int, float, str", Small(), (torch.randn(4, 8), 3, 0.5, "a")),
        ("49 modules, 1 tensor", Stack(), (torch.randn(4, 8),)),
    ]
    print(f"torch {torch.__version__}; ns per call (median of 7, minus an empty loop)")
    print("| target | changed flag | versions (dicts) | argument key | total |")
    print("|---|---|---|---|---|")
    for label, model, args in rows:
        r = measure(model, args)
        total = r["changed"] + r["versions"] + r["key"]
        print(
            f"| {label} | {r['changed']:.0f} | {r['versions']:.0f} ({r['dicts']:.0f}) | "
            f"{r['key']:.0f} | {total:.0f} |"
        )


if __name__ == "__main__":
    main()
