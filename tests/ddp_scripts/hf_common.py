"""What the Hugging Face ``Trainer`` scripts run on 2 CPU processes share.

``hf_run.py`` (DDP), ``hf_fsdp_run.py`` (FSDP2) and ``hf_deepspeed_run.py`` (ZeRO-2) each
train the tiny GPT-2 of :mod:`benchmarks.hf_data` with and without
``GuardTrainerCallback`` and write one JSON result per rank. Nothing here imports pytest
or the test suite.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from benchmarks.hf_data import Tokens, pad, tiny_gpt2_config
from guardtrain import GuardTrainerCallback


def options(steps: int) -> argparse.Namespace:
    """``--out`` (the result's path prefix), ``--guard`` (a preset, or none) and ``--steps``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--guard", default=None)
    parser.add_argument("--steps", type=int, default=steps)
    return parser.parse_args()


def model() -> GPT2LMHeadModel:
    """The tiny GPT-2, seeded, on one thread."""
    torch.set_num_threads(1)
    set_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config())


def callbacks(preset: str | None, **kwargs: Any) -> list[Any]:
    """``[GuardTrainerCallback(preset, aot_eager, warm-up 4, stable 2, **kwargs)]``, or []."""
    if not preset:
        return []
    values: dict[str, Any] = {
        "compile_kwargs": {"backend": "aot_eager"},
        "warmup_steps": 4,
        "stable_steps": 2,
    }
    values.update(kwargs)
    return [GuardTrainerCallback(preset, **values)]


def training_args(out: str, steps: int, **extra: Any) -> TrainingArguments:
    """On the CPU over gloo, batches of 4, the loss logged every step; ``extra`` adds
    arguments (``fsdp=``, ``deepspeed=``)."""
    return TrainingArguments(
        out,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        ddp_backend="gloo",
        **extra,
    )


def trainer(net: torch.nn.Module, args: TrainingArguments, n: int, found: list[Any]) -> Trainer:
    """A ``Trainer`` over ``n`` token sequences, padded per batch."""
    return Trainer(
        model=net, args=args, train_dataset=Tokens(n, 0), data_collator=pad, callbacks=found
    )


def losses(done: Trainer) -> list[float]:
    return [h["loss"] for h in done.state.log_history if "loss" in h]


def write(out: str, result: dict[str, Any]) -> None:
    """This rank's result, as ``OUT.rank{r}.json``."""
    Path(f"{out}.rank{result['rank']}.json").write_text(json.dumps(result, default=str))
