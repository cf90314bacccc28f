"""Rollouts inside training: ``generate()`` with the policy itself, then an update (H53).

* ``rollout``: a plain loop with :class:`~guardtrain.GuardTuner`. The tiny Llama of
  :func:`~benchmarks.hf_data.tiny_llama_config` (2 layers, width 32); each step
  ``model.eval()``, ``generate()`` under ``no_grad`` (4 left-padded prompts of 5 to 8
  tokens, 16 new tokens sampled with ``top_k=8``), then ``model.train()``, a language-model
  loss on prompts and rollouts, AdamW. ``tuner.step`` spans both. Plain compile:
  ``model.compile()``.
* ``grpo``: TRL's ``GRPOTrainer`` generating with the model itself (``use_vllm=False``), the
  tiny Llama of the TRL tests (1 layer), the word-level tokenizer of
  :mod:`.trl_dpo`, 4 prompts of 3 to 6 words a step and 4 generations each, 16 completion
  tokens, a reward function in code; TRL's defaults but ``gradient_checkpointing=False``
  (TRL switches it off and on around each ``generate()``, and transformers then adds a
  hook to the input embeddings every step, H47). Needs ``trl``, ``datasets`` and
  ``tokenizers``. Two GRPO trainers that alternate in one process do not repeat each
  other's samples (eager beside eager neither), so the suite's loss comparison differs
  there; the completions' equality with eager is tested one trainer at a time
  (``tests/test_trl.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.core import (
    HFRunner,
    LoopJob,
    LoopRunner,
    Runner,
    Setting,
    Workload,
)
from benchmarks.dpo import scratch_dir
from benchmarks.hf_data import tiny_llama_config

__all__ = ["WORKLOADS", "prompts"]

NEW_TOKENS = 16
"""Tokens generated per prompt: a ``generate()`` is this many model calls."""


def prompts(i: int, n: int = 4, lengths: tuple[int, int] = (5, 9)) -> tuple[Any, Any]:
    """Step ``i``'s ``n`` prompts of ``lengths[0]`` to ``lengths[1] - 1`` token ids in
    ``[4, 64)``, left-padded with 0 to the longest, and their attention mask."""
    g = torch.Generator().manual_seed(i)
    sizes = torch.randint(*lengths, (n,), generator=g).tolist()
    width = max(sizes)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, k in enumerate(sizes):
        ids[row, width - k :] = torch.randint(4, 64, (k,), generator=g)
        mask[row, width - k :] = 1
    return ids, mask


class _Rollout(LoopJob):
    def __init__(self, setting: Setting) -> None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        layers = 1 if setting.tiny else 2
        self.model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers))
        self.opt = self.adamw(self.model.parameters(), 1e-3, setting)
        self.new_tokens = 4 if setting.tiny else NEW_TOKENS

    def batch(self, i: int) -> Any:
        return prompts(i)

    def step(self, i: int) -> torch.Tensor:
        model: Any = self.model
        ids, mask = prompts(i)
        model.eval()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=self.new_tokens,
                min_new_tokens=self.new_tokens,
                do_sample=True,
                top_k=8,
                pad_token_id=0,
            )
        model.train()
        full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1] :])], 1)
        return self.update(model(input_ids=out, attention_mask=full_mask, labels=out).loss)

    def compile_plain(self, backend: str) -> None:
        self.model.compile(backend=backend)


def _rollout(setting: Setting) -> Runner:
    return LoopRunner(setting, _Rollout(setting))


def _grpo(setting: Setting) -> Runner:
    import datasets
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.trl_dpo import WORDS, word_tokenizer

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1))
    g = torch.Generator().manual_seed(1)
    texts = []
    for _ in range(256):
        k = int(torch.randint(3, 7, (1,), generator=g))
        texts.append(" ".join(f"w{int(t)}" for t in torch.randint(0, WORDS, (k,), generator=g)))
    data = datasets.Dataset.from_dict({"prompt": texts})
    completion = 4 if setting.tiny else NEW_TOKENS

    def reward(completion_ids: list[list[int]], **kw: Any) -> list[float | None]:
        return [float(sum(t % 2 == 0 for t in c)) for c in completion_ids]

    def make(callbacks: list[Any]) -> Any:
        args = GRPOConfig(
            output_dir=scratch_dir(f"grpo-{setting.config}"),
            max_steps=1,
            per_device_train_batch_size=16,
            num_generations=4,
            max_completion_length=completion,
            use_vllm=False,
            gradient_checkpointing=False,
            learning_rate=1e-3,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        return GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=word_tokenizer(),
            callbacks=callbacks,
        )

    runner = HFRunner(setting, make, calls_per_step=completion + 1)
    runner.notes.append(f"TRL's config: bf16={runner.trainer.args.bf16}")
    return runner


WORKLOADS = [
    Workload(
        "rollout",
        "generate() of 16 tokens in eval() under no_grad, then a train() update, each step",
        _rollout,
        adapter="GuardTuner",
        plain="model.compile()",
        requires=("transformers",),
        steps=8,
        tiny_steps=2,
    ),
    Workload(
        "grpo",
        "TRL's GRPOTrainer (use_vllm=False): 4 prompts x 4 generations of 16 tokens a step",
        _grpo,
        adapter="GuardTrainerCallback",
        framework_step="the HF Trainer makes and steps the optimizer itself",
        plain="model.compile() on the GRPOTrainer's model (see HFRunner)",
        requires=("trl", "datasets", "tokenizers"),
        steps=8,
        tiny_steps=2,
        calls_per_step=NEW_TOKENS + 1,
    ),
]
