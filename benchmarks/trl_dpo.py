"""TRL's ``DPOTrainer`` with a peft adapter (``peft_config``) on the tiny Llama of
:mod:`.dpo`, a word-level tokenizer built in code (60 words and 4 special tokens) and 256
generated preference pairs (prompts of 5 words, answers of 4).

TRL's own defaults stay (``gradient_checkpointing=True``, ``bf16`` where it applies), but
for ``lr=1e-3`` (constant), ``max_length=32`` and batches of 4 pairs. With gradient
checkpointing on, TRL switches it off and on around each reference pass and transformers
adds one more forward hook on the input embeddings each time (H47): the model changes in
every step, and guardtrain rebuilds a target and recompiles in every step (even with
``aot_eager``, each step then takes seconds). ``--tiny`` therefore turns gradient checkpointing off
(:func:`runner` takes it as an argument). Needs ``trl``, ``peft``, ``datasets`` and
``tokenizers``.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.core import HFRunner, Runner, Setting, Turn, Workload
from benchmarks.dpo import scratch_dir
from benchmarks.hf_data import tiny_llama_config

__all__ = ["WORKLOADS", "preference_data", "runner", "word_tokenizer"]

WORDS = 60


def word_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over ``w0`` .. ``w59`` and ``<pad> <unk> <bos> <eos>``
    (ids 0-3), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<bos>", "<eos>"] + [f"w{i}" for i in range(WORDS)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def preference_data(n: int = 256, seed: int = 1) -> Any:
    """A ``datasets.Dataset`` of ``prompt``, ``chosen`` and ``rejected`` texts."""
    import datasets

    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (k,), generator=g))

    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        rows["prompt"].append(words(5))
        rows["chosen"].append(" " + words(4))
        rows["rejected"].append(" " + words(4))
    return datasets.Dataset.from_dict(rows)


def runner(setting: Setting, gradient_checkpointing: bool | None = None) -> Runner:
    """One configuration of ``dpo-trl``; ``gradient_checkpointing``: None keeps TRL's
    default (on), except with ``setting.tiny`` (off)."""
    import datasets
    import peft
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    data = preference_data()
    tokenizer = word_tokenizer()

    if gradient_checkpointing is None and setting.tiny:
        gradient_checkpointing = False
    extra: dict[str, Any] = {}
    if gradient_checkpointing is not None:
        extra["gradient_checkpointing"] = gradient_checkpointing

    def make(callbacks: list[Any]) -> Any:
        args = DPOConfig(
            output_dir=scratch_dir(f"dpo-trl-{setting.config}"),
            max_steps=1,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            max_length=32,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            **extra,
        )
        return DPOTrainer(
            model=model,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=callbacks,
        )

    return _TRLRunner(setting, make)


class _TRLRunner(HFRunner):
    """The HF runner; after each turn, the count of forward hooks on the input embeddings
    (H47) goes into the notes."""

    def __init__(self, setting: Setting, make: Any) -> None:
        super().__init__(setting, make, calls_per_step=2)
        args = self.trainer.args
        self.notes.append(
            f"TRL's config: gradient_checkpointing={args.gradient_checkpointing}, bf16={args.bf16}"
        )
        self.embeddings = self.trainer.model.get_input_embeddings()

    def turn(self, settle: int, timed: int, seed: int) -> Turn:
        turn = super().turn(settle, timed, seed)
        hooks = len(self.embeddings._forward_hooks)
        self.notes[1:] = [f"forward hooks on the input embeddings after the last turn: {hooks}"]
        return turn


WORKLOADS = [
    Workload(
        "dpo-trl",
        "TRL's DPOTrainer, peft LoRA (peft_config), tokenizer built in code, TRL's defaults",
        runner,
        adapter="GuardTrainerCallback",
        framework_step="the HF Trainer makes and steps the optimizer itself",
        plain="model.compile() on the DPOTrainer's (peft) model (see HFRunner)",
        requires=("trl", "peft", "datasets", "tokenizers"),
        inductor=(
            "every step adds a forward hook on the input embeddings (H47): plain compile "
            "recompiles until its limit (61 frame compiles, 199 s of inductor warm-up here) "
            "and guardtrain rebuilds a target and recompiles in every step"
        ),
        steps=8,
        tiny_steps=2,
        calls_per_step=2,
    ),
]
