"""Varying shapes stay under the stance when a compiled entry accepts them (H26).

A batch whose signature was never seen keeps the stance: each compiled call first
evaluates its cache entries' guards on its own inputs. A call no entry accepts
leaves the stance before it runs and compiles with full guards.
"""

from __future__ import annotations

import random
from collections import UserDict
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import guard, make_trainer, stance_on
from torch import nn
from torch.utils.data import DataLoader

from guardtrain import GuardTuneCallback

VOCAB = 40


class Encoder(nn.Module):
    """Embedding, one attention layer with a padding mask, dropout, a vocabulary head."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        mask = attention_mask[:, None, :].bool()
        h = h + F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(self.drop(h))


class MaskedLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Encoder()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self.net(ids, mask)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
        loss = (loss * mask.flatten()).sum() / mask.sum()
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StanceSpy(L.Callback):
    """Whether each training batch ended under the stance (no call of it left the stance)."""

    def __init__(self) -> None:
        self.under: list[bool] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.under.append(stance_on())


def padded(lengths: list[int], rows: int, make: type, g: torch.Generator) -> Any:
    """A batch padded to the longest of ``rows`` sequences (dynamic padding)."""
    longest = max(lengths)
    ids = torch.zeros(rows, longest, dtype=torch.long)
    mask = torch.zeros(rows, longest)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, :n] = 1
    return make({"input_ids": ids, "attention_mask": mask})


def fit(batches: list[Any], epochs: int, cb: L.Callback | None) -> tuple[MaskedLM, StanceSpy]:
    L.seed_everything(0, verbose=False)
    model = MaskedLM()
    spy = StanceSpy()
    loader = DataLoader(
        batches,  # type: ignore[arg-type]
        batch_size=None,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    trainer = make_trainer([*([cb] if cb else []), spy], max_epochs=epochs)
    trainer.fit(model, loader)
    return model, spy


def assert_eager_equal(eager: MaskedLM, guarded: MaskedLM) -> None:
    assert len(eager.losses) == len(guarded.losses)
    for i, (a, b) in enumerate(zip(eager.losses, guarded.losses)):
        assert torch.equal(a, b), f"loss {i}: {a} vs {b}"
    for (key, a), b in zip(eager.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), key


def issue_setting(dynamic: bool | None, preset: str = "aggressive") -> GuardTuneCallback:
    """The issue's setting: `aggressive` (or `turbo`), `warmup_steps=5`, `stable_steps=2`."""
    return guard(
        preset,
        warmup_steps=5,
        stable_steps=2,
        compile_kwargs={"backend": "eager", "dynamic": dynamic},
    )


def _batch_types() -> list[Any]:
    kinds: list[Any] = [pytest.param(dict, id="dict")]
    try:
        from transformers import BatchEncoding
    except ImportError:  # pragma: no cover - transformers is a test dependency
        BatchEncoding = type("BatchEncoding", (UserDict,), {})
    kinds.append(pytest.param(BatchEncoding, id="BatchEncoding"))
    return kinds


@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
@pytest.mark.parametrize("dynamic", [None, True], ids=["dynamic_unset", "dynamic_true"])
@pytest.mark.parametrize("make", _batch_types())
def test_dynamic_padding(make: type, dynamic: bool | None, preset: str) -> None:
    """8 padded lengths in shuffled order, 16 batches per epoch (the last one short),
    4 epochs: at least 60% of the training batches under the stance, eager-equal."""
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    batches = []
    for i in range(16):
        target = 12 + 4 * (i % 8)  # 8 padded lengths
        rows = 5 if i == 15 else 8
        lengths = [rng.randint(4, target) for _ in range(rows - 1)] + [target]
        batches.append(padded(lengths, rows, make, g))
    eager, _ = fit(batches, 4, None)
    cb = issue_setting(dynamic, preset)
    guarded, spy = fit(batches, 4, cb)
    assert_eager_equal(eager, guarded)
    s = cb.summary()
    assert len(spy.under) == 64
    assert sum(spy.under) >= 0.6 * 64, (sum(spy.under), s["rearms"])
    # Every batch that stayed under the stance with an unseen signature had a call
    # accepted by an entry; no call reached Dynamo's own miss under the stance.
    assert s["checked_calls"] >= s["checked_batches"]
    assert not any("stance miss" in r["reason"] for r in s["rearms"]), s["rearms"]
    assert (s["direct_dispatch"]["calls"] > 0) == cb.settings.direct_dispatch


@pytest.mark.parametrize("preset", ["aggressive", "turbo"])
def test_random_lengths_with_dynamic_true(preset: str) -> None:
    """Lengths drawn from [8, 64] for every batch (seed 0), 3 epochs of 17 batches:
    at least 80% of the batches of epochs 2 and 3 under the stance, eager-equal."""
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    batches = []
    for _ in range(17):
        n = rng.randint(8, 64)
        lengths = [rng.randint(1, n) for _ in range(7)] + [n]
        batches.append(padded(lengths, 8, dict, g))
    eager, _ = fit(batches, 3, None)
    cb = issue_setting(True, preset)
    guarded, spy = fit(batches, 3, cb)
    assert_eager_equal(eager, guarded)
    later = spy.under[17:]
    assert len(later) == 34
    assert sum(later) >= 0.8 * 34, (sum(later), cb.summary()["rearms"])
    s = cb.summary()
    assert not any("stance miss" in r["reason"] for r in s["rearms"]), s["rearms"]


class Rows(nn.Module):
    """Normalises each row by its length; Dynamo specialises a length of 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(1) / x.shape[1]


@pytest.mark.parametrize("dynamic", [None, True], ids=["dynamic_unset", "dynamic_true"])
def test_a_length_outside_the_entrys_range_leaves_the_stance(dynamic: bool | None) -> None:
    """A length of 1 (0/1 specialisation) is not accepted by the dynamic entry: that
    call leaves the stance and compiles; lengths the entry accepts stay under it."""
    from helpers import guard_tuner

    torch.manual_seed(0)
    net, twin = Rows(), Rows()
    twin.load_state_dict(net.state_dict())
    lengths = [6] * 5 + [7] + [6] * 4 + [9, 6, 11, 6, 1, 6]
    xs = [torch.randn(3, n, 4) for n in lengths]
    stance: list[bool] = []
    got = []
    kwargs = {"backend": "eager", "dynamic": dynamic}
    with guard_tuner(net, measure_lookup=False, compile_kwargs=kwargs) as tuner:
        for x in xs:
            with tuner.step((x,)):
                got.append(net(x).detach())
                stance.append(stance_on())
    for i, (a, x) in enumerate(zip(got, xs)):
        assert torch.equal(a, twin(x).detach()), f"batch {i}"
    s = tuner.summary()
    reasons = [r["reason"] for r in s["rearms"]]
    assert any(r.startswith("unseen batch signature ((3, 1, 4)") for r in reasons), reasons
    assert stance[lengths.index(1)] is False
    for n in (9, 11):
        assert stance[lengths.index(n)] is True, (n, reasons)
    assert s["checked_batches"] >= 2
