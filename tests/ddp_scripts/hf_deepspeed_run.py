"""A Hugging Face ``Trainer`` run on 2 CPU processes under DeepSpeed ZeRO-2 (gloo).

Started by ``tests/test_hf.py`` with ``python -m torch.distributed.run --nproc_per_node 2``
and ``DS_ACCELERATOR=cpu``, when ``deepspeed`` can be imported.
``TrainingArguments(deepspeed={...}, use_cpu=True)``: accelerate makes its
``DeepSpeedPlugin`` and the Trainer trains through ``deepspeed.initialize``. Every rank
writes ``OUT.rank{r}.json``: the accelerate state's kind, the wrapped model's class, the
logged losses, the callback's ``switched_off`` and summary, the forward hooks on the model,
and the guardtrain warnings it got. Nothing here imports pytest or the test suite.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from guardtrain import GuardTrainerCallback
from guardtrain.bench.hf_data import Tokens, pad, tiny_gpt2_config

ZERO2 = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--guard", default=None)
    parser.add_argument("--steps", type=int, default=6)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    set_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config())
    callbacks: list[Any] = []
    if opts.guard:
        callbacks.append(
            GuardTrainerCallback(
                opts.guard, compile_kwargs={"backend": "aot_eager"}, warmup_steps=2
            )
        )
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
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
            deepspeed=ZERO2,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Tokens(64, 0),
            data_collator=pad,
            callbacks=callbacks,
        )
        trainer.train()
    state = trainer.accelerator.state
    cb = callbacks[0] if callbacks else None
    result = {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "distributed_type": str(state.distributed_type.value),
        "zero_stage": getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", None),
        "model_class": type(trainer.model_wrapped).__name__,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "switched_off": cb.switched_off if cb else None,
        "summary": cb.summary() if cb else None,
        "hooks": [
            f"{getattr(h, '__module__', '?')}.{getattr(h, '__qualname__', type(h).__qualname__)}"
            for h in [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
        ],
        "warnings": [str(w.message) for w in caught if "guardtrain" in str(w.message)],
    }
    Path(f"{opts.out}.rank{result['rank']}.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
