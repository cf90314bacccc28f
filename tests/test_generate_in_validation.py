"""A LightningModule whose ``validation_step`` calls ``model.generate()`` under
``GuardTuneCallback``: a tiny Hugging Face Llama (1 layer, random weights) trained as a
language model, and in each validation batch a validation loss and 6 greedy tokens
generated after the first 6 of each sequence.

The default target is the Llama (the module's one child with parameters), so every call
of it is a compiled call: the training passes, the validation passes, and each of
``generate()``'s calls (the prefill and 5 decode steps, in evaluation mode under
``no_grad``). Against the same run without guardtrain (``aot_eager``, bitwise):

(a) training losses, validation losses, every generated token, and the weights after
    training;
(b) steady: both loops reach the steady state, after warm-up at least :data:`STEADY` of
    the training steps run under the stance, no call runs with full guards under it, and
    ``generate()``'s calls after the validation loop's warm-up are served: each carries a
    transformers ``DynamicCache``, which the argument key describes (H53), so they run
    under the stance or directly (``summary()["decode_calls"]``). Without the callback
    both fail.
(c) bounded compiles: no more than the compile margin above plain ``model.compile()``'s
    compiles in the same run (:class:`~helpers.PlainCompile`), nothing compiled again.

With gradient checkpointing on (``gradient_checkpointing_enable()``), every training
forward breaks the graph (transformers warns once that ``use_cache`` does not go with
checkpointing, and Dynamo cannot trace the logger) while the validation passes and
``generate()``'s calls compile whole: the target is kept whole (mixed), its training calls
run with full guards, the others steady, and nothing is compiled again for the break.
Before, the break rebuilt the model without its levers and compiled every entry again: 21
compiles against plain compile's 10.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import PlainCompile, assert_compiles_bounded, guard_without_lookup, make_trainer

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM

from benchmarks.hf_data import tiny_llama_config

pytestmark = pytest.mark.filterwarnings("ignore:guardtrain. 'model' breaks the graph")

PRESETS = ["auto", "aggressive", "turbo"]
AOT = {"backend": "aot_eager"}
EPOCHS = 3
WARMUP = 3
PROMPT = 6
NEW_TOKENS = 6
STEADY = 0.75
"""The share of the training steps after warm-up that must run under the stance."""


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One intra-op thread for this module's runs (eager and guarded alike), put back
    after it: on a loaded 2-core machine torch's thread pool made a tiny Llama's forward
    about 15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class GenerateInValidation(L.LightningModule):
    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = tiny_llama_config(num_hidden_layers=1)
        self.model = LlamaForCausalLM(config)
        if checkpointing:
            # transformers 5 names it `activation_checkpointing_enable` (the old name warns).
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)()
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.generated: list[list[list[int]]] = []
        self.generate_calls = 0
        """Calls of the model that ``generate()`` made (1 + a decode step per new token
        after the first)."""
        self.plain_compiles = 0
        """Frame compiles of plain ``model.compile()`` in the run (:func:`run`)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (ids,) = batch
        self.val_losses.append(self.model(input_ids=ids, labels=ids).loss.item())
        prompt = ids[:, :PROMPT]
        out = self.model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        self.generated.append(out[:, PROMPT:].tolist())
        self.generate_calls += out.shape[1] - PROMPT

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loaders() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1)
    train = torch.randint(4, 64, (32, 12), generator=g)
    val = torch.randint(4, 64, (8, 12), generator=g)

    def loader(x: torch.Tensor) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

    return loader(train), loader(val)


def run(preset: str | None, checkpointing: bool = False) -> tuple[GenerateInValidation, Any]:
    """A run under ``preset``; ``None``: eager, ``"plain"``: plain ``model.compile()``
    (its compiles in ``module.plain_compiles``)."""
    module = GenerateInValidation(checkpointing)
    callbacks = []
    plain = PlainCompile()
    if preset == "plain":
        plain.compile(module.model, **AOT)
    elif preset is not None:
        callbacks = [
            guard_without_lookup(
                preset, compile_kwargs=AOT, warmup_steps=WARMUP, stable_steps=2, audit_every=None
            )
        ]
    L.seed_everything(0, verbose=False)
    with plain:
        make_trainer(callbacks, max_epochs=EPOCHS).fit(module, *loaders())
    module.plain_compiles = plain.compiles
    return module, callbacks[0].summary() if callbacks else None


@pytest.fixture(scope="module", params=[False, True], ids=["", "checkpointing"])
def baseline(request: pytest.FixtureRequest) -> tuple[bool, GenerateInValidation, int]:
    """``(checkpointing, the eager run, plain compile's compiles)``."""
    checkpointing = request.param
    return checkpointing, run(None, checkpointing)[0], run("plain", checkpointing)[0].plain_compiles


@pytest.mark.parametrize("preset", PRESETS)
def test_generate_in_validation_step(baseline: tuple[bool, Any, int], preset: str) -> None:
    checkpointing, eager, plain = baseline
    got, s = run(preset, checkpointing)
    # (a) eager-equal.
    assert len(got.losses) == EPOCHS * 8
    assert got.losses == eager.losses
    assert got.val_losses == eager.val_losses
    # The sanity check's 2 batches, then 2 an epoch; every token.
    assert len(got.generated) == 2 + 2 * EPOCHS
    assert got.generated == eager.generated
    assert got.generate_calls == eager.generate_calls == len(got.generated) * NEW_TOKENS
    for (name, a), b in zip(eager.state_dict().items(), got.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # (b) steady.
    assert s is not None
    why = (s["steady_steps"], s["phases"], [r["reason"] for r in s["rearms"]])
    assert s["phase"] == "steady" and s["phases"]["validate"] == "steady", why
    assert s["steady_steps"] >= STEADY * (len(got.losses) - WARMUP), why
    # With checkpointing the training calls break the graph: those (one a step) run with
    # full guards, the validation passes and generate()'s calls steady.
    assert s["full_guard_calls"] <= (s["steady_steps"] if checkpointing else 0), why
    assert [m["target"] for m in s["mixed_targets"]] == (["model"] if checkpointing else [])
    decode = s["decode_calls"]
    assert decode["served"] + decode["full_guards"] == got.generate_calls, decode
    # The sanity check and the first epoch compile and warm up the validation loop; the
    # later epochs' generate() calls are each served.
    assert decode["served"] >= (EPOCHS - 1) * 2 * NEW_TOKENS, (decode, why)
    if preset != "aggressive":
        direct = s["direct_dispatch"]
        assert direct["calls"] >= s["steady_steps"] - s["full_guard_calls"], direct
    # (c) bounded compiles.
    assert_compiles_bounded(s, plain)
