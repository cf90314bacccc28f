"""DPO with a peft LoRA adapter on a tiny Llama: the reference pass runs inside
``model.disable_adapter()`` (TRL's recipe without a reference model), which flips the
adapters' ``requires_grad`` off and back on in every step (H46).

The model, data and loss are those of ``tests/test_dpo.py``: ``LlamaConfig`` of vocab
64, width 32, MLP 64, 2 layers, 2 heads; LoRA ``r=4`` on ``q_proj`` and ``v_proj`` (its
``B`` moved off zero so that policy and reference differ); 4 sequences of 12 token ids a
step (2 chosen, then 2 rejected); TRL's sigmoid loss with ``beta=0.1``; AdamW on the
adapters, ``lr=1e-2``. Three drivers: a plain loop (``dpo-peft``), Lightning
(``dpo-peft-lightning``) and the HF ``Trainer`` with a ``compute_loss`` override
(``dpo-peft-hf``). Needs ``transformers`` and ``peft``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.core import (
    HFRunner,
    LightningRunner,
    LoopJob,
    LoopRunner,
    Runner,
    Setting,
    Workload,
)

__all__ = ["WORKLOADS", "dpo_loss", "pairs", "tiny_lora_llama"]

BETA = 0.1
LR = 1e-2
PAIRS = 4096
"""Sequences generated (a step takes 4; the data repeats after 1024 steps)."""


def tiny_lora_llama(seed: int = 0) -> Any:
    """The tiny Llama with its LoRA adapter (random weights, no hub)."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = peft.get_peft_model(
        LlamaForCausalLM(config),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    with torch.no_grad():  # LoRA's B starts at zero: move it off
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def pairs(n: int = PAIRS, seed: int = 1) -> torch.Tensor:
    """Token ids, 4 a step: 2 chosen then 2 rejected answers."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 64, (n, 12), generator=g)


def _step_ids(data: torch.Tensor, i: int) -> torch.Tensor:
    j = (4 * i) % len(data)
    return data[j : j + 4]


def _sequence_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = logits[:, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """TRL's sigmoid DPO loss: the policy pass, then the reference pass with the adapters
    disabled, under ``no_grad``."""
    policy = _sequence_logps(model(input_ids=ids).logits, ids)
    with torch.no_grad(), model.disable_adapter():
        reference = _sequence_logps(model(input_ids=ids).logits, ids)
    half = ids.shape[0] // 2
    chosen = policy[:half] - reference[:half]
    rejected = policy[half:] - reference[half:]
    return -torch.nn.functional.logsigmoid(BETA * (chosen - rejected)).mean()


def _adam(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


# -- a plain loop ----------------------------------------------------------------------------


class _DPOLoop(LoopJob):
    def __init__(self, setting: Setting) -> None:
        self.model = tiny_lora_llama()
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = self.adamw(trained, LR, setting)
        self.data = pairs()

    def batch(self, i: int) -> Any:
        return _step_ids(self.data, i)

    def step(self, i: int) -> torch.Tensor:
        return self.update(dpo_loss(self.model, _step_ids(self.data, i)))

    def compile_plain(self, backend: str) -> None:
        self.model.compile(backend=backend)


def _loop(setting: Setting) -> Runner:
    return LoopRunner(setting, _DPOLoop(setting))


# -- Lightning -------------------------------------------------------------------------------


def _lightning(setting: Setting) -> Runner:
    import lightning as L

    class DPOModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_lora_llama()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return dpo_loss(self.model, batch)

        def configure_optimizers(self) -> Any:
            return _adam(self)

    data = pairs()

    def compile_plain(module: Any, backend: str) -> None:
        module.model.compile(backend=backend)

    return LightningRunner(setting, DPOModule(), lambda i: _step_ids(data, i), compile_plain)


# -- the Hugging Face Trainer -----------------------------------------------------------------


class _Pairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.ids = pairs()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def hf_args(out: str, **extra: Any) -> Any:
    """The HF runs' ``TrainingArguments``: CPU, one log a step, no saves, no reports,
    a constant learning rate (the runner compiles, see :class:`HFRunner`)."""
    from transformers import TrainingArguments

    values: dict[str, Any] = {
        "output_dir": out,
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
        "seed": 0,
    }
    values.update(extra)
    return TrainingArguments(**values)


def scratch_dir(name: str) -> str:
    """A folder for a Trainer's ``output_dir`` (nothing is saved there)."""
    import tempfile

    return str(Path(tempfile.gettempdir()) / "guardtrain-workloads" / name)


def _hf(setting: Setting) -> Runner:
    from transformers import Trainer

    class DPOTrainer(Trainer):  # type: ignore[misc]
        """TRL's DPO step as a ``compute_loss`` override: two model calls a step."""

        def compute_loss(  # type: ignore[override]
            self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any
        ) -> Any:
            loss = dpo_loss(model, inputs["input_ids"])
            return (loss, None) if return_outputs else loss

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)  # type: ignore[arg-type]

    model = tiny_lora_llama()

    def make(callbacks: list[Any]) -> Any:
        args = hf_args(scratch_dir(f"dpo-peft-hf-{setting.config}"))
        return DPOTrainer(model=model, args=args, train_dataset=_Pairs(), callbacks=callbacks)

    return HFRunner(setting, make, calls_per_step=2)


_REQUIRES = ("transformers", "peft")

WORKLOADS = [
    Workload(
        "dpo-peft",
        "DPO, peft LoRA on a tiny Llama, reference pass in disable_adapter(); plain loop",
        _loop,
        adapter="GuardTuner",
        plain="model.compile()",
        requires=_REQUIRES,
    ),
    Workload(
        "dpo-peft-lightning",
        "the same DPO step as a LightningModule's training_step (automatic optimization)",
        _lightning,
        adapter="GuardTuneCallback",
        framework_step="Lightning's step passes a closure, which PyTorch's recipe cannot compile",
        plain="self.model.compile() (the peft model)",
        requires=(*_REQUIRES, "lightning"),
    ),
    Workload(
        "dpo-peft-hf",
        "the same DPO step in the HF Trainer, a compute_loss override (2 model calls a step)",
        _hf,
        adapter="GuardTrainerCallback",
        framework_step="the HF Trainer makes and steps the optimizer itself",
        plain="model.compile() on the Trainer's model (see HFRunner)",
        requires=(*_REQUIRES, "accelerate"),
        calls_per_step=2,
    ),
]
