"""Two CPU processes under Fabric (ddp, gloo): a GuardTuner run beside an uncompiled twin.

Usage: ``python tests/ddp_scripts/fabric_run.py OUT``. Each rank writes
``OUT.{rank}.json`` with its phase, its summary counters and whether every loss
equalled the twin's.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn

from guardtrain import GuardTuner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _leave import leave
from helpers import turbo_everywhere

turbo_everywhere()  # `pytest --turbo-everywhere`: `aggressive` runs with turbo's levers

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Net(nn.Module):
    """Linear -> Tanh -> Linear: not tests/helpers.py's Net, which has Dropout.

    The guarded net and its uncompiled twin run one after the other on the same
    global RNG, so with Dropout they would draw different masks and never agree.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(x)))


def main(out: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    twin, net = Net(), Net()
    net.load_state_dict(twin.state_dict())
    twin, twin_opt = fabric.setup(twin, torch.optim.SGD(twin.parameters(), lr=0.05))
    net, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(10 + fabric.global_rank)
    batches = [torch.randn(8, 8, generator=g) for _ in range(12)]
    equal = True
    with GuardTuner(
        net,
        "aggressive",
        fabric=fabric,
        warmup_steps=3,
        stable_steps=2,
        compile_kwargs={"backend": "eager"},
    ) as tuner:
        for _ in range(2):
            for x in batches:
                with tuner.step((x,)):
                    loss = net(x).pow(2).mean()
                    fabric.backward(loss)
                    opt.step()
                    opt.zero_grad()
                ref = twin(x).pow(2).mean()
                fabric.backward(ref)
                twin_opt.step()
                twin_opt.zero_grad()
                equal = equal and torch.equal(loss.detach(), ref.detach())
        phase = tuner.phase
    s = tuner.summary()
    result = {
        "equal": bool(equal),
        "phase": phase,
        "steady_steps": s["steady_steps"],
        "warmup_steps_taken": s["warmup_steps_taken"],
        "rearms": s["rearms"],
    }
    Path(f"{out}.{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
    leave()
