"""DPO with a PEFT model and no separate reference model: the reference pass runs inside
``model.disable_adapter()`` (TRL's recipe), which flips the adapters' ``requires_grad``
off and back on twice per step (peft 0.21).

Each ``requires_grad`` pattern has compiled code of its own (H42), so after warm-up both
patterns find their entries: no recompile and no re-arm per step (H44). Runs in Lightning
(``GuardTuneCallback``'s default target, the PEFT model) and in the Hugging Face
``Trainer`` (a ``compute_loss`` override, ``GuardTrainerCallback``'s default targets), each
beside the same run without guardtrain: losses and the adapters' weights after every step
bitwise equal with ``aot_eager`` (the eager backend would hide a stale
``requires_grad``, H43).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import guard_without_lookup, make_trainer

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_helpers import make_args  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402

from guardtrain import GuardTrainerCallback  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader`"),
    pytest.mark.filterwarnings("ignore::UserWarning:peft.*"),
]

AOT = {"backend": "aot_eager"}
STEPS = 20
WARMUP = 4
BETA = 0.1


def tiny_lora_llama(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    # LoRA's B starts at zero: move it off, so the policy and the reference differ.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def pairs(n: int = STEPS * 4, seed: int = 1) -> torch.Tensor:
    """Token ids, 4 a step: 2 chosen then 2 rejected answers."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 64, (n, 12), generator=g)


def sequence_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = logits[:, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """TRL's sigmoid DPO loss: the policy pass, then the reference pass with the adapters
    disabled (no separate reference model)."""
    policy = sequence_logps(model(input_ids=ids).logits, ids)
    with torch.no_grad(), model.disable_adapter():
        reference = sequence_logps(model(input_ids=ids).logits, ids)
    half = ids.shape[0] // 2
    chosen = policy[:half] - reference[:half]
    rejected = policy[half:] - reference[half:]
    return -torch.nn.functional.logsigmoid(BETA * (chosen - rejected)).mean()


def adapter_weights(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for n, p in model.named_parameters() if "lora_" in n]


def assert_same(eager: dict[str, Any], got: dict[str, Any]) -> None:
    assert len(got["losses"]) == len(eager["losses"]) == STEPS
    differ = [i for i, (a, b) in enumerate(zip(eager["losses"], got["losses"])) if a != b]
    assert not differ, f"losses differ from eager at steps {differ}"
    for i, (a, b) in enumerate(zip(eager["weights"], got["weights"])):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), f"adapters differ after step {i}"


def assert_no_recompiles_per_step(summary: dict[str, Any], warmup_batches: int) -> None:
    """After warm-up at most 2 compiles per mode and requires_grad pattern: the policy
    pass (grad, adapters on) and the reference pass (no_grad, adapters off) are 2."""
    late = [e for e in summary["compile_events"] if e["step"] >= warmup_batches]
    assert len(late) <= 4, late
    assert len(summary["rearms"]) <= 2, summary["rearms"]


# -- Lightning ---------------------------------------------------------------------------------


class DPOModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_lora_llama()
        self.losses: list[float] = []
        self.weights: list[list[torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = dpo_loss(self.model, batch[0])
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.weights.append(adapter_weights(self.model))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def run_lightning(preset: str | None) -> tuple[dict[str, Any], Any]:
    module = DPOModule()
    callbacks = []
    if preset is not None:
        callbacks = [
            guard_without_lookup(
                preset, compile_kwargs=AOT, warmup_steps=WARMUP, stable_steps=2, audit_every=None
            )
        ]
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(pairs()), batch_size=4)
    L.seed_everything(0, verbose=False)
    make_trainer(callbacks, max_epochs=1).fit(module, data)
    summary = callbacks[0].summary() if callbacks else None
    return {"losses": module.losses, "weights": module.weights}, summary


@pytest.mark.parametrize("preset", ["off", "aggressive", "turbo"])
def test_dpo_with_disable_adapter_in_lightning(preset: str) -> None:
    eager, _ = run_lightning(None)
    got, s = run_lightning(preset)
    assert_same(eager, got)
    assert s is not None
    assert s["caught_changes"].get("requires_grad", {}).get("count", 0) >= STEPS, s
    if preset == "off":
        return
    assert_no_recompiles_per_step(s, WARMUP + 2)
    assert s["phase"] == "steady", s["rearms"]
    assert s["steady_steps"] >= (STEPS - WARMUP) // 2, (s["steady_steps"], s["rearms"])
    if preset == "turbo":
        assert s["direct_dispatch"]["calls"] >= STEPS - WARMUP - 4, s["direct_dispatch"]


# -- the Hugging Face Trainer -----------------------------------------------------------------


class DPOTrainer(Trainer):
    """TRL's DPO step as a ``compute_loss`` override: two calls of the model per step."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        loss = dpo_loss(model, inputs["input_ids"])
        return (loss, None) if return_outputs else loss


class Pairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.ids = pairs()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def run_hf(tmp_path: Path, preset: str | None) -> tuple[dict[str, Any], Any]:
    from transformers import TrainerCallback

    model = tiny_lora_llama()
    seen: dict[str, Any] = {"losses": [], "weights": []}

    class Weights(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen["weights"].append(adapter_weights(model))

    callbacks: list[Any] = [Weights()]
    guard = None
    if preset is not None:
        guard = GuardTrainerCallback(
            preset,
            compile_kwargs=AOT,
            warmup_steps=2 * WARMUP,  # two model calls a step: each call is a batch
            stable_steps=2,
            measure_lookup=False,
            audit_every=None,
        )
        callbacks.append(guard)
    args = make_args(
        tmp_path / (preset or "eager"),
        max_steps=STEPS,
        learning_rate=1e-2,
        remove_unused_columns=False,
    )
    trainer = DPOTrainer(model=model, args=args, train_dataset=Pairs(), callbacks=callbacks)
    trainer.train()
    seen["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return seen, guard.summary() if guard is not None else None


@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
def test_dpo_with_disable_adapter_in_the_hf_trainer(tmp_path: Path, preset: str) -> None:
    eager, _ = run_hf(tmp_path, None)
    got, s = run_hf(tmp_path, preset)
    assert_same(eager, got)
    assert s is not None
    assert_no_recompiles_per_step(s, 2 * WARMUP + 2)
    assert s["phase"] == "steady", s["rearms"]
    # Two calls a step, each a batch of the engine.
    assert s["steady_steps"] >= STEPS - WARMUP, (s["steady_steps"], s["rearms"])
