"""GuardTrainerCallback in a Hugging Face ``Trainer`` (H38): every run against an eager run.

A tiny GPT-2 from a config (random weights, no hub access), generated token ids,
``aot_eager`` (bitwise equal to eager on the CPU, dropout included). Each guarded run is
compared with an eager ``Trainer`` run of the same seeds: losses, evaluation metrics and
final weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers import first_then_slow  # noqa: E402
from hf_helpers import (  # noqa: E402
    AOT,
    DEEPSPEED,
    STEPS,
    assert_put_back,
    assert_same_weights,
    eval_losses,
    guard,
    losses,
    make_args,
    run_pair,
    steady_share,
    tiny_model,
    trainer_for,
)
from transformers import (  # noqa: E402
    GPT2LMHeadModel,
    GPT2Model,
    Trainer,
    TrainerCallback,
    set_seed,
)

from benchmarks.hf_data import Tokens, tiny_bert_config  # noqa: E402
from guardtrain import GuardTrainerCallback  # noqa: E402
from guardtrain.engine.process import stance_is_unsafe  # noqa: E402
from guardtrain.hf import default_targets, regional_targets  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# -- the basics --------------------------------------------------------------------------------


def test_import_guardtrain_does_not_import_transformers() -> None:
    code = (
        "import sys, guardtrain; assert 'transformers' not in sys.modules, 'imported'; "
        "cls = guardtrain.GuardTrainerCallback; assert 'transformers' in sys.modules; "
        "print(cls.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "GuardTrainerCallback"


def test_same_keyword_arguments_as_the_lightning_callback() -> None:
    import inspect

    from guardtrain import GuardTuneCallback
    from guardtrain.errors import GuardTrainValueError

    ours = inspect.signature(GuardTrainerCallback).parameters
    theirs = inspect.signature(GuardTuneCallback).parameters
    assert [(p.name, p.default, p.kind) for p in ours.values()] == [
        (p.name, p.default, p.kind) for p in theirs.values()
    ]
    with pytest.raises(GuardTrainValueError, match="warmup_steps"):
        GuardTrainerCallback(warmup_steps=-1)


def test_default_and_regional_targets() -> None:
    model = tiny_model()
    assert default_targets(model) == [""]
    assert default_targets(tiny_model(cls=GPT2Model)) == [""]
    assert default_targets(torch.nn.Sequential(tiny_model())) == ["0"]
    assert default_targets(torch.nn.Linear(2, 2)) is None
    assert regional_targets(model) == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]


def test_equal_to_eager_with_evaluation(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = guard(measure_lookup=True)
    eval_args = {"eval_strategy": "steps", "eval_steps": 8}
    eager = trainer_for(tmp_path / "eager", **eval_args)
    eager.train()
    guarded = trainer_for(tmp_path / "guarded", [cb], **eval_args)
    with caplog.at_level("INFO", logger="guardtrain"):
        guarded.train()
    assert losses(guarded) == losses(eager)
    assert len(eval_losses(eager)) == 3
    assert eval_losses(guarded) == eval_losses(eager)
    assert_same_weights(guarded.model, eager.model)
    s = cb.summary()
    # The default target is the whole model; GPT-2's loss breaks the graph (its
    # `loss_function` logs a warning for the class name `GPT2LMHeadModel`): it is split
    # into its base model and head in the first step, the one re-arm.
    assert [b["target"] for b in s["graph_breaks"]] == ["<model>"], s["graph_breaks"]
    assert s["targets"] == ["transformer", "lm_head"]
    assert s["phases"]["train"] == "steady" and s["phases"]["validate"] == "steady"
    assert [r["step"] for r in s["rearms"]] == [1], s["rearms"]
    assert "graph break" in s["rearms"][0]["reason"]
    assert steady_share(cb) >= 0.8, s
    assert_put_back(cb, guarded.model)
    logged = [r for r in caplog.records if "guardtrain summary" in r.getMessage()]
    assert len(logged) == 1
    # Saved models keep their keys and values.
    guarded.save_model(str(tmp_path / "saved"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    reference = {k: v for k, v in eager.model.state_dict().items() if k in saved}
    assert sorted(saved) == sorted(reference)
    assert all(torch.equal(saved[k], reference[k]) for k in saved)


def test_gradient_accumulation_counts_forward_calls(tmp_path: Path) -> None:
    cb = guard(warmup_steps=6)
    eager, guarded = run_pair(tmp_path, cb, gradient_accumulation_steps=2, max_steps=12)
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    s = cb.summary()
    assert cb.engine.train_batches() == 24  # forward calls, not optimizer steps
    assert s["warmup_steps_taken"] == 6
    assert steady_share(cb) >= 0.8


def test_dynamic_padding_stays_steady(tmp_path: Path) -> None:
    lengths = tuple(range(6, 30, 2))  # 12 padded lengths
    cb = guard(warmup_steps=4, stable_steps=2)
    eager, guarded = run_pair(
        tmp_path, cb, lengths=lengths, per_device_train_batch_size=1, max_steps=32, train_n=48
    )
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    s = cb.summary()
    seen = {sig for sig in cb.engine.run.machine.loops["train"].signatures}
    assert len(seen) >= 10  # padded lengths seen in training
    per_target: dict[str, int] = {}
    for event in s["compile_events"]:  # the targets after the split of the whole model
        if event["target"] in s["targets"]:
            per_target[event["target"]] = per_target.get(event["target"], 0) + 1
    assert set(per_target) == {"transformer", "lm_head"}, s["compile_events"]
    # The first compile, then at most two recompiles (automatic dynamic shapes).
    assert all(n <= 3 for n in per_target.values()), s["compile_events"]
    assert s["phases"]["train"] == "steady"
    assert len(s["rearms"]) <= 2, s["rearms"]
    assert s["checked_batches"] >= 1  # unseen lengths that stayed under the stance (H26)
    assert steady_share(cb) >= 0.8, s


def test_standalone_evaluate_and_predict(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    eager = trainer_for(tmp_path / "eager")
    cb = guard()
    guarded = trainer_for(tmp_path / "guarded", [cb])
    with caplog.at_level("INFO", logger="guardtrain"):
        first = guarded.evaluate()
        assert cb.summary()["compiles"] > 0
        second = guarded.evaluate()
        predicted = guarded.predict(Tokens(8, 2))
    reference = eager.evaluate()
    assert first["eval_loss"] == second["eval_loss"] == reference["eval_loss"]
    expected = eager.predict(Tokens(8, 2))
    assert torch.equal(
        torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions)
    )
    logged = [r for r in caplog.records if "guardtrain summary" in r.getMessage()]
    assert len(logged) == 3  # once per evaluate()/predict() call
    assert_put_back(cb, guarded.model)
    # A model call in evaluation mode outside the Trainer's evaluation is left alone.
    compiles = cb.summary()["compiles"]
    guarded.model.eval()
    with torch.no_grad():
        guarded.model(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert cb.summary()["compiles"] == compiles and not cb.engine.active


# -- BERT with DataCollatorWithPadding ------------------------------------------------------

BERT_VOCAB = 100
BERT_LENGTHS = tuple(range(10, 29))  # 19 example lengths


class Sentences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``n`` labelled token-id lists, as a tokenizer's output, of lengths drawn from
    ``BERT_LENGTHS`` (seeded): ``{"input_ids": [...], "label": k}``."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = BERT_LENGTHS[int(torch.randint(len(BERT_LENGTHS), (1,), generator=g))]
            ids = torch.randint(2, BERT_VOCAB, (length,), generator=g).tolist()
            self.items.append({"input_ids": ids, "label": sum(ids) % 3})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.items[i])


def word_tokenizer() -> Any:
    """A word-level tokenizer made in memory (no hub): what ``DataCollatorWithPadding`` pads with."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, BERT_VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
        pad_token="[PAD]",
        unk_token="[UNK]",
    )


def bert_trainer(out: Path, callbacks: list[Any]) -> Any:
    """A tiny BERT classifier (random weights), 39 steps of 32 padded examples; 368
    examples, so each epoch ends with a short batch of 16 (step 11)."""
    set_seed(0)
    config = tiny_bert_config(vocab_size=BERT_VOCAB, max_position_embeddings=64)
    return Trainer(
        model=transformers.BertForSequenceClassification(config),
        args=make_args(out, max_steps=39, per_device_train_batch_size=32),
        train_dataset=Sentences(368, 2),
        data_collator=transformers.DataCollatorWithPadding(word_tokenizer()),
        callbacks=callbacks,
    )


def test_bert_padding_an_audit_batch_with_new_shapes_stays_steady(tmp_path: Path) -> None:
    """H26: BERT sequence classification, ``DataCollatorWithPadding``, then ``predict()``.

    The four warm-up batches all pad to 28, so the one entry is static; the first batch
    of the lookup window (full guards, an audit) pads to 27 and compiles (that compile
    makes the length dynamic). It used to re-arm as a stale entry found by the audit: 23
    of the 35 batches after warm-up were steady. Its compile is for its new inputs, so the
    loop stays steady. Losses, weights and predictions equal eager's, batch by batch."""
    eager = bert_trainer(tmp_path / "eager", [])
    eager.train()
    # About aggressive's lookup window (turbo runs none): also under --turbo-everywhere.
    cb = guard(compile_kwargs={"backend": "eager"}, measure_lookup=True, direct_dispatch=False)
    guarded = bert_trainer(tmp_path / "guarded", [cb])
    guarded.train()
    assert losses(guarded) == losses(eager) and len(losses(eager)) == 39
    assert_same_weights(guarded.model, eager.model)
    s = cb.summary()
    assert s["lookup_us"], s  # the window ran: its first batch is the audit in question
    new_length = [e for e in s["compile_events"] if "size mismatch at index 1" in e["reason"]]
    assert new_length and new_length[0]["step"] == 4, s["compile_events"]
    # One re-arm is left: the epoch's short last batch (16 rows, a batch size not yet seen).
    # The first (H25): the whole model is the target, and BERT's forward fills in
    # `config.problem_type` at its first call with labels.
    assert [r["step"] for r in s["rearms"]] == [1, 11], s["rearms"]
    assert "config.problem_type: None -> 'single_label_classification'" in s["rearms"][0]["reason"]
    assert s["rearms"][1]["reason"].startswith("unseen batch signature"), s["rearms"]
    assert steady_share(cb) >= 0.8, s
    test = Sentences(40, 3)
    predicted = guarded.predict(test)
    expected = eager.predict(test)
    assert torch.equal(
        torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions)
    )
    assert predicted.metrics["test_loss"] == expected.metrics["test_loss"]
    assert_put_back(cb, guarded.model)


def test_a_copied_or_pickled_model_gets_hooks_that_do_nothing(tmp_path: Path) -> None:
    import copy
    import pickle

    from guardtrain.hf_accelerate import _inert

    cb = guard()
    trainer = trainer_for(tmp_path, [cb])
    model = trainer.model
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(h is _inert for h in twin._forward_pre_hooks.values())
        assert all(h is _inert for h in twin._forward_hooks.values())
        twin.eval()
        with torch.no_grad():
            twin(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert not cb.engine.active and cb.summary()["compiles"] == 0


class _RaiseAt(TrainerCallback):
    def __init__(self, step: int, error: BaseException) -> None:
        self.step = step
        self.error = error
        self.raised = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and not self.raised:
            self.raised = True
            raise self.error


def test_exception_in_a_callback_mid_step_leaves_the_stance_off(tmp_path: Path) -> None:
    cb = guard()
    trainer = trainer_for(tmp_path, [cb, _RaiseAt(12, ValueError("boom"))])
    with pytest.raises(ValueError, match="boom"):
        trainer.train()
    assert cb.phase == "steady"  # it was steady when the step raised
    assert not stance_is_unsafe()
    cb.restore()
    assert_put_back(cb, trainer.model)
    # The next run starts afresh.
    trainer.train()
    assert not stance_is_unsafe()
    assert cb.summary()["phases"]["train"] == "steady"


class _RaisesInForward(GPT2LMHeadModel):
    """Raises after its targets ran, inside the root ``forward``, on one chosen call."""

    raise_at = -1
    seen: ClassVar[list[bool]] = []

    def forward(
        self, input_ids: Any = None, attention_mask: Any = None, labels: Any = None, **kw: Any
    ) -> Any:
        out = super().forward(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kw
        )
        type(self).raise_at -= 1
        if type(self).raise_at == 0:
            type(self).seen.append(stance_is_unsafe())
            raise RuntimeError("inside forward")
        return out


def test_exception_in_forward_leaves_the_stance_off(tmp_path: Path) -> None:
    cb = guard()
    _RaisesInForward.raise_at = 16
    trainer = trainer_for(tmp_path, [cb], model=tiny_model(cls=_RaisesInForward))
    with pytest.raises(RuntimeError, match="inside forward"):
        trainer.train()
    # Steady when it raised, and the stance only ever inside the targets' own compiled
    # calls (H41): off in the root's forward after them.
    assert cb.phase == "steady"
    assert _RaisesInForward.seen == [False]
    assert not stance_is_unsafe()
    cb.restore()
    assert_put_back(cb, trainer.model)


# -- the Trainer's compile --------------------------------------------------------------------


def test_torch_compile_is_taken_over(tmp_path: Path) -> None:
    eager = trainer_for(tmp_path / "eager")
    eager.train()
    cb = GuardTrainerCallback("aggressive", warmup_steps=4, stable_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded = trainer_for(
            tmp_path / "guarded", [cb], torch_compile=True, torch_compile_backend="aot_eager"
        )
    told = [str(w.message) for w in caught if "took over the Trainer's compile" in str(w.message)]
    assert len(told) == 1, told
    assert "aot_eager" in told[0]
    guarded.train()
    assert cb.engine.config.compile_kwargs["backend"] == "aot_eager"
    assert not isinstance(guarded.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    assert cb.summary()["phases"]["train"] == "steady"
    assert_put_back(cb, guarded.model)
    plugin = guarded.accelerator.state.dynamo_plugin
    assert str(plugin.backend.value).lower() == "no"
    cb.release()
    assert str(plugin.backend.value).lower() == "aot_eager"
    assert not guarded.model._forward_hooks and not guarded.model._forward_pre_hooks


@pytest.mark.slow
def test_regional_compilation_maps_to_block_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = trainer_for(tmp_path / "eager", max_steps=12)
    eager.train()
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    cb = GuardTrainerCallback("aggressive", warmup_steps=4, stable_steps=2)
    guarded = trainer_for(
        tmp_path / "guarded",
        [cb],
        torch_compile=True,
        torch_compile_backend="aot_eager",
        max_steps=12,
    )
    guarded.train()
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    assert "transformer.h.0" in cb.summary()["targets"]
    assert cb.summary()["targets"] == regional_targets(guarded.model)
    # Instances of one block class share one compiled code (H24).
    assert cb.summary()["shared_code"]
    cb.release()


def test_compile_added_after_the_trainer_is_made_is_left_alone(tmp_path: Path) -> None:
    eager = trainer_for(tmp_path / "eager")
    eager.train()
    cb = guard()
    trainer = trainer_for(
        tmp_path / "compiled", torch_compile=True, torch_compile_backend="aot_eager"
    )
    trainer.add_callback(cb)
    with pytest.warns(UserWarning, match="does nothing in this run"):
        trainer.train()
    assert cb.summary()["targets"] == []
    assert losses(trainer) == losses(eager)  # accelerate's own compile, left as it was


# -- pitfalls ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_model_init_new_model_per_train(tmp_path: Path) -> None:
    eager = trainer_for(
        tmp_path / "e", trainer_kwargs={"model_init": lambda: tiny_model()}, max_steps=12
    )
    eager.train()
    first_eager = eager.model
    eager.train()
    cb = guard()
    guarded = trainer_for(
        tmp_path / "g", [cb], trainer_kwargs={"model_init": lambda: tiny_model()}, max_steps=12
    )
    guarded.train()
    first = guarded.model
    guarded.train()
    assert guarded.model is not first
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    assert_same_weights(first, first_eager)
    assert not first._forward_pre_hooks  # the hooks moved to the new model
    assert cb.summary()["phases"]["train"] == "steady"


class _Trials(TrainerCallback):
    """Each trial's model, training losses and summary (the Trainer drops the model after)."""

    def __init__(self, guard: GuardTrainerCallback | None = None) -> None:
        self.guard = guard
        self.models: list[Any] = []
        self.losses: list[list[float]] = []
        self.summaries: list[dict[str, Any]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.models.append(kwargs["model"])

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.losses.append([h["loss"] for h in state.log_history if "loss" in h])
        if self.guard is not None:
            self.summaries.append(self.guard.summary())


@pytest.mark.slow
def test_hyperparameter_search_new_model_per_trial(tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna")

    def space(trial: Any) -> dict[str, Any]:
        return {"learning_rate": trial.suggest_categorical("learning_rate", [1e-3, 3e-4, 1e-4])}

    def search(out: Path, callbacks: list[Any]) -> Any:
        trainer = trainer_for(
            out, callbacks, trainer_kwargs={"model_init": lambda: tiny_model()}, max_steps=12
        )
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        return trainer.hyperparameter_search(
            hp_space=space,
            backend="optuna",
            n_trials=3,
            direction="minimize",
            sampler=optuna.samplers.TPESampler(seed=0),
        )

    eager_trials = _Trials()
    eager = search(tmp_path / "e", [eager_trials])
    cb = guard()
    trials = _Trials(cb)
    best = search(tmp_path / "g", [cb, trials])
    assert (best.run_id, best.objective, best.hyperparameters) == (
        eager.run_id,
        eager.objective,
        eager.hyperparameters,
    )
    assert trials.losses == eager_trials.losses and len(trials.losses) == 3
    assert len({id(m) for m in trials.models}) == 3  # a new model per trial
    for model in trials.models[:-1]:
        assert not model._forward_pre_hooks and not model._forward_hooks  # moved on
    for summary in trials.summaries:
        assert summary["phases"]["train"] == "steady"
        assert summary["steady_steps"] > 0
    assert not stance_is_unsafe()


@pytest.mark.slow
def test_auto_find_batch_size_starts_again(tmp_path: Path) -> None:
    oom = "CUDA out of memory."
    eager = trainer_for(tmp_path / "e", [_RaiseAt(3, RuntimeError(oom))], auto_find_batch_size=True)
    eager.train()
    cb = guard()
    guarded = trainer_for(
        tmp_path / "g", [cb, _RaiseAt(3, RuntimeError(oom))], auto_find_batch_size=True
    )
    guarded.train()
    assert guarded._train_batch_size < 4
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    assert cb.summary()["phases"]["train"] == "steady"
    assert_put_back(cb, guarded.model)


@pytest.mark.slow
def test_resume_from_checkpoint(tmp_path: Path) -> None:
    def resumed(out: Path, callbacks: list[Any]) -> Any:
        first = trainer_for(out, save_strategy="steps", save_steps=12)
        first.train()
        again = trainer_for(out, callbacks, save_strategy="steps", save_steps=12)
        again.train(resume_from_checkpoint=str(out / "checkpoint-12"))
        return again

    eager = resumed(tmp_path / "e", [])
    cb = guard()
    guarded = resumed(tmp_path / "g", [cb])
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    assert cb.summary()["steady_steps"] > 0


@pytest.mark.slow
def test_peft_lora(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")

    def lora() -> Any:
        config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
        return peft.get_peft_model(tiny_model(), config)

    cb = guard()
    eager, guarded = run_pair(tmp_path, cb, model=None, trainer_kwargs={"model_init": lora})
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    assert cb.summary()["targets"] == [
        "base_model.model.transformer",
        "base_model.model.lm_head",
    ]
    assert steady_share(cb) >= 0.8


class _OwnLoss(Trainer):
    """A user's ``compute_loss``: the loss from the logits, hidden states on odd steps."""

    calls = 0

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        labels = inputs.pop("labels")
        type(self).calls += 1
        out = model(**inputs, output_hidden_states=self.calls % 2 == 1)
        logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        if out.hidden_states is not None:
            loss = loss + 0.0 * out.hidden_states[-1].sum()
        return (loss, out) if return_outputs else loss


def test_compute_loss_override_and_a_changed_keyword(tmp_path: Path) -> None:
    cb = guard()
    eager, guarded = run_pair(tmp_path, cb, cls=_OwnLoss)
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    # output_hidden_states flips on every call. In transformers 5 the first call with
    # it breaks the base model's graph (its hidden-state capture), and the engine
    # compiles the parts instead (H20); every call stays eager-equal, and steady.
    s = cb.summary()
    assert s["phases"]["train"] == "steady"
    assert s["steady_steps"] > 0


def _compiled_step_optimizers(model: Any, compiled: bool) -> tuple[Any, Any]:
    """An ``optimizers=`` pair whose ``step`` is the user's own compile (H41): PyTorch's
    compiled-optimizer recipe, Adam with a scheduler."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, total_iters=STEPS // 2)
    if compiled:
        opt.step = torch.compile(opt.step, backend="aot_eager")  # type: ignore[method-assign]
    return opt, sched


@pytest.mark.parametrize(
    "preset", first_then_slow("aggressive", "off", "safe", "balanced", "turbo")
)
def test_a_compiled_optimizer_step_runs_with_full_guards(tmp_path: Path, preset: str) -> None:
    """The user's compiled optimizer step runs with full guards under every preset: equal
    to the same compiled step without guardtrain, and close to an uncompiled optimizer
    (Dynamo's Adam rounds differently from eager's)."""

    def run(cbs: list[Any], compiled: bool, name: str) -> Any:
        model = tiny_model()
        trainer = trainer_for(
            tmp_path / name,
            cbs,
            model=model,
            eval_n=0,
            trainer_kwargs={"optimizers": _compiled_step_optimizers(model, compiled)},
        )
        trainer.train()
        return trainer

    cb = guard(preset)
    guarded = run([cb], True, "guarded")
    plain = run([], True, "plain")
    eager = run([], False, "eager")
    assert losses(guarded) == losses(plain)
    assert_same_weights(guarded.model, plain.model)
    torch.testing.assert_close(losses(guarded), losses(eager), rtol=1e-4, atol=1e-5)
    if cb.settings.use_stance:
        assert cb.summary()["phases"]["train"] == "steady"
        assert steady_share(cb) >= 0.8


class _CompiledLoss(Trainer):
    """A ``compute_loss`` whose weight is annealed from step 8 on, compiled by the user."""

    calls = 0
    weighted = staticmethod(
        torch.compile(lambda loss, w: loss * w, backend="aot_eager", dynamic=False)
    )

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        out = model(**inputs)
        type(self).calls += 1
        w = 1.0 if self.calls < 8 else 0.9 ** (self.calls - 7)
        loss = type(self).weighted(out.loss, w)
        return (loss, out) if return_outputs else loss


def test_a_compiled_loss_with_an_annealed_weight(tmp_path: Path) -> None:
    """The user's compiled loss reads a new weight on every step from step 8 on: with full
    guards it recompiles (then takes the weight as an input); never the first value."""
    _CompiledLoss.calls = 0
    reference = trainer_for(tmp_path / "plain", cls=_CompiledLoss, max_steps=16)
    reference.train()
    _CompiledLoss.calls = 0
    cb = guard()
    guarded = trainer_for(tmp_path / "guarded", [cb], cls=_CompiledLoss, max_steps=16)
    guarded.train()
    assert losses(guarded) == losses(reference)
    assert_same_weights(guarded.model, reference.model)
    assert cb.summary()["phases"]["train"] == "steady"


def test_label_smoothing_and_compute_loss_func(tmp_path: Path) -> None:
    cb = guard()
    eager, guarded = run_pair(tmp_path, cb, label_smoothing_factor=0.1, max_steps=12)
    assert losses(guarded) == losses(eager)

    def loss_func(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        logits = outputs["logits"][:, :-1].reshape(-1, outputs["logits"].shape[-1])
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))

    cb2 = guard()
    eager2, guarded2 = run_pair(
        tmp_path / "f", cb2, trainer_kwargs={"compute_loss_func": loss_func}, max_steps=12
    )
    assert losses(guarded2) == losses(eager2)
    assert_same_weights(guarded2.model, eager2.model)


@pytest.mark.slow
def test_gradient_checkpointing(tmp_path: Path) -> None:
    cb = guard()
    eager, guarded = run_pair(tmp_path, cb, gradient_checkpointing=True, max_steps=12)
    assert losses(guarded) == pytest.approx(losses(eager), rel=1e-6)
    assert_same_weights(guarded.model, eager.model, atol=1e-6)


@pytest.mark.slow
def test_neftune(tmp_path: Path) -> None:
    cb = guard()
    eager, guarded = run_pair(tmp_path, cb, neftune_noise_alpha=5.0, max_steps=12)
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    # NEFTune's hook on the embeddings is gone after training, as without guardtrain.
    assert not guarded.model.transformer.wte._forward_hooks


@pytest.mark.slow
def test_a_target_that_breaks_the_graph_is_split(tmp_path: Path) -> None:
    class Breaking(GPT2Model):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            torch._dynamo.graph_break()
            return super().forward(*args, **kwargs)

    def breaking() -> Any:
        model = tiny_model()
        inner = Breaking(model.config)
        inner.load_state_dict(model.transformer.state_dict())
        model.transformer = inner
        model.tie_weights()
        return model

    cb = guard()
    eager, guarded = run_pair(tmp_path, cb, trainer_kwargs={"model_init": breaking})
    assert losses(guarded) == losses(eager)
    s = cb.summary()
    # The whole model, then its base model, split in turn.
    assert [b["target"] for b in s["graph_breaks"]][:2] == ["<model>", "transformer"]
    assert "transformer.h.0" in s["targets"]


def test_a_split_waits_for_the_backward_of_checkpointed_blocks(tmp_path: Path) -> None:
    """Each block breaks the graph in its MLP: the base model is split into its blocks in
    the first step, each block into its parts in the second. With gradient checkpointing
    the backward runs each block's forward again, and must run the graph its forward ran
    (H52: the split at the forward's end gave ``CheckpointError``)."""

    class BreakingMLP(torch.nn.Module):
        def __init__(self, mlp: torch.nn.Module) -> None:
            super().__init__()
            self.mlp = mlp

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return self.mlp(x)

    def breaking() -> Any:
        model = tiny_model()
        for block in model.transformer.h:
            block.mlp = BreakingMLP(block.mlp)
        return model

    cb = guard()
    eager, guarded = run_pair(
        tmp_path,
        cb,
        gradient_checkpointing=True,
        max_steps=8,
        trainer_kwargs={"model_init": breaking},
    )
    assert losses(guarded) == losses(eager)
    assert_same_weights(guarded.model, eager.model)
    split = {b["target"] for b in cb.summary()["graph_breaks"]}
    assert {"transformer", "transformer.h.0"} <= split, split


# -- FSDP and DeepSpeed, accelerate's state faked (fast; FSDP2 for real is further down) ------


def _fake_state(kind: str, **plugins: Any) -> Any:
    from accelerate.utils import DistributedType

    return types.SimpleNamespace(
        distributed_type=DistributedType[kind],
        dynamo_plugin=None,
        deepspeed_plugin=plugins.get("deepspeed_plugin"),
        fsdp_plugin=plugins.get("fsdp_plugin"),
    )


def test_fsdp_switches_off_free_tensors_and_refuses_turbo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FullyShardedDataParallelPlugin:
        fsdp_version = 2

    import guardtrain.hf_accelerate as hfa

    state = _fake_state("FSDP", fsdp_plugin=FullyShardedDataParallelPlugin())
    monkeypatch.setattr(hfa, "accelerate_state", lambda: state)
    cb = guard("turbo")
    trainer = trainer_for(tmp_path, [cb], max_steps=12)
    with pytest.warns(UserWarning, match="direct dispatch"):
        trainer.train()
    s = cb.summary()
    assert any(x["lever"] == "install_free_tensors" for x in s["switched_off"])
    assert "FSDP" in s["direct_dispatch"]["refused"]
    assert s["direct_dispatch"]["calls"] == 0


def test_deepspeed_switches_guardtrain_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class DeepSpeedPlugin:
        zero_stage = 2

    import guardtrain.hf_accelerate as hfa

    state = _fake_state("DEEPSPEED", deepspeed_plugin=DeepSpeedPlugin())
    monkeypatch.setattr(hfa, "accelerate_state", lambda: state)
    cb = guard()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trainer_for(tmp_path, [cb], max_steps=6)
        trainer.train()
    told = [str(w.message) for w in caught if "switches itself off" in str(w.message)]
    assert len(told) == 1 and "DeepSpeedPlugin" in told[0] and "ZeRO stage 2" in told[0]
    assert cb.switched_off is not None
    assert cb.summary()["targets"] == [] and cb.summary()["compiles"] == 0


# -- DDP through accelerate --------------------------------------------------------------------


def two_processes(script: str, out: Path, *extra: str, path: str = "") -> list[dict[str, Any]]:
    """``tests/ddp_scripts/<script>`` on 2 CPU processes (``torchrun --standalone``: a free
    port); each rank's JSON result (``OUT.rank{r}.json``). ``path``: one more folder on
    ``PYTHONPATH``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "tests" / "ddp_scripts" / script),
        "--out",
        str(out),
        *extra,
    ]
    pythonpath = os.pathsep.join(filter(None, [str(REPO), path, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's accelerator, if it is imported
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=420, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_processes_through_accelerate(tmp_path: Path) -> None:
    eager_ranks = two_processes("hf_run.py", tmp_path / "eager")
    guarded_ranks = two_processes("hf_run.py", tmp_path / "guarded", "--guard", "aggressive")
    for e, g in zip(eager_ranks, guarded_ranks):  # each rank against the eager run's
        assert g["world_size"] == 2
        assert g["losses"] == e["losses"]
        assert g["weights"] == e["weights"]
    s = guarded_ranks[0]["summary"]
    assert s["phases"]["train"] == "steady"
    assert s["steady_steps"] >= 0.8 * (STEPS - 4)


# -- FSDP2 through accelerate, for real -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_two_processes_through_accelerate(tmp_path: Path) -> None:
    """``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})`` on 2 CPU processes
    (gloo): accelerate shards each ``GPT2Block`` and the root with ``fully_shard``. The
    script gives accelerate's process state the type it has on a GPU machine, since on the
    CPU accelerate 1.15 drops the FSDP plugin and the Trainer runs DDP (its docstring).
    Each guarded run against the eager FSDP2 run, on each rank: losses and gathered weights
    bitwise equal (``aot_eager``, dropout on); install_free_tensors off, naming the plugin;
    turbo refused with one warning on the main process; the stance on for the training
    forwards after warm-up, also across the epoch boundary at forward 16."""
    plugin = "accelerate's FSDP (FullyShardedDataParallelPlugin, fsdp_version 2)"

    def launch(name: str, *extra: str) -> list[dict[str, Any]]:
        return two_processes("hf_fsdp_run.py", tmp_path / name, *extra)

    eager = launch("eager")
    assert [e["distributed_type"] for e in eager] == ["FSDP", "FSDP"]
    for preset in ("aggressive", "turbo"):
        guarded = launch(preset, "--guard", preset)
        for e, g in zip(eager, guarded):
            where = f"{preset}, rank {g['rank']}"
            assert g["world_size"] == 2 and g["distributed_type"] == "FSDP", where
            assert g["fsdp_version"] == 2 and g["model_class"] == "FSDPGPT2LMHeadModel", where
            assert len(g["losses"]) == STEPS, where
            assert g["losses"] == e["losses"], where
            assert g["weights"] == e["weights"], where
            s = g["summary"]
            # The FSDP plugin was seen: install_free_tensors off, in the engine and the summary.
            assert g["install_free_tensors"] is False, where
            assert s["levers"]["install_free_tensors"] is False, where
            assert [(x["lever"], x["why"].startswith(plugin)) for x in s["switched_off"]] == [
                ("install_free_tensors", True)
            ], (where, s["switched_off"])
            direct = s["direct_dispatch"]
            assert direct["on"] is False and direct["calls"] == 0, (where, direct)
            refusals = [w for w in g["warnings"] if "direct dispatch (turbo) is refused" in w]
            if preset == "turbo":
                assert direct["requested"] and direct["refused"].startswith(plugin), where
                # Warnings on the main process only.
                assert len(refusals) == (1 if g["rank"] == 0 else 0), (where, g["warnings"])
                assert all(plugin in w for w in refusals), refusals
            else:
                assert not direct["requested"] and not refusals, where
            # The stance: on for the training forwards after warm-up (4), including those
            # after the epoch boundary (forward 16: the boundary re-check forgives FSDP's
            # swapped parameters, as the per-call check does).
            after = g["stance"][s["warmup_steps_taken"] :]
            assert len(g["stance"]) == STEPS, where
            assert after.count("1") >= 0.8 * (STEPS - 4), (where, g["stance"])
            assert s["phases"]["train"] == "steady", where
            assert s["steady_steps"] >= 0.8 * (STEPS - 4), where
            assert not [r for r in s["rearms"] if "graph break" not in r["reason"]], (
                where,
                s["rearms"],
            )


# -- DeepSpeed through accelerate, for real ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_two_processes_switch_guardtrain_off(tmp_path: Path) -> None:
    """``TrainingArguments(deepspeed={ZeRO-2}, use_cpu=True)`` on 2 CPU processes with
    ``DS_ACCELERATOR=cpu`` (gloo): the Trainer trains through DeepSpeed's engine, and
    the callback switches itself off with one warning (main process) naming the plugin:
    no hooks, no targets, no compile, and the losses of the run without it."""
    if not (DEEPSPEED / "deepspeed").is_dir():
        pytest.skip(f"deepspeed is not installed in {DEEPSPEED} (scripts/setup.sh)")

    def launch(name: str, *extra: str) -> list[dict[str, Any]]:
        return two_processes("hf_deepspeed_run.py", tmp_path / name, *extra, path=str(DEEPSPEED))

    plain = launch("plain")
    guarded = launch("guarded", "--guard", "aggressive")
    for p, g in zip(plain, guarded):
        where = f"rank {g['rank']}"
        assert g["world_size"] == 2 and g["distributed_type"] == "DEEPSPEED", where
        assert g["zero_stage"] == 2 and g["model_class"] == "DeepSpeedEngine", where
        assert len(g["losses"]) == 6 and g["losses"] == p["losses"], where
        assert g["switched_off"] is not None, where
        assert "DeepSpeedPlugin" in g["switched_off"] and "ZeRO stage 2" in g["switched_off"]
        told = [w for w in g["warnings"] if "switches itself off" in w]
        assert len(told) == (1 if g["rank"] == 0 else 0), (where, g["warnings"])
        assert all("DeepSpeedPlugin" in w and "ZeRO stage 2" in w for w in told), told
        assert g["warnings"] == told, (where, g["warnings"])  # nothing else from guardtrain
        # DeepSpeed's engine hooks the module itself; none of the hooks is guardtrain's.
        assert g["hooks"] and not [h for h in g["hooks"] if "guardtrain" in h], g["hooks"]
        s = g["summary"]
        assert s["targets"] == [] and s["compiles"] == 0 and s["steady_steps"] == 0, where


@pytest.mark.slow
def test_the_example_matches_the_run_without_guardtrain() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_trainer", REPO / "examples" / "hf_trainer.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    guarded = example.main(["--steps", "40"])
    plain = example.main(["--steps", "40", "--no-guard"])
    assert guarded["eval_loss"] == plain["eval_loss"]
    assert guarded["summary"]["steady_steps"] > 0  # the summary after evaluate()'s run


# -- turbo on the usual HF call: one tensor passed twice (H40) ---------------------------------


def test_turbo_dispatches_directly_with_labels_equal_to_input_ids() -> None:
    from guardtrain import GuardTuner

    def run(preset: str | None) -> tuple[list[float], Any, dict[str, Any] | None]:
        model = tiny_model()
        # A known loss type: else the loss property logs a warning, which breaks the graph.
        model.loss_type = "ForCausalLM"
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(1, 64, (4, 16), generator=g) for _ in range(24)]
        seen: list[float] = []

        def steps(tuner: Any = None) -> None:
            for ids in batches:
                ctx = tuner.step(ids) if tuner is not None else None
                if ctx is not None:
                    ctx.__enter__()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                seen.append(loss.item())
                if ctx is not None:
                    ctx.__exit__(None, None, None)

        if preset is None:
            steps()
            return seen, model, None
        with GuardTuner(model, preset, warmup_steps=4, stable_steps=2, compile_kwargs=AOT) as tuner:
            steps(tuner)
        return seen, model, tuner.summary()

    eager, eager_model, _ = run(None)
    turbo, turbo_model, s = run("turbo")
    assert s is not None
    assert turbo == eager
    assert_same_weights(turbo_model, eager_model)
    assert s["phases"]["train"] == "steady"
    direct = s["direct_dispatch"]
    assert direct["on"], direct
    # Every steady call but the one that harvests runs directly.
    assert s["targets"] == ["<model>"]  # the whole model: `labels` reaches the target
    assert direct["calls"] >= s["steady_steps"] - 1, (direct, s["steady_steps"])
