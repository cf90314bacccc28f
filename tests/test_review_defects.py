"""Defects a review found, each shown by a test that failed before its fix.

* the Trainer callback ended no batch whose model call ran inside an outer ``except``
  block (``sys.exc_info()`` set), although that call returned;
* a verify batch's comparison raised where one output leaf was a tensor and the other not;
* ``full_guard_calls`` and ``state_swaps`` started again at 0 after a checkpoint;
* an optimizer step's compile in an audit batch re-armed the model's loop (H49);
* a take-over whose owner was garbage-collected without ``release()`` was never given back.
"""

from __future__ import annotations

import contextlib
import gc
import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import guard_tuner
from torch import nn

from guardtrain.compile.verify import _compare
from guardtrain.engine.process import PROCESS

AOT = {"backend": "aot_eager"}


# -- the Trainer callback: a model call inside an outer except block -------------------------


def test_a_model_call_inside_an_except_block_ends_its_batch(tmp_path: Path) -> None:
    """A ``compute_loss`` that calls the model while it handles an exception of its own (a
    retry, a fallback): each call returned, so each is a batch that ends, and the run
    warms up and goes steady as any other."""
    pytest.importorskip("transformers")
    from hf_helpers import guard, trainer_for
    from transformers import Trainer

    class InsideExcept(Trainer):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                raise LookupError("handled around the model call")
            except LookupError:
                return super().compute_loss(model, inputs, *args, **kwargs)

    cb = guard()
    trainer = trainer_for(tmp_path, [cb], cls=InsideExcept, eval_n=0, max_steps=10)
    trainer.train()
    s = cb.summary()
    assert s["phase"] == "steady" and s["steady_steps"] > 0, (s["phase"], s["rearms"])
    assert s["warmup_steps_taken"] + s["steady_steps"] == 10, s
    cb.release()


@pytest.mark.parametrize("how", ["returns", "raises anew", "raises the handled one again"])
def test_the_hooks_tell_a_failed_call_inside_an_except_block(how: str) -> None:
    """The callback's test, on a plain module with the same two hooks: inside an outer
    ``except`` block, a call that returned did not raise; one that raised (a new
    exception, or the handled one again with a bare ``raise``) did."""
    pytest.importorskip("transformers")
    from guardtrain.hf import _handled, _raised

    seen: list[bool] = []
    began: list[Any] = []

    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if how == "raises anew":
                raise ValueError("in forward")
            if how == "raises the handled one again":
                raise  # the outer exception, which the caller handles
            return x

    model = Model()
    model.register_forward_pre_hook(lambda m, a: began.append(_handled()))
    model.register_forward_hook(lambda m, a, o: seen.append(_raised(began[0])), always_call=True)
    try:
        raise LookupError("outer")
    except LookupError:
        with contextlib.suppress(ValueError, LookupError):
            model(torch.ones(1))
    assert seen == [how != "returns"]


# -- verify batches: an output leaf that is a tensor on one side only ------------------------


def test_compare_reports_a_tensor_against_a_non_tensor() -> None:
    """Compiled and eager outputs with the same structure, one leaf a tensor on one side and
    a number on the other: a mismatch, described, never an exception."""
    got = _compare((torch.ones(3), 1), (torch.ones(3), torch.ones(2)), 1e-5, 1e-8)
    assert got is not None and got.startswith("output 1:"), got
    got = _compare({"a": torch.zeros(2)}, {"a": 0.0}, 1e-5, 1e-8)
    assert got is not None and got.startswith("output 0:"), got
    assert _compare((torch.ones(2), 3), (torch.ones(2), 3), 1e-5, 1e-8) is None


# -- a checkpoint keeps full_guard_calls and state_swaps -------------------------------------


def _autocast_run(tuner: Any, model: nn.Module, steps: int) -> None:
    """Autocast on odd steps (a flip between two known states each step, H46) and 6 rows
    instead of 4 at steps 10 and 13 (with a recompile limit of 1: full guards, H5)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with tuner:
        for i in range(steps):
            rows = 6 if i in (10, 13) else 4
            x, y = torch.randn(rows, 8, generator=g), torch.randn(rows, 1, generator=g)
            with tuner.step((x, y)):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 1):
                    out = model(x)
                nn.functional.mse_loss(out.float(), y).backward()
                opt.step()
                opt.zero_grad()


@pytest.fixture
def limit_of_one() -> Any:
    """Dynamo's recompile limit at 1 for the test."""
    with torch._dynamo.config.patch(recompile_limit=1):
        yield


def test_a_checkpoint_keeps_full_guard_calls_and_state_swaps(limit_of_one: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    kwargs: dict[str, Any] = {
        "compile_kwargs": {**AOT, "dynamic": False},
        "measure_lookup": False,
        "warmup_steps": 2,
        "stable_steps": 2,
    }
    first = guard_tuner(model, "aggressive", **kwargs)
    _autocast_run(first, model, 16)
    s = first.summary()
    assert s["full_guard_calls"] >= 2 and s["state_swaps"] >= 2, s
    buffer = io.BytesIO()
    torch.save(first.engine.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = guard_tuner(model, "aggressive", **kwargs)
    resumed.engine.load_state_dict(state)
    got = resumed.summary()
    assert (got["full_guard_calls"], got["state_swaps"]) == (
        s["full_guard_calls"],
        s["state_swaps"],
    ), got
    assert got["step"]["full_guard_calls"] == s["step"]["full_guard_calls"], got["step"]
    # The next run of the same engine goes on from them too.
    _autocast_run(first, model, 4)
    again = first.summary()
    assert again["full_guard_calls"] >= s["full_guard_calls"], again
    assert again["state_swaps"] >= s["state_swaps"], again
    # A checkpoint written before they were kept still loads: they start at 0.
    old = {k: v for k, v in state.items() if k not in ("full_guard_calls", "state_swaps")}
    older = guard_tuner(model, "aggressive", **kwargs)
    older.engine.load_state_dict(old)
    assert (older.summary()["full_guard_calls"], older.summary()["state_swaps"]) == (0, 0)


# -- an optimizer step's compile in an audit batch ------------------------------------------


def test_an_optimizer_step_compile_in_an_audit_does_not_rearm_the_model() -> None:
    """``compile_optimizer=True``: ``betas`` changed after step 7, so the step compiles again
    in batch 8, an audit (``audit_every=4``). The model's entries are unchanged: its loop
    stays steady; the step answers for its own compile (H49). Weights equal plain
    compile's."""
    from test_compile_optimizer import assert_same, loop

    def change(i: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if i == 7:
            opt.param_groups[0]["betas"] = (0.8, 0.99)

    plain, _ = loop("plain", change=change)
    got, s = loop("aggressive", change=change, audit_every=4)
    assert s is not None
    assert_same(plain, got, exact=True)
    steps = [e for e in s["compile_events"] if e["target"] == "Adam.step"]
    assert any(e["step"] == 8 for e in steps), s["compile_events"]  # counted as a compile
    assert s["rearms"] == [], [r["reason"][:80] for r in s["rearms"]]
    assert s["phase"] == "steady", s["phase"]


# -- a take-over whose owner is collected ----------------------------------------------------


def test_a_take_over_is_given_back_when_its_owner_is_collected() -> None:
    given: list[str] = []

    class Adapter:
        """What takes the compile over (collected without giving it back)."""

    key = Adapter()
    PROCESS.take(key, "a compile, taken over by a test", lambda: given.append("x"))
    assert PROCESS.changed() == ["a compile, taken over by a test"]
    del key
    gc.collect()
    assert given == ["x"] and PROCESS.changed() == []


def test_a_collected_trainer_callback_puts_accelerates_plugin_back(tmp_path: Path) -> None:
    """The Trainer and its callback dropped without ``release()``: accelerate's dynamo
    plugin compiles again, as it did before the callback took it over."""
    pytest.importorskip("transformers")
    from hf_helpers import guard, trainer_for

    cb = guard()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_for(
            tmp_path, [cb], torch_compile=True, torch_compile_backend="aot_eager", max_steps=1
        )
    plugin = trainer.accelerator.state.dynamo_plugin
    assert str(plugin.backend.value).lower() == "no"
    assert cb._plugins.taken is not None
    backend = cb._plugins.taken.backend
    del trainer, cb
    gc.collect()
    try:
        assert plugin.backend == backend and PROCESS.changed() == [], PROCESS.changed()
    finally:
        plugin.backend = backend


# -- the summary's compiles against Dynamo's own count ------------------------------------------


class Breaking(nn.Module):
    """Two linears with a graph break between them and a no-tensor frame after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def test_the_summary_says_what_its_compiles_count_beside_dynamos_graphs() -> None:
    """``summary()["compiles"]`` counts frame compiles (cache entries), Dynamo's
    ``unique_graphs`` counts graphs: with a graph break they differ, and the summary gives
    Dynamo's count beside its own, each named in the table."""
    from torch._dynamo.utils import counters

    model = Breaking()
    x = torch.randn(2, 4)
    before = counters["stats"]["unique_graphs"]
    with guard_tuner(model, "aggressive") as tuner:
        for _ in range(4):
            with tuner.step((x,)):
                model(x).sum().backward()
        s = tuner.summary()
        table = tuner.format_summary()
    assert s["graphs"] == counters["stats"]["unique_graphs"] - before, s["graphs"]
    assert s["graphs"] >= 1 and s["compiles"] >= 1
    line = next(row for row in table.splitlines() if row.strip().startswith("compiles"))
    assert f"{s['compiles']} frames" in line, line
    assert f"{s['graphs']} graphs by Dynamo's count" in line, line
