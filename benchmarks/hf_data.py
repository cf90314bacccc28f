"""Tiny Hugging Face model configs and generated token data (no hub, no tokenizer).

What the workloads, the Hugging Face tests and their multi-process scripts and the cost
scripts build their runs from; :func:`tiny_gpt2` is a model factory for ``guardtrain
bench --model benchmarks.hf_data:tiny_gpt2`` run from the checkout. Needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "Tokens",
    "pad",
    "tiny_bert_config",
    "tiny_gpt2",
    "tiny_gpt2_config",
    "tiny_llama_config",
]


def tiny_gpt2_config(**extra: Any) -> Any:
    """A ``GPT2Config`` of 2 layers, width 32, 2 heads, 64 tokens; ``extra`` overrides."""
    from transformers import GPT2Config

    values: dict[str, Any] = {
        "vocab_size": 64,
        "n_positions": 64,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    values.update(extra)
    return GPT2Config(**values)


def tiny_llama_config(**extra: Any) -> Any:
    """A ``LlamaConfig`` of 2 layers, width 32 (MLP 64), 2 heads, 64 tokens and positions,
    with the word tokenizer's pad, bos and eos ids (0, 2, 3); ``extra`` overrides."""
    from transformers import LlamaConfig

    values: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
    }
    values.update(extra)
    return LlamaConfig(**values)


def tiny_bert_config(**extra: Any) -> Any:
    """A ``BertConfig`` for sequence classification: 2 layers, width 32, 2 heads, 64
    tokens, 32 positions, 3 labels; ``extra`` overrides."""
    from transformers import BertConfig

    values: dict[str, Any] = {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 64,
        "max_position_embeddings": 32,
        "num_labels": 3,
    }
    values.update(extra)
    return BertConfig(**values)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``n`` sequences of random token ids in ``[1, 64)``, seeded; their lengths cycle
    through ``lengths`` (for dynamic padding). Items are ``{"input_ids": ids}``."""

    def __init__(self, n: int, seed: int = 0, lengths: tuple[int, ...] = (16,)) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [
            torch.randint(1, 64, (lengths[i % len(lengths)],), generator=g) for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


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


def tiny_gpt2(
    n_layer: int = 2, n_embd: int = 32, vocab_size: int = 64, seq_len: int = 16
) -> tuple[nn.Module, torch.Tensor]:
    """A tiny Hugging Face GPT-2 from a config (random weights, no hub access) and a batch
    of token ids: ``guardtrain bench --model benchmarks.hf_data:tiny_gpt2`` from the checkout.

    The model returns a ``CausalLMOutput`` (the bench uses its logits); no KV cache is
    returned (``use_cache=False``)."""
    from transformers import GPT2LMHeadModel

    config = tiny_gpt2_config(
        vocab_size=vocab_size,
        n_positions=max(64, seq_len),
        n_embd=n_embd,
        n_layer=n_layer,
        use_cache=False,
    )
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab_size, (4, seq_len), generator=torch.Generator().manual_seed(0))
    return model, ids
