"""Models nobody here wrote: transformers' GPT-2 and BERT, against eager runs.

Small configs, random weights, no hub access; dropout on (transformers' default
0.1), the aot_eager backend. Losses and final weights are compared bitwise.

* GPT-2 called with labels computes its own loss, which breaks the graph on
  ``logger.warning_once`` (H20): the default target is split into its parts and
  the run still reaches the stance; the warning and the summary name the break's
  file and line.
* A classification head sets ``config.problem_type`` on its first call with
  labels (H25): whatever names it says ``model.config.problem_type``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from helpers import guard, make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

transformers = pytest.importorskip("transformers")

from benchmarks.hf_data import tiny_bert_config  # noqa: E402

AOT_EAGER = {"backend": "aot_eager"}
VOCAB = 64


def gpt2_lm() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32
    )
    assert min(config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) > 0
    return transformers.GPT2LMHeadModel(config)


def bert_classifier() -> nn.Module:
    config = tiny_bert_config(vocab_size=VOCAB)
    assert config.hidden_dropout_prob > 0 and config.problem_type is None
    return transformers.BertForSequenceClassification(config)


class HFModule(L.LightningModule):
    """Calls the HF model with labels, so that it computes its own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.train_losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        loss = self.model(input_ids=ids, labels=labels).loss
        self.train_losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tokens(rows: int, classes: int | None) -> TensorDataset:
    """Random token ids (16 per row); labels are the ids (a language model) or classes."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (rows, 16), generator=g)
    labels = ids if classes is None else torch.randint(0, classes, (rows,), generator=g)
    return TensorDataset(ids, labels)


MODELS: dict[str, tuple[Callable[[], nn.Module], TensorDataset, int]] = {
    # name: (model, data, epochs); batches of 16
    "gpt2": (gpt2_lm, tokens(16 * 16, None), 3),
    "bert": (bert_classifier, tokens(8 * 16, 3), 2),
}
_EAGER: dict[str, HFModule] = {}


def fit(name: str, callback: L.Callback | None) -> HFModule:
    build, data, epochs = MODELS[name]
    L.seed_everything(0, verbose=False)
    module = HFModule(build())
    trainer = make_trainer([callback] if callback else [], max_epochs=epochs)
    trainer.fit(module, DataLoader(data, batch_size=16))
    return module


def eager(name: str) -> HFModule:
    """The uncompiled run without the callback, once per model for all its tests."""
    if name not in _EAGER:
        _EAGER[name] = fit(name, None)
    return _EAGER[name]


def assert_eager_equal(name: str, guarded: HFModule) -> None:
    reference = eager(name)
    assert len(guarded.train_losses) == len(reference.train_losses)
    for i, (a, b) in enumerate(zip(reference.train_losses, guarded.train_losses)):
        assert torch.equal(a, b), f"loss {i}: eager {a.item()} vs guarded {b.item()}"
    expected = reference.state_dict()
    for key, value in guarded.state_dict().items():
        assert torch.equal(expected[key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["balanced", "aggressive", "turbo"])
def test_gpt2_with_its_own_loss_reaches_the_stance(preset: str) -> None:
    """H20: 3 epochs of 16 batches; at least half under the stance, bitwise equal to eager."""
    cb = guard(preset, warmup_steps=5, stable_steps=2, compile_kwargs=AOT_EAGER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded = fit("gpt2", cb)
    assert_eager_equal("gpt2", guarded)
    s = cb.summary()
    assert len(guarded.train_losses) == 48
    assert s["steady_steps"] >= 24, s
    assert s["stance_blocked"] is None
    if not hasattr(transformers.PreTrainedModel, "loss_function"):
        return  # transformers<4.46 computes GPT-2's loss inline: no break
    # transformers 5.x: `loss_function` calls `logger.warning_once`.
    [split] = s["graph_breaks"]
    assert split["target"] == "model" and split["reason"] != "unknown", split
    assert re.fullmatch(r"transformers/modeling_utils\.py:\d+ in loss_function", split["where"])
    assert split["regions"] == s["targets"] == ["model.transformer", "model.lm_head"]
    named = f"({split['reason']} at {split['where']})"
    warned = [str(w.message) for w in caught if "breaks the graph" in str(w.message)]
    assert warned == [
        f"guardtrain: 'model' breaks the graph {named}; compiling its parts "
        "instead: ['model.transformer', 'model.lm_head']. Pass `targets=` to "
        "choose the regions yourself."
    ], warned


@pytest.mark.parametrize("preset", ["balanced", "aggressive", "turbo"])
def test_a_classification_head_setting_problem_type_is_named_by_its_path(preset: str) -> None:
    """H25: BERT sets ``config.problem_type`` on its first call; every re-arm reason and
    compile event that mentions it names ``model.config.problem_type``; equal to eager."""
    cb = guard(preset, compile_kwargs=AOT_EAGER)
    guarded = fit("bert", cb)
    assert guarded.model.config.problem_type == "single_label_classification"
    assert_eager_equal("bert", guarded)
    s = cb.summary()
    texts = [r["reason"] for r in s["rearms"]] + [e["reason"] for e in s["compile_events"]]
    assert not any("bound.__self__" in t or "L[" in t or "_modules[" in t for t in texts), texts
    named = [t for t in texts if "problem_type" in t]
    assert named and all("model.config.problem_type" in t for t in named), texts
    assert s["graph_breaks"] == [] and s["steady_steps"] > 0, s
