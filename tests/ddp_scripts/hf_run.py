"""A Hugging Face ``Trainer`` run on 2 CPU processes (gloo, DDP through accelerate).

Started by ``tests/test_hf.py`` with ``python -m torch.distributed.run --nproc_per_node 2``.
Rank zero writes the logged losses, a digest of the final weights and (guarded) the
callback's summary as JSON to ``--out``. Nothing here imports pytest or the test suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from guardtrain import GuardTrainerCallback
from guardtrain.bench.hf_data import Tokens, pad, tiny_gpt2_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--guard", default=None)
    parser.add_argument("--steps", type=int, default=24)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    set_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config())
    callbacks: list[Any] = []
    if opts.guard:
        callbacks.append(
            GuardTrainerCallback(
                opts.guard,
                compile_kwargs={"backend": "aot_eager"},
                warmup_steps=4,
                stable_steps=2,
            )
        )
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            max_steps=opts.steps,
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
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Tokens(128, 0),
            data_collator=pad,
            callbacks=callbacks,
        )
        trainer.train()
    if trainer.args.process_index != 0:
        return
    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        digest.update(key.encode())
        digest.update(value.detach().contiguous().numpy().tobytes())
    result = {
        "world_size": trainer.args.world_size,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": digest.hexdigest(),
        "summary": callbacks[0].summary() if callbacks else None,
    }
    Path(opts.out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
