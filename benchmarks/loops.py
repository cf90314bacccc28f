"""Plain loops with :class:`~guardtrain.GuardTuner`: the whole step of the bench's
transformer, autocast on every other step, RL-style rollouts and updates, and a ViT with
gradient checkpointing. Plain compile is ``model.compile()``.

* ``step-transformer``, ``step-transformer-regional``: the bench's transformer
  (:class:`~guardtrain.bench.models.Transformer`, 12 blocks of width 64; ``--tiny``: 2),
  4 x 8 inputs of 16, MSE to a fixed target, AdamW with a ``LambdaLR`` schedule stepped
  every step; compiled whole, or block by block (``targets=["blocks.*"]``, plain:
  ``block.compile()``). With ``--compile-optimizer`` the step's largest saving left.

* ``autocast-alternate``: the bench's transformer (``Linear(16, 64)``, 4 pre-norm
  blocks, 4 heads, dropout 0.1; ``--tiny``: 2 blocks) and a ``Linear(64, 1)`` head, MSE
  to a fixed target, AdamW; the odd steps run forward and loss under
  ``torch.autocast("cpu", dtype=torch.bfloat16)``.
* ``rl-alternate``: a policy MLP (8 - 64 - 64 - 4, dropout 0.1); each step does 4
  rollout calls of 16 observations under ``model.eval()`` and ``no_grad`` (sampling an
  action per observation), then ``model.train()`` and one REINFORCE update on 16 of the
  64 observations, AdamW. ``tuner.step`` spans both.
* ``vit-checkpoint``: timm's ``VisionTransformer(img_size=32, patch_size=8,
  embed_dim=64, depth=4, num_heads=2, num_classes=10)`` with
  ``set_grad_checkpointing(True)`` (``--tiny``: depth 2); where timm does not import, a
  built-in ViT of the same shape that checkpoints each block with
  ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` (the result says
  which ran). 8 images of 3x32x32 a step, cross-entropy, AdamW.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.core import LoopJob, LoopRunner, Runner, Setting, Workload
from guardtrain.bench.models import Transformer

__all__ = ["WORKLOADS", "Policy", "Regressor", "TinyViT"]


class _Job(LoopJob):
    """A model and AdamW; ``compile_plain`` is ``model.compile()``."""

    def __init__(self, model: nn.Module, setting: Setting, lr: float = 1e-3) -> None:
        self.model = model
        self.opt = self.adamw(model.parameters(), lr, setting)

    def compile_plain(self, backend: str) -> None:
        self.model.compile(backend=backend)


# -- autocast on every other step -------------------------------------------------------------


class Regressor(nn.Module):
    """The bench's transformer and a ``Linear(64, 1)`` head (a class, not an
    ``nn.Sequential``: ``.compile()`` on a bare container compiles nothing, see
    :class:`~benchmarks.gan.MLP`)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.body = Transformer(depth=depth)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Policy(nn.Module):
    """8 observations -> ``width`` -> ``width`` -> 4 action logits, tanh, dropout 0.1."""

    def __init__(self, width: int, obs: int = 8, actions: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs, width),
            nn.Tanh(),
            nn.Dropout(0.1),
            nn.Linear(width, width),
            nn.Tanh(),
            nn.Linear(width, actions),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _Autocast(_Job):
    def __init__(self, setting: Setting) -> None:
        torch.manual_seed(0)
        super().__init__(Regressor(depth=2 if setting.tiny else 4), setting)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 4, 8, 16, generator=g)
        self.y = torch.randn(64, 4, 8, 1, generator=g)

    def batch(self, i: int) -> Any:
        return self.x[i % 64]

    def step(self, i: int) -> torch.Tensor:
        x, y = self.x[i % 64], self.y[i % 64]
        if i % 2:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(self.model(x).float(), y)
        else:
            loss = nn.functional.mse_loss(self.model(x), y)
        return self.update(loss)


# -- the whole training step of the bench's transformer -----------------------------------------


class _WholeStep(_Job):
    """The bench's 12-block transformer (``--tiny``: 2), MSE to a fixed target, AdamW with
    a ``LambdaLR`` schedule stepped every step; compiled whole or block by block."""

    def __init__(self, setting: Setting, regional: bool) -> None:
        torch.manual_seed(0)
        super().__init__(Transformer(depth=2 if setting.tiny else 12), setting)
        self.regional = regional
        if regional:
            self.tuner_kwargs = {"targets": ["blocks.*"]}
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1 / (1 + 0.01 * s))
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 4, 8, 16, generator=g)
        self.y = torch.randn(64, 4, 8, 64, generator=g)

    def batch(self, i: int) -> Any:
        return self.x[i % 64]

    def step(self, i: int) -> torch.Tensor:
        loss = self.update(nn.functional.mse_loss(self.model(self.x[i % 64]), self.y[i % 64]))
        self.schedule.step()
        return loss

    def compile_plain(self, backend: str) -> None:
        if not self.regional:
            return super().compile_plain(backend)
        for block in self.model.blocks:  # type: ignore[union-attr]
            block.compile(backend=backend)


# -- RL: rollouts in eval mode, then an update --------------------------------------------------


class _RL(_Job):
    OBS, ACTIONS, BATCH, ROLLOUTS = 8, 4, 16, 4

    def __init__(self, setting: Setting) -> None:
        torch.manual_seed(0)
        super().__init__(Policy(32 if setting.tiny else 64, self.OBS, self.ACTIONS), setting)
        g = torch.Generator().manual_seed(1)
        self.obs = torch.randn(256, self.ROLLOUTS, self.BATCH, self.OBS, generator=g)
        self.best = torch.randn(self.OBS, self.ACTIONS, generator=g)
        n = self.ROLLOUTS * self.BATCH
        self.pick = torch.stack([torch.randperm(n, generator=g)[: self.BATCH] for _ in range(256)])

    def batch(self, i: int) -> Any:
        return self.obs[i % 256]

    def step(self, i: int) -> torch.Tensor:
        model, obs = self.model, self.obs[i % 256]
        model.eval()
        actions = []
        with torch.no_grad():
            for k in range(self.ROLLOUTS):
                probs = model(obs[k]).softmax(-1)
                actions.append(torch.multinomial(probs, 1).squeeze(-1))
        model.train()
        pick = self.pick[i % 256]  # a minibatch of 16 of the 64 observations
        states = obs.flatten(0, 1)[pick]
        taken = torch.stack(actions).flatten()[pick]
        reward = (taken == (states @ self.best).argmax(-1)).float()
        advantage = reward - reward.mean()
        logp = model(states).log_softmax(-1).gather(-1, taken[:, None]).squeeze(-1)
        return self.update(-(logp * advantage).mean())


# -- a ViT with gradient checkpointing ---------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """timm's ``VisionTransformer`` in small (class token, learned position embedding,
    pre-norm blocks, the head on the class token), for where timm does not import.
    ``set_grad_checkpointing(True)`` checkpoints each block in training with grad on."""

    def __init__(
        self,
        img_size: int = 32,
        patch_size: int = 8,
        embed_dim: int = 64,
        depth: int = 4,
        num_heads: int = 2,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, embed_dim, patch_size, patch_size)
        n = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, embed_dim) * 0.02)
        self.blocks = nn.Sequential(*(_Block(embed_dim, num_heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm(x)[:, 0])


def vit(depth: int) -> tuple[nn.Module, str]:
    """timm's ViT, or :class:`TinyViT` where timm does not import; and which one it is."""
    kwargs = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": depth}
    kwargs.update(num_heads=2, num_classes=10)
    try:
        from timm.models.vision_transformer import VisionTransformer
    except Exception as err:  # timm installed but its torchvision broken counts too
        why = f"{type(err).__name__}: {err}"[:160]
        return TinyViT(**kwargs), f"built-in TinyViT (timm does not import: {why})"
    return VisionTransformer(**kwargs), "timm VisionTransformer"


class _ViT(_Job):
    def __init__(self, setting: Setting) -> None:
        torch.manual_seed(0)
        model, self.which = vit(depth=2 if setting.tiny else 4)
        model.set_grad_checkpointing(True)  # type: ignore[operator]
        super().__init__(model, setting)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(64, 8, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (64, 8), generator=g)

    def batch(self, i: int) -> Any:
        return self.x[i % 64]

    def step(self, i: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.model(self.x[i % 64]), self.y[i % 64])
        return self.update(loss)


def _loop(job: Callable[..., _Job], **kwargs: Any) -> Callable[[Setting], Runner]:
    """A workload's ``build``: the job made for the setting, in a :class:`LoopRunner`."""

    def build(setting: Setting) -> Runner:
        made = job(setting, **kwargs)
        runner = LoopRunner(setting, made)
        which = getattr(made, "which", None)
        if which is not None:
            runner.notes.append(f"model: {which}")
        return runner

    return build


WORKLOADS = [
    Workload(
        "step-transformer",
        "the bench's 12-block transformer, MSE, AdamW with LambdaLR: the whole step",
        _loop(_WholeStep, regional=False),
        adapter="GuardTuner",
        plain="model.compile()",
    ),
    Workload(
        "step-transformer-regional",
        "the same step, the model compiled block by block (targets blocks.*)",
        _loop(_WholeStep, regional=True),
        adapter="GuardTuner",
        plain="block.compile() for each block",
    ),
    Workload(
        "autocast-alternate",
        "a 4-block transformer, bf16 autocast on every other step; plain loop",
        _loop(_Autocast),
        adapter="GuardTuner",
        plain="model.compile()",
    ),
    Workload(
        "rl-alternate",
        "4 rollout calls in eval() under no_grad, then a train() update, each step",
        _loop(_RL),
        adapter="GuardTuner",
        plain="model.compile()",
    ),
    Workload(
        "vit-checkpoint",
        "a ViT (32px, patches of 8, width 64, 4 blocks) with gradient checkpointing",
        _loop(_ViT),
        adapter="GuardTuner",
        plain="model.compile()",
    ),
]
