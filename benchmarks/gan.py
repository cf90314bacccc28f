"""A Lightning GAN with manual optimization and ``toggle_optimizer``.

Generator: Linear(16, 64) - ReLU - Linear(64, 64) - ReLU - Linear(64, 32); discriminator:
Linear(32, 64) - LeakyReLU - Linear(64, 64) - LeakyReLU - Linear(64, 1) (``--tiny``:
width 32). Each step, as Lightning's GAN example: the generator's update inside
``toggle_optimizer(g_opt)`` (the discriminator's parameters frozen), then the
discriminator's inside ``toggle_optimizer(d_opt)`` (the generator's frozen, its output
detached); Adam for both. Data: 16 samples a step of a fixed 2-cluster mixture in 32
dimensions, and the generator's noise. Plain compile is ``.compile()`` on both networks;
guardtrain's targets are ``generator`` and ``discriminator``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from benchmarks.core import LightningRunner, Runner, Setting, Workload

__all__ = ["MLP", "WORKLOADS"]

Z, X, BATCH = 16, 32, 16


class MLP(nn.Module):
    """Linear layers of ``sizes`` with ``act`` between them.

    A class of its own, as GAN code has: ``.compile()`` on a bare ``nn.Sequential``
    compiles nothing on torch 2.13 (its ``_call_impl`` frame lies in ``torch.nn``, which
    Dynamo skips), where ``torch.compile(seq)`` does compile.
    """

    def __init__(self, sizes: list[int], act: type[nn.Module]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(act())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _build(setting: Setting) -> Runner:
    import lightning as L

    width = 32 if setting.tiny else 64

    class GAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = MLP([Z, width, width, X], nn.ReLU)
            self.discriminator = MLP([X, width, width, 1], nn.LeakyReLU)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            real, z = batch
            g_opt, d_opt = self.optimizers()  # type: ignore[misc, attr-defined]
            bce = nn.functional.binary_cross_entropy_with_logits
            ones = torch.ones(real.shape[0], 1)
            self.toggle_optimizer(g_opt)
            g_loss = bce(self.discriminator(self.generator(z)), ones)
            self.manual_backward(g_loss)
            g_opt.step()
            g_opt.zero_grad()
            self.untoggle_optimizer(g_opt)
            self.toggle_optimizer(d_opt)
            fake = self.generator(z).detach()
            d_loss = 0.5 * (
                bce(self.discriminator(real), ones)
                + bce(self.discriminator(fake), torch.zeros_like(ones))
            )
            self.manual_backward(d_loss)
            d_opt.step()
            d_opt.zero_grad()
            self.untoggle_optimizer(d_opt)
            return (g_loss + d_loss).detach()

        def configure_optimizers(self) -> Any:
            return (
                torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            )

    torch.manual_seed(0)
    module = GAN()
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(2, X, generator=g) * 2
    n = 1024
    real = centers[torch.randint(0, 2, (n * BATCH,), generator=g)] + 0.3 * torch.randn(
        n * BATCH, X, generator=g
    )
    noise = torch.randn(n * BATCH, Z, generator=g)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = (i % n) * BATCH
        return real[j : j + BATCH], noise[j : j + BATCH]

    def compile_plain(m: Any, backend: str) -> None:
        m.generator.compile(backend=backend)
        m.discriminator.compile(backend=backend)

    return LightningRunner(
        setting, module, batch, compile_plain, targets=["generator", "discriminator"]
    )


WORKLOADS = [
    Workload(
        "gan-toggle",
        "Lightning GAN, manual optimization, toggle_optimizer around each network's update",
        _build,
        adapter="GuardTuneCallback",
        framework_step="Lightning's step passes a closure, which PyTorch's recipe cannot compile",
        plain="generator.compile(), discriminator.compile()",
        requires=("lightning",),
    ),
]
