"""A Hugging Face ``Trainer`` run with GuardTrainerCallback: a tiny GPT-2, generated data.

    python examples/hf_trainer.py                   # aot_eager backend: quick
    python examples/hf_trainer.py --backend inductor
    python examples/hf_trainer.py --torch-compile   # TrainingArguments(torch_compile=True)
    python examples/hf_trainer.py --no-guard        # the same run without guardtrain

The model is built from a config with random weights (:data:`CONFIG`: 2 layers,
2 heads) and the data is random token ids of varying length, padded per batch
(:func:`pad`, as ``DataCollatorWithPadding`` does): no hub access, no tokenizer. The run prints the losses, the
evaluation loss and guardtrain's summary; ``main()`` returns the evaluation loss and the
summary.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from guardtrain import GuardTrainerCallback

#: A tiny GPT-2: 2 layers of width 64, 2 heads, 128 tokens, 64 positions.
CONFIG = {
    "vocab_size": 128,
    "n_positions": 64,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 2,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def pad(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``DataCollatorWithPadding``'s job: pad to the longest sequence of the batch, with an
    attention mask, and labels that ignore the padding (-100)."""
    n = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    mask = torch.zeros(len(items), n, dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, : len(x["input_ids"])] = x["input_ids"]
        mask[i, : len(x["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Tokens(torch.utils.data.Dataset):
    """Random token ids, 8 to 31 long."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(8, 32, (n,), generator=g)
        self.items = [torch.randint(1, 128, (int(n_),), generator=g) for n_ in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--preset", default="aggressive")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--torch-compile", action="store_true")
    parser.add_argument("--no-guard", action="store_true")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # the summary is printed
    torch.set_num_threads(1)
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    callbacks: list[Any] = []
    compile_args: dict[str, Any] = {}
    if opts.torch_compile:
        compile_args = {"torch_compile": True, "torch_compile_backend": opts.backend}
    guard = None
    if not opts.no_guard:
        kwargs = {} if opts.torch_compile else {"compile_kwargs": {"backend": opts.backend}}
        guard = GuardTrainerCallback(opts.preset, **kwargs)
        callbacks.append(guard)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            max_steps=opts.steps,
            per_device_train_batch_size=8,
            per_device_eval_batch_size=8,
            learning_rate=1e-3,
            logging_steps=10,
            eval_strategy="steps",
            eval_steps=opts.steps // 2,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            **compile_args,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Tokens(256, 0),
            eval_dataset=Tokens(32, 1),
            data_collator=pad,
            callbacks=callbacks,
        )
        trainer.train()
        metrics = trainer.evaluate()
    print(f"eval_loss {metrics['eval_loss']:.4f}")
    summary = None
    if guard is not None:
        print(guard.format_summary())
        guard.release()
        summary = guard.summary()
    return {"eval_loss": metrics["eval_loss"], "summary": summary}


if __name__ == "__main__":
    main()
