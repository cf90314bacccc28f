"""``generate()`` inside training under ``GuardTuner``: its prefill and decode calls served (H53).

Each call of ``generate()``'s model carries a transformers ``Cache``. guardtrain describes
the cache in the call's argument key (its class, attribute names, plain values and the
layers' tensors), so the calls run under the stance, or directly under turbo and ``auto``,
and a growing cache length is served by the entry Dynamo compiled with a symbolic length
(its shape guards decide each call). A tiny Llama (2 layers, random weights, no dropout),
``aot_eager`` (bitwise equal to eager on the CPU), compared token by token with the same
run without guardtrain:

* greedy and sampled (``top_k``, ``temperature``) generation, prompts of one length and
  left-padded prompts of different lengths, each ``generate()`` a ``tuner.loop("predict")``
  pass: at least :data:`SERVED` of the calls after warm-up run under the stance or
  directly (``summary()["decode_calls"]``);
* a rollout loop: ``eval()``, ``generate()`` under ``no_grad``, ``train()`` and an update on
  the rollouts, in one ``tuner.step``: every rollout after an optimizer step uses the new
  weights, the mode flips are swaps (H46);
* changes in the middle of a generation (a decode loop by hand): the cache's class, its
  tensors' dtype, a layer added, ``use_cache=False`` on one call, and a prompt longer than
  any before. Each gives eager's tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from helpers import (
    PlainCompile,
    assert_compiles_bounded,
    assert_restored,
    first_then_slow,
    guard_tuner,
)
from torch import nn

pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from benchmarks.hf_data import tiny_llama_config

AOT = {"backend": "aot_eager"}
PRESETS = first_then_slow("auto", "aggressive", "turbo")
NEW_TOKENS = 10
"""Model calls per ``generate()``: the prefill, then a decode call per further token."""
PASSES = 6
SERVED = 0.9
"""The share of the calls after the predict loop's warm-up (two passes: one compiles, one
runs with full guards) that must run under the stance or directly."""


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One intra-op thread for this module's runs, put back after it (a tiny Llama's
    forward on a loaded 2-core machine is many times slower with torch's thread pool)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def prompts(lengths: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, left-padded with 0 (as TRL pads), and their mask."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, k in enumerate(lengths):
        ids[i, n - k :] = torch.randint(4, 64, (k,), generator=g)
        mask[i, n - k :] = 1
    return ids, mask


def generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, sample: bool) -> torch.Tensor:
    """``NEW_TOKENS`` new tokens per prompt, greedy or sampled (the seed set first)."""
    torch.manual_seed(7)
    extra: dict[str, Any] = {"top_k": 8, "temperature": 0.7} if sample else {}
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
            do_sample=sample,
            **extra,
        )
    return out if model.config.is_encoder_decoder else out[:, ids.shape[1] :]


def guarded_or_plain(model: nn.Module, preset: str | None, **kwargs: Any) -> tuple[Any, Any]:
    """``(tuner, context)`` for a run under ``preset``: a :func:`guard_tuner` and itself;
    for ``"plain"``, no tuner and a :class:`~helpers.PlainCompile` of ``model``; for None
    (eager), neither."""
    if preset == "plain":
        plain = PlainCompile()
        plain.compile(model, **AOT)
        return None, plain
    if preset is None:
        return None, contextlib.nullcontext()
    tuner = guard_tuner(model, preset, compile_kwargs=AOT, **kwargs)
    return tuner, tuner


def outcome(tuner: Any, context: Any) -> dict[str, Any] | None:
    """The tuner's summary, or plain compile's compiles (``{"compiles": n}``)."""
    if isinstance(context, PlainCompile):
        return {"compiles": context.compiles}
    return tuner.summary() if tuner else None


def predict_passes(
    preset: str | None, batches: list[tuple[torch.Tensor, torch.Tensor]], sample: bool
) -> tuple[list[torch.Tensor], dict[str, Any] | None]:
    """One ``generate()`` per batch, each a ``tuner.loop("predict")`` pass."""
    model = tiny_llama()
    tuner, context = guarded_or_plain(model, preset)
    out = []
    with context:
        for ids, mask in batches:
            if tuner is None:
                out.append(generate(model, ids, mask, sample))
                continue
            with tuner.loop("predict"), tuner.step((ids, mask)):
                out.append(generate(model, ids, mask, sample))
    if preset != "plain":
        assert_restored(model)
    return out, outcome(tuner, context)


def assert_served(s: dict[str, Any], calls: int, warmup_calls: int) -> None:
    """Every call carried a cache; after warm-up at least :data:`SERVED` were served, and
    under turbo's levers directly."""
    decode = s["decode_calls"]
    assert decode["served"] + decode["full_guards"] == calls, decode
    assert decode["served"] >= SERVED * (calls - warmup_calls), (decode, s["rearms"])
    assert s["full_guard_calls"] == 0, s["full_guard_calls"]
    if s["preset"] != "aggressive":
        assert s["direct_dispatch"]["calls"] >= decode["served"], s["direct_dispatch"]


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("preset", PRESETS)
def test_generate_is_served(preset: str, sample: bool) -> None:
    """Four prompts of 8 tokens, greedy or sampled: the prefill, the first decode call and
    the later ones (a symbolic cache length) are each served, every token eager's."""
    batches = [prompts((8, 8, 8, 8), seed=i) for i in range(PASSES)]
    eager, _ = predict_passes(None, batches, sample)
    got, s = predict_passes(preset, batches, sample)
    for i, (a, b) in enumerate(zip(eager, got, strict=True)):
        assert torch.equal(a, b), f"generate() {i}: tokens differ from eager"
    assert s is not None
    assert s["phases"]["predict"] == "steady", s["rearms"]
    assert_served(s, PASSES * NEW_TOKENS, 2 * NEW_TOKENS)
    _, plain = predict_passes("plain", batches, sample)
    assert plain is not None
    assert_compiles_bounded(s, plain["compiles"])


@pytest.mark.parametrize("preset", PRESETS)
def test_left_padded_prompts_of_different_lengths(preset: str) -> None:
    """Left-padded prompts of 2 to 9 tokens, sampled: the padded length changes between
    passes (a new prefill shape, compiled once more, then symbolic): no entry per length,
    no more compiles than plain compile's and the margin."""
    lengths = [(3, 5, 8, 4), (6, 2, 7, 5), (9, 3, 4, 6), (5, 3, 2, 4), (7, 4, 6, 3), (4, 6, 5, 3)]
    batches = [prompts(x, seed=i) for i, x in enumerate(lengths)]
    eager, _ = predict_passes(None, batches, sample=True)
    got, s = predict_passes(preset, batches, sample=True)
    for i, (a, b) in enumerate(zip(eager, got, strict=True)):
        assert torch.equal(a, b), f"generate() {i}: tokens differ from eager"
    assert s is not None
    decode = s["decode_calls"]
    assert decode["served"] + decode["full_guards"] == PASSES * NEW_TOKENS, decode
    assert decode["served"] >= NEW_TOKENS, (decode, s["rearms"])
    # Five padded lengths (9, 8, 7, 6, 5) and many more cache lengths: fewer entries.
    assert s["compiles"] < len({max(x) for x in lengths}), s["compile_events"]
    _, plain = predict_passes("plain", batches, sample=True)
    assert plain is not None
    assert_compiles_bounded(s, plain["compiles"])


def tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        dropout_rate=0.0,
    )
    return T5ForConditionalGeneration(config).eval()


@pytest.mark.parametrize("preset", first_then_slow("turbo", "aggressive"))
def test_an_encoder_decoder_model(preset: str) -> None:
    """A tiny T5: each decoder call carries an ``EncoderDecoderCache`` and the encoder's
    output (a ``ModelOutput``), both described by the key; served, tokens eager's."""

    def passes(preset: str | None) -> tuple[list[torch.Tensor], dict[str, Any] | None]:
        model = tiny_t5()
        tuner = guard_tuner(model, preset, compile_kwargs=AOT) if preset else None
        out = []
        with tuner if tuner is not None else contextlib.nullcontext():
            for i in range(PASSES):
                ids, mask = prompts((8, 8, 8, 8), seed=i)
                loop = tuner.loop("predict") if tuner else contextlib.nullcontext()
                with loop, tuner.step(ids) if tuner else contextlib.nullcontext():
                    out.append(generate(model, ids, mask, sample=False))
        assert_restored(model)
        return out, tuner.summary() if tuner else None

    eager, _ = passes(None)
    got, s = passes(preset)
    for i, (a, b) in enumerate(zip(eager, got, strict=True)):
        assert torch.equal(a, b), f"generate() {i}: tokens differ from eager"
    assert s is not None
    # T5's generate() calls the decoder once per token (the encoder runs on its own).
    assert_served(s, PASSES * NEW_TOKENS, 2 * NEW_TOKENS)


# -- rollouts and updates in one step ----------------------------------------------------------


def rollout_loop(preset: str | None, steps: int = 8) -> tuple[list[Any], dict[str, Any] | None]:
    """Each step: ``eval()``, sampled rollouts under ``no_grad``, ``train()``, a language-model
    loss on the rollouts and an optimizer step, all inside one ``tuner.step`` (no lookup
    window: its steps would run with full guards)."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tuner, context = guarded_or_plain(model, preset, measure_lookup=False)
    record: list[Any] = []
    with context:
        for i in range(steps):
            ids, mask = prompts((5, 8, 6, 8), seed=i)
            with tuner.step((ids, mask)) if tuner else contextlib.nullcontext():
                model.eval()
                completions = generate(model, ids, mask, sample=True)
                model.train()
                full = torch.cat([ids, completions], 1)
                loss = model(input_ids=full, labels=full).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
            record.append((completions, loss.item()))
    if preset != "plain":
        assert_restored(model)
    return record, outcome(tuner, context)


@pytest.mark.parametrize("preset", PRESETS)
def test_rollouts_after_updates_use_the_new_weights(preset: str) -> None:
    """Every rollout and loss equal to eager's: a rollout after an optimizer step samples
    from the updated weights. ``eval()`` / ``train()`` every step are swaps (H46), and the
    rollouts are served once the loop is steady."""
    eager, _ = rollout_loop(None)
    got, s = rollout_loop(preset)
    for i, ((ca, la), (cb, lb)) in enumerate(zip(eager, got, strict=True)):
        assert torch.equal(ca, cb), f"step {i}: rollout differs from eager"
        assert la == lb, f"step {i}: loss {lb} != eager {la}"
    assert s is not None
    assert s["phase"] == "steady", s["rearms"]
    assert s["steady_steps"] >= 3, (s["steady_steps"], s["rearms"])
    assert s["state_swaps"] >= 2 * s["steady_steps"], s["state_swaps"]
    assert s["decode_calls"]["served"] == NEW_TOKENS * s["steady_steps"], s["decode_calls"]
    _, plain = rollout_loop("plain")
    assert plain is not None
    assert_compiles_bounded(s, plain["compiles"])


# -- changes in the middle of a generation -----------------------------------------------------


class Scaled(DynamicCache):
    """A cache class of its own whose stored values are doubled: another class must not run
    code compiled for ``DynamicCache``."""

    def update(
        self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kw: Any
    ) -> Any:
        return super().update(key_states, value_states * 2, layer_idx, *args, **kw)


def decode_by_hand(
    model: nn.Module, ids: torch.Tensor, steps: int, change: Any, at: int
) -> list[Any]:
    """Greedy decoding with a cache made by hand: ``change(cache, i)`` before call ``at``
    returns the cache and the call's keyword arguments to use."""
    cache = DynamicCache(config=model.config)
    seq, out = ids, []
    for i in range(steps):
        kwargs: dict[str, Any] = {"input_ids": ids, "cache": cache, "use_cache": True}
        if i == at:
            cache, kwargs = change(cache, seq, kwargs)
        with torch.no_grad():
            logits = model(**kwargs).logits[:, -1]
        ids = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, ids], 1)
        out.append(ids)
    return out


def another_class(cache: Any, seq: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    cache.__class__ = Scaled  # the same object, another class
    return cache, kwargs


def a_layer_added(cache: Any, seq: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    cache.layers.append(DynamicLayer())
    return cache, kwargs


def without_the_cache(cache: Any, seq: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """One call with ``use_cache=False`` on the whole sequence so far; the cache goes on."""
    return cache, {"input_ids": seq, "use_cache": False}


CHANGES = {"another class": another_class, "a layer added": a_layer_added}
CHANGES["use_cache=False"] = without_the_cache


def by_hand(preset: str | None, change: Any) -> tuple[list[Any], dict[str, Any] | None]:
    """Six decodes by hand of 8 tokens each, the last one changed at its 5th call."""
    model = tiny_llama()
    tuner = guard_tuner(model, preset, compile_kwargs=AOT) if preset else None
    out = []
    with tuner if tuner is not None else contextlib.nullcontext():
        for i in range(6):
            ids, _ = prompts((8, 8, 8, 8), seed=i)
            loop = tuner.loop("predict") if tuner else contextlib.nullcontext()
            with loop, tuner.step(ids) if tuner else contextlib.nullcontext():
                out.append(decode_by_hand(model, ids, 8, change, at=4 if i == 5 else -1))
    assert_restored(model)
    return out, tuner.summary() if tuner else None


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("preset", first_then_slow("turbo", "aggressive"))
def test_a_change_in_the_middle_of_a_generation(preset: str, change: str) -> None:
    """The last decode's cache changes at its 5th call, after the loop is steady: every
    token equal to eager's under the same change."""
    eager, _ = by_hand(None, CHANGES[change])
    got, s = by_hand(preset, CHANGES[change])
    for i, (a, b) in enumerate(zip(eager, got, strict=True)):
        for j, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"decode {i}, call {j}: token differs from eager"
    assert s is not None
    assert s["decode_calls"]["served"] >= 8, s["decode_calls"]


@pytest.mark.parametrize("preset", first_then_slow("turbo", "aggressive"))
def test_a_prompt_longer_than_any_before(preset: str) -> None:
    """After passes with prompts of 8 tokens, one of 20: a new prefill shape and cache
    lengths never seen; tokens equal to eager's."""
    batches = [prompts((8, 8, 8, 8), seed=i) for i in range(4)]
    batches.append(prompts((20, 20, 20, 20), seed=9))
    batches.append(prompts((8, 8, 8, 8), seed=10))
    eager, _ = predict_passes(None, batches, sample=False)
    got, s = predict_passes(preset, batches, sample=False)
    for i, (a, b) in enumerate(zip(eager, got, strict=True)):
        assert torch.equal(a, b), f"generate() {i}: tokens differ from eager"
    assert s is not None
    # The passes before the long prompt are served; the long one compiles (a re-arm).
    assert s["decode_calls"]["served"] >= NEW_TOKENS, (s["decode_calls"], s["rearms"])


# -- a cache's tensors of another dtype, on a module that reads every layer --------------------


class ReadsTheCache(nn.Module):
    """Adds its input to layer 0 of a transformers cache and reads every layer back."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        keys, _ = cache.update(x, x, 0)
        total = keys.sum(-2) * self.w
        for layer in cache.layers[1:]:
            if layer.is_initialized:
                total = total + layer.keys.sum(-2)
        return total


def cache_calls(preset: str | None, change: str) -> list[torch.Tensor]:
    module = ReadsTheCache()
    tuner = guard_tuner(module, preset, compile_kwargs=AOT) if preset else None
    out = []
    with tuner if tuner is not None else contextlib.nullcontext():
        for step in range(8):
            cache = DynamicCache()
            with tuner.step(torch.zeros(1)) if tuner else contextlib.nullcontext(), torch.no_grad():
                for i in range(6):
                    if step == 7 and i == 3:
                        if change == "dtype":
                            layer = cache.layers[0]
                            layer.keys, layer.values = layer.keys.double(), layer.values.double()
                        else:  # a second layer, filled
                            cache.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), 1)
                    x = torch.full((1, 1, 1, 4), float(i + step))
                    out.append(module(x, cache))
    return out


@pytest.mark.parametrize("change", ["dtype", "a layer added"])
@pytest.mark.parametrize("preset", first_then_slow("turbo", "aggressive"))
def test_the_caches_tensors_change_dtype_or_a_layer_is_added(preset: str, change: str) -> None:
    """A growing cache of float32, then in the last step float64 (the result promotes to
    float64) or a second layer: results equal to eager's, dtype included."""
    eager = cache_calls(None, change)
    got = cache_calls(preset, change)
    for i, (a, b) in enumerate(zip(eager, got, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"call {i}: {b} != eager {a}"
