"""Shared helpers of the Hugging Face ``Trainer`` tests: a tiny GPT-2, its arguments and runs.

Imported by name (``from hf_helpers import ...``) after the test module's
``pytest.importorskip("transformers")``. A tiny GPT-2 from a config (random weights, no
hub access), generated token ids, ``aot_eager`` (bitwise equal to eager on the CPU,
dropout included).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from benchmarks.hf_data import Tokens, pad, tiny_gpt2_config
from guardtrain import GuardTrainerCallback
from guardtrain.engine.process import stance_is_unsafe

REPO = Path(__file__).resolve().parents[1]
#: Where scripts/setup.sh installs deepspeed, apart from the venv (the DeepSpeed test only).
DEEPSPEED = Path(os.environ.get("GUARDTRAIN_DEEPSPEED_PATH", REPO / ".venv" / "deepspeed"))
AOT = {"backend": "aot_eager"}
STEPS = 24


# -- the model, the data and the runs ---------------------------------------------------------


def tiny_model(seed: int = 0, cls: type = GPT2LMHeadModel, **extra: Any) -> Any:
    set_seed(seed)
    return cls(tiny_gpt2_config(**extra))


def make_args(out: Path, **overrides: Any) -> TrainingArguments:
    """The tests' ``TrainingArguments``: CPU, no reports, no saves, one log per step."""
    values: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    values.update(overrides)
    return TrainingArguments(**values)


def guard(preset: str = "aggressive", **kwargs: Any) -> GuardTrainerCallback:
    values: dict[str, Any] = {
        "compile_kwargs": AOT,
        "warmup_steps": 4,
        "stable_steps": 2,
        "measure_lookup": False,
    }
    values.update(kwargs)
    return GuardTrainerCallback(preset, **values)


def trainer_for(
    out: Path,
    callbacks: list[Any] | None = None,
    *,
    model: Any = None,
    cls: type = Trainer,
    train_n: int = 64,
    lengths: tuple[int, ...] = (16,),
    eval_n: int = 16,
    trainer_kwargs: dict[str, Any] | None = None,
    **args: Any,
) -> Any:
    kwargs = dict(trainer_kwargs or {})
    if "model_init" not in kwargs:
        kwargs["model"] = model if model is not None else tiny_model()
    return cls(
        args=make_args(out, **args),
        train_dataset=Tokens(train_n, 0, lengths),
        eval_dataset=Tokens(eval_n, 1, lengths) if eval_n else None,
        data_collator=pad,
        callbacks=list(callbacks or []),
        **kwargs,
    )


def losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def eval_losses(trainer: Any) -> list[float]:
    return [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, atol: float = 0.0) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        if atol:
            torch.testing.assert_close(sa[key], sb[key], atol=atol, rtol=0, msg=key)
        else:
            assert torch.equal(sa[key], sb[key]), key


def assert_put_back(cb: GuardTrainerCallback, model: torch.nn.Module) -> None:
    assert not stance_is_unsafe()
    assert not cb.engine.active
    for name, sub in model.named_modules():
        assert "forward" not in sub.__dict__ or name == "", name


def steady_share(cb: GuardTrainerCallback) -> float:
    s = cb.summary()
    after_warmup = cb.engine.train_batches() - cb.settings.warmup_steps
    return s["steady_steps"] / max(after_warmup, 1)


def run_pair(tmp_path: Path, cb: Any = None, **kw: Any) -> tuple[Any, Any]:
    """An eager run and a guarded run of the same configuration."""
    eager = trainer_for(tmp_path / "eager", **kw)
    eager.train()
    guarded = trainer_for(tmp_path / "guarded", [cb or guard()], **kw)
    guarded.train()
    return eager, guarded
