"""litgpt's ``GPT`` from a tiny ``litgpt.Config`` trained with Lightning Fabric, as
litgpt's own scripts do: ``L.Fabric(accelerator="cpu", devices=1)``, ``fabric.setup``
of the model and AdamW, ``fabric.backward``, litgpt's ``chunked_cross_entropy``.

The model: 4 layers (``--tiny``: 2), width 64, 4 heads, vocab 64, block size 64,
Llama-style (RMSNorm, ``LLaMAMLP`` of 128, no bias, rotary); 4 sequences of 32 token ids
a step. ``litgpt-fabric`` compiles the whole model (plain: ``torch.compile(model)`` before
``fabric.setup``, as litgpt's ``pretrain``; guardtrain: ``GuardTuner(model, preset,
fabric=fabric)`` on the set-up model); ``litgpt-fabric-regional`` compiles each block
(plain: ``block.compile()`` on each of ``model.transformer.h``; guardtrain:
``targets=["transformer.h.*"]``, one code object for the blocks, H24). Needs ``litgpt``.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.core import LoopJob, LoopRunner, Runner, Setting, Workload

__all__ = ["WORKLOADS", "tiny_config"]

SEQ, BATCH = 32, 4


def tiny_config(tiny: bool = False) -> Any:
    from litgpt import Config

    return Config(
        n_layer=2 if tiny else 4,
        n_head=4,
        n_query_groups=4,
        n_embd=64,
        block_size=64,
        vocab_size=64,
        padded_vocab_size=64,
        bias=False,
        intermediate_size=128,
        mlp_class_name="LLaMAMLP",
        norm_class_name="RMSNorm",
        rotary_percentage=1.0,
        parallel_residual=False,
    )


class _FabricJob(LoopJob):
    def __init__(self, setting: Setting, regional: bool) -> None:
        import lightning as L
        from litgpt import GPT

        self.regional = regional
        self.fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
        torch.manual_seed(0)
        model = GPT(tiny_config(setting.tiny))
        if setting.config == "compile":  # before fabric.setup, as litgpt does
            if regional:
                for block in model.transformer.h:
                    block.compile(backend=setting.backend)
            else:
                model = torch.compile(model, backend=setting.backend)  # type: ignore[assignment]
        opt = self.adamw(model.parameters(), 1e-3, setting)
        self.model, self.opt = self.fabric.setup(model, opt)
        if regional:
            self.tuner_kwargs = {"targets": ["transformer.h.*"]}
        g = torch.Generator().manual_seed(1)
        self.data = torch.randint(0, 64, (256, BATCH, SEQ + 1), generator=g)

    def batch(self, i: int) -> Any:
        return self.data[i % 256]

    def step(self, i: int) -> torch.Tensor:
        from litgpt.utils import chunked_cross_entropy

        ids = self.data[i % 256]
        return self.update(chunked_cross_entropy(self.model(ids[:, :-1]), ids[:, 1:]))

    def compile_plain(self, backend: str) -> None:
        """Done in ``__init__``: litgpt compiles before ``fabric.setup``."""


def _build(regional: bool) -> Any:
    def build(setting: Setting) -> Runner:
        return LoopRunner(setting, _FabricJob(setting, regional))

    return build


WORKLOADS = [
    Workload(
        "litgpt-fabric",
        "litgpt GPT (4 layers, width 64) under Lightning Fabric, compiled whole",
        _build(regional=False),
        adapter="GuardTuner(fabric=fabric)",
        plain="torch.compile(model), then fabric.setup",
        requires=("litgpt",),
    ),
    Workload(
        "litgpt-fabric-regional",
        "the same, each block compiled (regional)",
        _build(regional=True),
        adapter="GuardTuner(fabric=fabric, targets=['transformer.h.*'])",
        plain="block.compile() on each block, then fabric.setup",
        requires=("litgpt",),
    ),
]
