"""The recompile limit (H5): a target that reached it stays steady; a call that no entry
accepts runs with full guards, uncompiled, as Dynamo runs it under plain compile."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from helpers import EAGER, TinyModule, assert_same_run, guard, make_trainer
from torch.utils.data import DataLoader, TensorDataset


def varying_loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(120, 8, generator=g)
    y = torch.randn(120, 1, generator=g)
    sizes, batches, start = [16, 12, 10, 8], [], 0
    while start < 120:
        size = sizes[len(batches) % len(sizes)]
        batches.append(list(range(start, min(start + size, 120))))
        start += size
    return DataLoader(TensorDataset(x, y), batch_sampler=batches)


def run(callbacks: list[Any]) -> TinyModule:
    L.seed_everything(0, verbose=False)
    model = TinyModule()
    trainer = make_trainer(callbacks, max_epochs=2, limit_val_batches=0)
    trainer.fit(model, varying_loader())
    return model


@pytest.fixture
def low_limit() -> Any:
    cfg = torch._dynamo.config
    saved = cfg.recompile_limit
    cfg.recompile_limit = 2
    yield
    cfg.recompile_limit = saved


def test_a_target_at_the_recompile_limit_stays_steady(low_limit: Any) -> None:
    """Batches of 16, 12, 10 and 8 rows, static shapes, a limit of 2 entries: the sizes of
    the two entries compiled run under the stance, the others with full guards (Dynamo
    runs them uncompiled); every loss and weight equal to eager's, no re-arm for them."""
    eager = run([])
    cb = guard(compile_kwargs={**EAGER, "dynamic": False}, measure_lookup=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded = run([cb])
    assert_same_run(eager, guarded)
    s = cb.summary()
    assert s["stance_blocked"] is None, s["stance_blocked"]
    assert s["phase"] == "steady" and s["steady_steps"] > 0, s["rearms"]
    assert s["compiles"] == 2, s["compile_events"]
    # The two sizes without an entry, in each steady epoch's batches: full guards.
    assert s["full_guard_calls"] >= 2, s["full_guard_calls"]
    assert not [w for w in caught if "the stance stays off" in str(w.message)]
