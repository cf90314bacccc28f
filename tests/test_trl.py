"""TRL's trainers under ``GuardTrainerCallback``: ``SFTTrainer``, ``DPOTrainer`` with a peft
LoRA adapter, and ``GRPOTrainer`` generating with the model itself (``use_vllm=False``).

Each runs twice from the same seeds on a tiny Llama (1 layer, random weights) with a
word-level tokenizer built in code: without guardtrain (eager, nothing compiled), and
under the callback with ``aot_eager`` (bitwise equal to eager on the CPU; the Llama has
no dropout), under ``aggressive`` and ``turbo``. Each is asked for:

(a) **eager-equal**, bitwise: every value of every logged step (loss, grad norm, entropy,
    rewards; the timings left out), the weights after training, and for GRPO every
    completion, token for token (the reward function records them);
(b) **steady**: after warm-up at least :data:`STEADY` of the model calls ran under the
    stance (:func:`~hf_helpers.steady_share`), ``generate()``'s decode calls among them
    (H53, ``summary()["decode_calls"]``); only the calls whose entry breaks the graph (a
    mixed target's training passes) ran with full guards
    (``summary()["full_guard_calls"]``). Without the callback in the ``Trainer`` both
    fail (nothing ran under the stance);
(c) **bounded compiles**: at most the compile margin above what plain ``model.compile()``
    of the same model compiles in the same run (:class:`~helpers.PlainCompile`), and
    nothing compiled again unless the model changes (DPO's hook on ``embed_tokens``).

What TRL does here (trl 1.16, transformers 5.24, peft 0.21; docs/hf.md, "TRL"):

* TRL's configs default to ``bf16=True`` (autocast on the CPU too) and
  ``gradient_checkpointing=True``; both stay, but for GRPO (below).
* The default target is the whole ``LlamaForCausalLM``. TRL patches its ``forward`` with
  a fused LM head (``fused_lm_head=True``) that breaks the graph, so in SFT and DPO, where
  every call breaks, it is split into the base model and ``lm_head`` (H20); the training
  passes use ``lm_head``'s weight, never call the module, so ``lm_head`` runs uncompiled
  (one warning).
* ``DPOTrainer`` with ``peft_config`` runs two calls a step: the policy pass, then the
  reference pass inside ``disable_adapter()`` (``requires_grad`` flipped off and back
  on, H46), with gradient checkpointing switched off and back on around it. Each switch
  on adds one more forward hook on ``embed_tokens`` (H47), which rebuilds the base model;
  after 3 rebuilds within 8 calls it is split into its parts and ``embed_tokens``, whose
  hooks keep changing, is handed over to full guards alone (H51); the layer and the norm
  stay steady.
* ``GRPOTrainer`` generates its completions with ``model.generate()`` in training mode
  (a ``GenerationConfig`` with ``disable_compile=True``): each step is 8 calls of the
  model (prefill and 7 decode steps) and one training pass. ``gradient_checkpointing``
  is off here: TRL switches it off and on twice a step (two more hooks on
  ``embed_tokens``), the model is rebuilt in every step, and as a step is 9 calls only
  its compile margin hands over the base model that holds the hooks (H51)
  (:func:`test_grpo_with_gradient_checkpointing`, slow). The training pass breaks at TRL's
  fused head while the decode calls compile whole: the model is kept whole (mixed), its
  decode calls run directly (turbo, auto) or under the stance (aggressive) and its
  training pass with full guards, and nothing is compiled again for the break. With a
  peft adapter,
  ``generate()`` calls the base model without the peft model's ``forward``; with
  ``beta > 0`` a reference pass follows inside ``disable_adapter()``. (Without peft, TRL
  loads its reference model by name from the Hub, which these tests cannot reach.)
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

from helpers import PlainCompile, assert_compiles_bounded, first_then_slow  # noqa: E402
from hf_helpers import guard, steady_share  # noqa: E402
from transformers import Cache, LlamaForCausalLM, TrainerCallback  # noqa: E402

from benchmarks.hf_data import tiny_llama_config  # noqa: E402
from benchmarks.trl_dpo import WORDS, preference_data, word_tokenizer  # noqa: E402
from guardtrain import versions  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # transformers 5's gradient_checkpointing
    pytest.mark.filterwarnings("ignore::UserWarning:peft.*"),
    # What TRL makes guardtrain say, asserted through summary() where it matters: the fused
    # head (lm_head never called), DPO's hook on embed_tokens (a graph break, then H51).
    pytest.mark.filterwarnings("ignore:guardtrain. target.s. .'.*lm_head'. ran uncompiled"),
    pytest.mark.filterwarnings("ignore:guardtrain. .* breaks the graph"),
    pytest.mark.filterwarnings("ignore:guardtrain. .* runs with full guards for the rest"),
    pytest.mark.filterwarnings("ignore:guardtrain. .* was rebuilt .* compiling its parts"),
]

PRESETS = first_then_slow("auto", "aggressive", "turbo")
STEADY = 0.75
"""The share of the model calls after warm-up that must run under the stance (measured:
0.83 to 1.0)."""
COMPLETION = 8
"""GRPO's ``max_completion_length``: 8 calls of the model per ``generate()``."""
TIMING = re.compile(r"time|per_second")
"""Logged keys that are timings, not results."""
KERNELS = importlib.util.find_spec("kernels") is not None
"""transformers with ``kernels`` installed (transformers 5.25 depends on it): Llama's
attention then sets a ``kernels`` context variable on each call, which Dynamo refuses
inside gradient checkpointing, so every decoder layer breaks its graph, under plain
compile too, and the split graphs' backward differs from eager's in its last bits
(docs/versions.md, "transformers 5.25"). Runs with checkpointing (SFT and DPO, TRL's
default) are then compared with the same run under ``off`` (every guard, no lever), not
with eager; and DPO's base model, whose training passes break while its reference
passes (checkpointing off) compile whole, is kept whole: its training passes run with
full guards."""
EXACT = versions.release() < (2, 15)
"""``aot_eager`` gives eager's results bitwise on torch 2.13. On 2.15 the compiled backward's
numerics differ from eager's (the embedding's gradient by 4e-9 in the first step); after
14 SFT steps the weights differ by up to 4e-6 (6e-5 of the largest weight) and the logs
by 8e-5 relative, identical under ``off`` (every guard kept) and ``aggressive``: not a
stale entry. There the comparison is ``allclose``."""


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One intra-op thread for this module's runs (eager and guarded alike), put back
    after it: on a loaded 2-core machine torch's thread pool made a tiny Llama's forward
    about 15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = tiny_llama_config(num_hidden_layers=1)
    return LlamaForCausalLM(config)


def words(n: int, lengths: tuple[int, int], seed: int = 1) -> list[str]:
    """``n`` texts of ``w0`` .. ``w59``, each ``lengths[0]`` to ``lengths[1] - 1`` words."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(*lengths, (1,), generator=g))
        out.append(" ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (k,), generator=g)))
    return out


def config(cls: type, out: Path, steps: int, **overrides: Any) -> Any:
    """A TRL config for the tests: CPU, no reports, no saves, one log per step; TRL's own
    defaults otherwise (``bf16``, ``gradient_checkpointing``)."""
    values: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": steps,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    values.update(overrides)
    return cls(**values)


class Record(TrainerCallback):  # type: ignore[misc]
    """Counts the calls of the ``Trainer``'s model that carry a transformers ``Cache``
    (``generate()``'s), with a forward pre-hook put on the model when training starts."""

    def __init__(self) -> None:
        self.generate_calls = 0
        self.handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        model = kw["model"]
        # A peft model's generate() calls its base model, not the peft model's forward.
        called = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.handle = called.register_forward_pre_hook(self.count, with_kwargs=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.handle.remove()

    def count(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if any(isinstance(v, Cache) for v in kwargs.values()):
            self.generate_calls += 1


def outermost_pretrained(model: Any) -> Any:
    """The outermost ``PreTrainedModel`` in ``model``: the callback's default target, and
    what plain compile compiles here."""
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


def run(tmp_path: Path, name: str, make: Any, preset: str | None, warmup: int) -> dict[str, Any]:
    """``make(out, callbacks)`` builds the trainer; trains it and returns what it did.
    ``preset``: None for eager, ``"plain"`` for plain ``model.compile()`` of the default
    target (its compiles in ``"plain_compiles"``)."""
    record = Record()
    callbacks: list[Any] = [record]
    cb = None
    plain = PlainCompile()
    if preset not in (None, "plain"):
        cb = guard(preset, warmup_steps=warmup, audit_every=None)
        callbacks.append(cb)
    trainer = make(tmp_path / f"{name}-{preset or 'eager'}", callbacks)
    if preset == "plain":
        plain.compile(outermost_pretrained(trainer.model))
    with plain:
        trainer.train()
    return {
        "logs": [
            {k: v for k, v in h.items() if not TIMING.search(k)} for h in trainer.state.log_history
        ],
        "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "hooks": len(trainer.model.get_input_embeddings()._forward_hooks),
        "generate_calls": record.generate_calls,
        "summary": cb.summary() if cb is not None else None,
        "steady_share": steady_share(cb) if cb is not None else None,
        "trainer": trainer,
        "plain_compiles": plain.compiles,
    }


def assert_eager_equal(eager: dict[str, Any], got: dict[str, Any], steps: int) -> None:
    """Every logged value and every weight: bitwise where :data:`EXACT`, else allclose."""
    assert len([h for h in eager["logs"] if "loss" in h]) == steps
    for i, (a, b) in enumerate(zip(eager["logs"], got["logs"], strict=True)):
        assert a == (b if EXACT else pytest.approx(b, rel=1e-3)), f"log {i} differs: {a} != {b}"
    assert list(eager["weights"]) == list(got["weights"])

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if EXACT else torch.allclose(a, b, rtol=1e-4, atol=2e-5)

    differ = [k for k in eager["weights"] if not same(eager["weights"][k], got["weights"][k])]
    assert not differ, f"weights differ from eager: {differ}"


def assert_steady(got: dict[str, Any], served: int = 0, full_guards: int = 0) -> None:
    """(b): after warm-up most model calls under the stance (turbo: run directly), at most
    ``full_guards`` with full guards under it (a target whose training forward breaks the
    graph, kept whole under turbo: those calls), and at least ``served`` of ``generate()``'s
    calls served."""
    s = got["summary"]
    why = (got["steady_share"], s["steady_steps"], [r["reason"] for r in s["rearms"]])
    assert s["phase"] == "steady", why
    assert got["steady_share"] >= STEADY, why
    assert s["full_guard_calls"] <= full_guards, (s["full_guard_calls"], why)
    decode = s["decode_calls"]
    assert decode["served"] + decode["full_guards"] == got["generate_calls"], decode
    assert decode["served"] >= served, (decode, why)
    if s["preset"] == "turbo":
        direct = s["direct_dispatch"]
        assert direct["on"], direct
        assert direct["calls"] >= s["steady_steps"] - s["full_guard_calls"], (direct, why)


# -- SFT ---------------------------------------------------------------------------------------

SFT_STEPS = 14


def make_sft(out: Path, callbacks: list[Any]) -> Any:
    args = config(trl.SFTConfig, out, SFT_STEPS, learning_rate=1e-3, max_length=32)
    data = datasets.Dataset.from_dict({"text": words(64, (6, 14))})
    return trl.SFTTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=data,
        processing_class=word_tokenizer(),
        callbacks=callbacks,
    )


CHECKPOINTED_REFERENCE = "off" if KERNELS else None
"""The run that SFT and DPO (gradient checkpointing on) compare with: eager, or ``off`` where
:data:`KERNELS` breaks the graph in every checkpointed layer."""


@pytest.fixture(scope="module")
def sft_eager(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sft")
    eager = run(tmp, "sft", make_sft, CHECKPOINTED_REFERENCE, 4)
    eager["plain_compiles"] = run(tmp, "sft", make_sft, "plain", 0)["plain_compiles"]
    return eager


@pytest.mark.parametrize("preset", PRESETS)
def test_sft(tmp_path: Path, sft_eager: dict[str, Any], preset: str) -> None:
    """One call a step; dynamic padding (texts of 6 to 13 words)."""
    got = run(tmp_path, "sft", make_sft, preset, warmup=4)
    assert_eager_equal(sft_eager, got, SFT_STEPS)
    assert got["generate_calls"] == 0
    assert_steady(got)
    assert_compiles_bounded(got["summary"], sft_eager["plain_compiles"])


# -- DPO with a peft adapter -------------------------------------------------------------------

DPO_STEPS = 20


LORA = peft.LoraConfig(
    r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"
)
"""The adapter of the DPO and GRPO runs with peft."""


def make_dpo(out: Path, callbacks: list[Any]) -> Any:
    """TRL's defaults: gradient checkpointing on, bf16; no reference model (peft)."""
    args = config(trl.DPOConfig, out, DPO_STEPS, max_length=32)
    return trl.DPOTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=preference_data(64),
        processing_class=word_tokenizer(),
        peft_config=LORA,
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def dpo_eager(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("dpo")
    eager = run(tmp, "dpo", make_dpo, CHECKPOINTED_REFERENCE, 8)
    eager["plain_compiles"] = run(tmp, "dpo", make_dpo, "plain", 0)["plain_compiles"]
    return eager


@pytest.mark.parametrize("preset", PRESETS)
def test_dpo_with_a_peft_adapter(tmp_path: Path, dpo_eager: dict[str, Any], preset: str) -> None:
    """Two calls a step (policy, then reference inside ``disable_adapter()``); TRL's
    gradient-checkpointing switch adds a hook on ``embed_tokens`` every step (H47)."""
    got = run(tmp_path, "dpo", make_dpo, preset, warmup=8)  # 4 steps
    eager = dpo_eager
    assert got["trainer"].args.gradient_checkpointing  # TRL's default
    assert_eager_equal(eager, got, DPO_STEPS)
    # The hooks really are added, in both runs alike: 2 before the first step, 1 a step.
    assert got["hooks"] == eager["hooks"] == DPO_STEPS + 2
    s = got["summary"]
    flips = s["caught_changes"].get("requires_grad", {}).get("count", 0)
    # disable_adapter() every step (H46), caught in each step but the first, which the
    # split of the whole model at the hook's break re-arms (H20).
    assert flips >= DPO_STEPS - 1, s["caught_changes"]
    # H51 confined: the base model, rebuilt for embed_tokens's hooks, is split into its
    # parts and embed_tokens alone is handed over; the layer and the norm stay steady.
    (handed,) = s["full_guard_targets"]
    assert handed["target"] == "base_model.model.model.embed_tokens", handed
    # Named from the part that changed: the base model, or embed_tokens itself where the
    # split at the graph break made it a part.
    assert re.search(r"forward hook was added to '[\w.]*embed_tokens'", handed["change"]), handed
    assert got["generate_calls"] == 0
    assert_steady(got, full_guards=DPO_STEPS if KERNELS else 0)
    # The hooks make the entries stale: rebuilt within the compile margin, then confined.
    assert_compiles_bounded(s, eager["plain_compiles"], again=True)


# -- GRPO, generating with the model -----------------------------------------------------------

GRPO_STEPS = 6
GRPO_STEADY = 0.8
"""GRPO's share of model calls after warm-up that run steady (its training passes with
full guards among them): the issue's goal for a fused head that breaks the graph."""
GRPO_CALLS = COMPLETION + 1
"""Calls of the model a GRPO step: ``generate()``'s, then the training pass."""


def make_grpo(
    out: Path,
    callbacks: list[Any],
    *,
    steps: int = GRPO_STEPS,
    checkpointing: bool = False,
    lora: bool = False,
    beta: float = 0.0,
) -> Any:
    """2 prompts of 3 to 6 words a step (left-padded), 2 completions each, sampled; with
    ``lora`` a peft LoRA adapter (``peft_config``), with ``beta`` a KL term against the
    reference model (with the adapter: its pass inside ``disable_adapter()``)."""
    completions: list[list[list[int]]] = []

    def reward(completion_ids: list[list[int]], **kw: Any) -> list[float]:
        """Even word ids are good (the ids are what the model generated, as in eager)."""
        completions.append([list(c) for c in completion_ids])
        return [float(sum(t % 2 == 0 for t in c)) for c in completion_ids]

    args = config(
        trl.GRPOConfig,
        out,
        steps,
        use_vllm=False,
        num_generations=2,
        max_completion_length=COMPLETION,
        gradient_checkpointing=checkpointing,
        beta=beta,
    )
    trainer = trl.GRPOTrainer(
        model=tiny_llama(),
        reward_funcs=reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": words(32, (3, 7))}),
        processing_class=word_tokenizer(),
        callbacks=callbacks,
        peft_config=LORA if lora else None,
    )
    trainer.completions = completions
    return trainer


def grpo_run(tmp: Path, preset: str | None, **make: Any) -> dict[str, Any]:
    """A GRPO run; warm-up: 2 steps."""
    got = run(tmp, "grpo", functools.partial(make_grpo, **make), preset, 2 * GRPO_CALLS)
    got["completions"] = got["trainer"].completions
    return got


def grpo_baseline(tmp: Path, **make: Any) -> dict[str, Any]:
    """The eager GRPO run, with plain compile's compiles of the same run."""
    eager = grpo_run(tmp, None, **make)
    eager["plain_compiles"] = grpo_run(tmp, "plain", **make)["plain_compiles"]
    return eager


@pytest.fixture(scope="module")
def grpo_eager(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return grpo_baseline(tmp_path_factory.mktemp("grpo"))


def assert_same_completions(eager: dict[str, Any], got: dict[str, Any], steps: int) -> None:
    assert len(eager["completions"]) == steps
    assert all(len(c) == 4 for c in eager["completions"])
    for i, (a, b) in enumerate(zip(eager["completions"], got["completions"], strict=True)):
        assert a == b, f"completions of step {i} differ from eager"


@pytest.mark.parametrize("preset", PRESETS)
def test_grpo_generating_with_the_model(
    tmp_path: Path, grpo_eager: dict[str, Any], preset: str
) -> None:
    got = grpo_run(tmp_path, preset)
    eager = grpo_eager
    assert not got["trainer"].use_vllm
    assert got["trainer"].generation_config.disable_compile  # TRL's, see the docstring
    assert_same_completions(eager, got, GRPO_STEPS)
    assert_eager_equal(eager, got, GRPO_STEPS)
    # The rewards vary within a group, so the policy moves: a real training run.
    assert any(h.get("reward_std", 0) > 0 for h in got["logs"]), got["logs"]
    assert got["generate_calls"] == eager["generate_calls"] == GRPO_STEPS * COMPLETION
    # generate()'s calls after the warm-up are served (H53), but where a step's prompts
    # bring a new padded length (a prefill shape compiled once more). The training forward
    # breaks the graph (TRL's chunked log-probabilities): the model is kept whole, those
    # calls run with full guards, and nothing is compiled again for the break.
    s = got["summary"]
    assert s["targets"] == ["<model>"] and s["graph_breaks"] == [], s
    assert [m["target"] for m in s["mixed_targets"]] == ["<model>"], s["mixed_targets"]
    if preset != "aggressive":
        assert s["direct_dispatch"]["broken_targets"] == ["<model>"]
    assert_steady(got, served=COMPLETION, full_guards=GRPO_STEPS)
    assert got["steady_share"] >= GRPO_STEADY, got["steady_share"]
    assert_compiles_bounded(s, eager["plain_compiles"])


GRPO_REFERENCE_STEPS = 8


@pytest.fixture(scope="module")
def grpo_reference_eager(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("grpo-reference")
    return grpo_baseline(tmp, lora=True, beta=0.04, steps=GRPO_REFERENCE_STEPS)


@pytest.mark.parametrize("preset", PRESETS)
def test_grpo_with_a_peft_adapter_and_a_reference_pass(
    tmp_path: Path, grpo_reference_eager: dict[str, Any], preset: str
) -> None:
    """A peft LoRA adapter and ``beta > 0``: each step's reference pass runs inside
    ``disable_adapter()`` (``requires_grad`` flipped off and back on, H46), and
    ``generate()`` calls the base model, not the peft model's ``forward``: its calls are
    batches of their own (the callback hooks the base model too) and are served (H53)."""
    steps = GRPO_REFERENCE_STEPS
    got = grpo_run(tmp_path, preset, lora=True, beta=0.04, steps=steps)
    eager = grpo_reference_eager
    assert_same_completions(eager, got, steps)
    assert_eager_equal(eager, got, steps)
    assert any("kl" in h for h in got["logs"]), got["logs"]  # the reference pass ran
    assert got["generate_calls"] == eager["generate_calls"] == steps * COMPLETION
    s = got["summary"]
    flips = s["caught_changes"].get("requires_grad", {}).get("count", 0)
    assert flips >= steps, s["caught_changes"]  # disable_adapter() every step (H46)
    # The model is kept whole (mixed): its training and reference passes, whose entries
    # break at TRL's fused head, run with full guards; the decode calls steady.
    assert_steady(got, served=(steps - 4) * COMPLETION, full_guards=2 * steps)
    assert_compiles_bounded(s, eager["plain_compiles"])


@pytest.mark.slow  # 1.5 to 5 minutes here: a rebuild and Dynamo's recompiles in every step
def test_grpo_with_gradient_checkpointing(tmp_path: Path) -> None:
    """TRL's default, ``gradient_checkpointing=True``: TRL switches it off and back on
    around each ``generate()`` and around the block that would compute the old and the
    reference log-probabilities (no model call here: one iteration, ``beta=0``), and each
    switch on adds a forward hook on ``embed_tokens`` (H47): 2 a step. The hook does not
    break the graph here (no peft: the embeddings train, their output already requires
    grad), so the base model's entries go stale in every step. Once one more rebuild
    would go past its compile margin, the base model is handed over to full guards, and
    Dynamo's recompile limit then bounds its compiles, as under plain compile.
    Eager-equal throughout."""
    steps = 12
    eager = grpo_run(tmp_path, None, steps=steps, checkpointing=True)
    got = grpo_run(tmp_path, "aggressive", steps=steps, checkpointing=True)
    assert got["trainer"].args.gradient_checkpointing
    assert got["hooks"] == eager["hooks"] == 1 + 2 * steps
    assert_same_completions(eager, got, steps)
    assert_eager_equal(eager, got, steps)
    s = got["summary"]
    print(
        f"compiles {s['compiles']}, steady share {got['steady_share']:.2f}:",
        s["full_guard_targets"],
    )
    (handed,) = s["full_guard_targets"]
    # The target that holds the hooks: the base model (torch 2.13), or its embeddings where
    # the base model was split at a graph break first (torch 2.15).
    assert handed["target"] in ("model", "model.embed_tokens"), handed
    assert "past the margin of 4 compiles above plain compile" in handed["why"], handed
    assert "forward hook" in handed["change"], handed
