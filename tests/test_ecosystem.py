"""How real projects touch a compiled model: copies, their own compiles, summaries, more calls.

Every run is compared with an uncompiled run of the same model (bitwise, eager backend).
"""

from __future__ import annotations

import copy
import io
import logging
import types
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    Net,
    NetModule,
    OptimizedModule,
    Predicting,
    assert_restored,
    compare,
    guard,
    loaders,
    make_trainer,
)
from torch import nn

import guardtrain.compile.call_mode
from guardtrain import versions


def snapshot(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def assert_plain_copy(copied: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """``copied`` carries no guardtrain attribute and computes like an eager Net with ``weights``."""
    for name, sub in copied.named_modules():
        assert "forward" not in vars(sub), f"{name or 'root'}: a forward attribute was copied"
        assert "__getstate__" not in vars(sub), f"{name or 'root'}: __getstate__ was copied"
    reference = Net()
    reference.load_state_dict(weights)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    for training in (True, False):
        copied.train(training)
        reference.train(training)
        torch.manual_seed(5)
        got = copied(x)
        torch.manual_seed(5)
        assert torch.equal(got, reference(x)), f"copy differs from eager (training={training})"


class CopyingModule(NetModule):
    """Copies, pickles and saves its net during training, as EMA or checkpoint code does."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, nn.Module, dict[str, torch.Tensor]]] = []
        self.callback: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        phase = self.callback.phase if self.callback is not None else "none"
        if batch_idx in (1, 5) or (
            phase == "steady" and not any(p == phase for p, *_ in self.copies)
        ):
            state = torch.random.get_rng_state()
            buffer = io.BytesIO()
            torch.save(self.net, buffer)
            buffer.seek(0)
            deep = copy.deepcopy(self.net)
            with torch.no_grad():  # the copy runs its own weights, not the original's (H29)
                for p in deep.parameters():
                    p.mul_(0.5)
            self.copies.append((phase, deep, snapshot(deep)))
            self.copies.append((phase, torch.load(buffer, weights_only=False), snapshot(self.net)))
            torch.random.set_rng_state(state)
        return super().training_step(batch, batch_idx)


def test_copies_pickles_and_saves_are_plain_modules_in_every_phase() -> None:
    """H17, H29: pickle, torch.save and deepcopy work in warm-up and under the stance."""

    def factory() -> CopyingModule:
        return CopyingModule()

    holder: dict[str, Any] = {}

    def callback() -> Any:
        holder["cb"] = guard()
        return holder["cb"]

    class Attach(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            pl_module.callback = holder.get("cb")

    cb, model = compare(factory, callback, extra=lambda: [Attach()])
    phases = {phase for phase, *_ in model.copies}
    assert {"warmup", "steady"} <= phases, phases
    for _, copied, weights in model.copies:
        assert_plain_copy(copied, weights)
    assert cb.summary()["steady_steps"] > 0
    assert_restored(model)


def test_pickle_of_the_whole_lightning_module_mid_run() -> None:
    """The LightningModule pickled with its compiled net (the template's hparams) loads back."""
    seen: list[bytes] = []

    class Save(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == 12:
                buffer = io.BytesIO()
                torch.save(pl_module, buffer)
                seen.append(buffer.getvalue())

    compare(NetModule, lambda: guard(), extra=lambda: [Save()])
    assert len(seen) == 2  # the eager run and the guarded one
    loaded = torch.load(io.BytesIO(seen[1]), weights_only=False)
    for name, sub in loaded.named_modules():
        assert "forward" not in vars(sub) and "__getstate__" not in vars(sub), name


def test_a_net_compiled_in_the_modules_setup_is_taken_over(
    recwarn: pytest.WarningsRecorder,
) -> None:
    """H29: `self.net = torch.compile(self.net)` in `setup`: compiled once, by guardtrain."""
    cb, model = compare(lambda: NetModule(compile_net=True), lambda: guard())
    s = cb.summary()
    assert s["targets"] == ["net._orig_mod"]
    assert s["took_over"] == ["net (torch.compile)"]
    assert s["steady_steps"] > 0
    assert [str(w.message) for w in recwarn if "took over" in str(w.message)] == [
        "guardtrain: took over the compile of net (torch.compile): GuardTuneCallback compiles "
        "the original module once itself (state_dict keys stay as they are); drop your own "
        "torch.compile call to silence this."
    ]
    assert all(key.startswith("net._orig_mod.") for key in model.state_dict())
    # Restored: the wrapper compiles as the user asked once guardtrain is gone.
    assert isinstance(model.net, OptimizedModule)
    assert hasattr(model.net.__dict__["forward"], "_torchdynamo_orig_callable")
    assert "forward" not in vars(model.net._orig_mod)


def test_compiled_modules_inside_a_target_are_taken_over() -> None:
    """`nn.Module.compile()` and a compiled `forward` below the target stop compiling alone."""

    def factory() -> NetModule:
        model = NetModule()
        model.net.lin.compile(backend="eager")
        model.net.out.forward = torch.compile(model.net.out.forward, backend="eager")
        return model

    cb, model = compare(factory, lambda: guard(targets=["net"]))
    assert sorted(cb.summary()["took_over"]) == [
        "net.lin (nn.Module.compile)",
        "net.out (a compiled forward)",
    ]
    assert cb.summary()["steady_steps"] > 0
    assert model.net.lin._compiled_call_impl is not None  # restored
    assert hasattr(model.net.out.__dict__["forward"], "_torchdynamo_orig_callable")


class WithExample(NetModule):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(4, 8)


@pytest.mark.parametrize("bypass", [True, False], ids=["dispatch-mode", "rebuild"])
def test_model_summary_with_example_input(bypass: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """H18: ModelSummary's FLOP count runs under a dispatch mode; the target still compiles.

    ``dispatch-mode``: the call under the mode runs eagerly and Dynamo never sees it.
    ``rebuild``: without that check Dynamo marks the code skipped; the first training
    batch rebuilds the target.
    """
    if not bypass:
        monkeypatch.setattr(guardtrain.compile.call_mode, "dispatch_mode_active", lambda: False)
    cb, _ = compare(WithExample, lambda: guard(), enable_model_summary=True)
    s = cb.summary()
    assert s["compiles"] >= 2 and s["steady_steps"] > 0
    assert s["uncompiled_targets"] == []
    rebuilt = [r for r in s["rearms"] if "Dynamo skipped its code" in r["reason"]]
    assert len(rebuilt) == (0 if bypass else 1)


def test_a_target_that_never_compiles_never_enters_the_stance() -> None:
    """Dynamo skips the target every time: no stance, and the summary says so."""
    with torch._dynamo.config.patch(disable=True):
        cb, _ = compare(NetModule, lambda: guard())
    s = cb.summary()
    assert s["compiles"] == 0 and s["steady_steps"] == 0
    assert s["uncompiled_targets"] == ["net"]
    assert s["stance_blocked"] is not None


class NetPredicting(Predicting, NetModule):
    """:class:`helpers.Predicting` on :class:`helpers.NetModule` (one child target, ``net``)."""


@pytest.mark.parametrize("inference_mode", [False, True])
def test_validate_test_predict_after_fit(
    inference_mode: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """H28: later trainer calls reuse fit's compiled code; the summary goes on."""
    outputs: dict[str, list[Any]] = {}
    callbacks: dict[str, Any] = {}
    for run in ("eager", "guarded"):
        L.seed_everything(0, verbose=False)
        model = NetPredicting()
        cb = guard(measure_lookup=True) if run == "guarded" else None
        trainer = make_trainer([cb] if cb else [], inference_mode=inference_mode)
        train, val = loaders()
        trainer.fit(model, train, val)
        if cb is not None:
            callbacks["fit"] = dict(cb.summary())
            assert_restored(model)
        trainer.validate(model, val, verbose=False)
        trainer.test(model, val, verbose=False)
        predictions = trainer.predict(model, val)
        outputs[run] = [*model.val_losses, *predictions]
        if cb is not None:
            callbacks["after"] = dict(cb.summary())
            assert_restored(model)
    assert len(outputs["eager"]) == len(outputs["guarded"])
    for i, (a, b) in enumerate(zip(outputs["eager"], outputs["guarded"])):
        assert torch.equal(a, b), f"output {i} differs"
    fit_s, after = callbacks["fit"], callbacks["after"]
    # One new entry for inference mode at most, and none with inference_mode=False.
    assert after["compiles"] - fit_s["compiles"] == (1 if inference_mode else 0)
    assert after["steady_steps"] == fit_s["steady_steps"] > 0
    assert after["lookup_us"] == fit_s["lookup_us"]
    # Profiled unless direct dispatch skips the entry path that the window times.
    assert ("steady" in fit_s["lookup_us"]) != fit_s["direct_dispatch"]["on"]
    assert after["rearms"][: len(fit_s["rearms"])] == fit_s["rearms"]


def test_summary_is_logged_once_per_trainer_call(caplog: pytest.LogCaptureFixture) -> None:
    model = NetPredicting()
    cb = guard()
    trainer = make_trainer([cb], max_epochs=1)
    train, val = loaders()
    with caplog.at_level(logging.INFO):
        logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.INFO)
        try:
            trainer.fit(model, train, val)
            trainer.validate(model, val, verbose=False)
        finally:
            logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    assert sum("guardtrain summary" in r.getMessage() for r in caplog.records) == 2


def test_lookup_windows_count_training_calls_only() -> None:
    """H27: a window open when validation starts must not count validation's calls.

    Eight batches per epoch; the stance is entered after batch 4, so a window is
    still open when the first validation pass starts: it closes there, on the
    training batches it measured.
    """
    cb, _ = compare(
        NetModule,
        lambda: guard(
            warmup_steps=4,
            stable_steps=1,
            measure_lookup=True,
            lookup_window=3,
            direct_dispatch=False,  # the window times the entry path that turbo skips
        ),
        data={"n_train": 128, "n_val": 64},
    )
    calls = cb.summary()["lookup_calls"]
    assert set(calls) == {"full_guards", "steady"}
    assert min(w["steps"] for w in calls.values()) < 3  # cut short by the validation pass
    for window in calls.values():  # one compiled call per training step, none of validation's
        assert window["lookups"] == window["steps"] >= 1, calls
    assert set(cb.summary()["lookup_us"]) == {"full_guards", "steady", "saving"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


regions = types.SimpleNamespace(scaled=torch.compiler.nested_compile_region(_scaled))


class RegionNet(nn.Module):
    def __init__(self, hidden_region: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 1)
        self.hidden_region = hidden_region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_region:  # reached through an attribute: only the first trace finds it
            return self.out(regions.scaled(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@pytest.mark.parametrize("hidden_region", [False, True], ids=["forward", "attribute"])
def test_nested_compile_region_compiles_without_free_tensors(hidden_region: bool) -> None:
    """H23: install_free_tensors cannot trace a nested compile region; it is switched off."""

    class RegionModule(NetModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = RegionNet(hidden_region)

    # torch 2.11 and 2.12 cannot run a nested region's backward with backend="eager", also
    # without guardtrain ("fake_mode should be enabled for HOPs"); aot_eager can (H36).
    kwargs = {"backend": "aot_eager"} if versions.release() < (2, 13) else {}
    cb, _ = compare(RegionModule, lambda: guard(**({"compile_kwargs": kwargs} if kwargs else {})))
    s = cb.summary()
    off = [o for o in s["switched_off"] if o["lever"] == "install_free_tensors for 'net'"]
    assert len(off) == 1 and "H23" in off[0]["why"], s["switched_off"]
    assert s["steady_steps"] > 0 and s["compiles"] >= 2
