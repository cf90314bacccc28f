"""End-to-end runs: every guarded run must equal an uncompiled run of the same model."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    PhaseSpy,
    Predicting,
    TinyModule,
    assert_restored,
    assert_same_run,
    compare,
    fit,
    guard,
    guard_without_lookup,
    loaders,
    make_trainer,
)
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging
from torch import nn

from guardtrain.presets import BENCH_GUARD_SHARE


@pytest.mark.parametrize("preset", ["off", "safe", "balanced", "aggressive", "turbo"])
def test_train_eval_switch_matches_eager(preset: str) -> None:
    cb, model = compare(TinyModule, lambda: guard(preset))
    s = cb.summary()
    assert s["compiles"] >= 2  # train and eval entries at least
    if preset in ("balanced", "aggressive", "turbo"):
        assert s["phase"] == "steady"
        assert s["steady_steps"] > 0
        assert s["phases"]["validate"] == "steady"
    else:
        assert s["phase"] == "off" and s["steady_steps"] == 0
    assert_restored(model)


def test_validation_step_that_enables_grad() -> None:
    cb, _ = compare(lambda: TinyModule(grad_in_val=True), lambda: guard())
    assert cb.summary()["steady_steps"] > 0


class HandCompiled(L.Callback):
    """What a user does by hand: torch.compile with an nn-module guard filter (H2)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.forward = torch.compile(
            pl_module.forward,
            backend="eager",
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )


def test_the_comparison_catches_stale_eval() -> None:
    """The eager comparison can fail: a hand-made filter reuses the training graph in eval."""
    L.seed_everything(0, verbose=False)
    eager = TinyModule(grad_in_val=True)
    fit(eager)
    L.seed_everything(0, verbose=False)
    unsafe = TinyModule(grad_in_val=True)
    fit(unsafe, [HandCompiled()])
    with pytest.raises(AssertionError, match="loss 0: eager"):
        assert_same_run(eager, unsafe)


def test_boundary_check_catches_eval_without_the_floor() -> None:
    """Even with the floor dropped, the boundary re-check sees `.training` change and rebuilds."""
    cb, _ = compare(lambda: TinyModule(grad_in_val=True), lambda: guard(unsafe_drop_floor=True))
    reasons = [r["reason"] for r in cb.summary()["rearms"]]
    assert any(".training: True -> False" in r for r in reasons), reasons


def test_short_last_batch_train_and_validation() -> None:
    cb, _ = compare(TinyModule, lambda: guard(), data={"n_train": 100, "n_val": 50})
    s = cb.summary()
    assert s["steady_steps"] > 0
    assert any("unseen batch signature" in r["reason"] for r in s["rearms"])


MODEL_CHANGE_PRESETS = ["aggressive", "turbo", "auto"]
"""A Lightning callback that changes the model runs under the preset the test was written
for, turbo's direct dispatch and the default (``auto``): a change of the per-call path
broke every stance preset under a stock callback before."""


def test_drop_last_has_no_rearm_in_training() -> None:
    cb, _ = compare(TinyModule, lambda: guard(), data={"n_train": 100, "drop_last": True})
    assert not [r for r in cb.summary()["rearms"] if r.get("loop") == "train"]


def test_sanity_check_disabled() -> None:
    cb, _ = compare(TinyModule, lambda: guard(), num_sanity_val_steps=0)
    assert cb.summary()["steady_steps"] > 0


@pytest.mark.parametrize("preset", MODEL_CHANGE_PRESETS)
def test_backbone_finetuning_unfreeze(preset: str) -> None:
    class FT(TinyModule):
        def configure_optimizers(self) -> Any:
            params = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.SGD(params, lr=0.05)

    # aot_eager: the eager backend follows requires_grad at run time and hides a stale
    # entry (H43). The unfrozen backbone runs code compiled for its new requires_grad
    # (H42), counted as a caught change.
    cb, _ = compare(
        FT,
        lambda: guard(preset, compile_kwargs={"backend": "aot_eager"}),
        extra=lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=2, verbose=False)],
        max_epochs=4,
    )
    caught = cb.summary()["caught_changes"]
    assert "requires_grad" in caught, caught
    assert "backbone.0.weight" in caught["requires_grad"]["first"], caught


class ReplaceHead(L.Callback):
    """At the start of epoch 2, replace the head's parameters with load_state_dict(assign=True)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 2:
            new = {k: torch.full_like(v, 0.01) for k, v in pl_module.head.state_dict().items()}
            pl_module.head.load_state_dict(new, assign=True)
            trainer.optimizers[0].param_groups[0]["params"] = list(pl_module.parameters())


@pytest.mark.parametrize("preset", MODEL_CHANGE_PRESETS)
def test_parameter_replaced_with_assign(preset: str) -> None:
    cb, _ = compare(TinyModule, lambda: guard(preset), extra=lambda: [ReplaceHead()], max_epochs=3)
    reasons = [r["reason"] for r in cb.summary()["rearms"]]
    assert any("replaced" in r for r in reasons), reasons


@pytest.mark.parametrize("preset", MODEL_CHANGE_PRESETS)
def test_stochastic_weight_averaging(preset: str) -> None:
    cb, _ = compare(
        TinyModule,
        lambda: guard(preset),
        extra=lambda: [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)],
        max_epochs=4,
    )
    assert cb.summary()["compiles"] > 0


class ChangeDropout(L.Callback):
    """A callback that changes a module attribute read in forward (dropout p)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 2:
            pl_module.backbone[3].p = 0.0


@pytest.mark.parametrize("preset", MODEL_CHANGE_PRESETS)
def test_changed_module_attribute_forces_recompile(preset: str) -> None:
    cb, _ = compare(
        TinyModule, lambda: guard(preset), extra=lambda: [ChangeDropout()], max_epochs=3
    )
    reasons = [r["reason"] for r in cb.summary()["rearms"]]
    assert any(".p: 0.3 -> 0.0" in r for r in reasons), reasons


class Autocast(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.current_epoch >= 1:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return super().training_step(batch, batch_idx)
        return super().training_step(batch, batch_idx)


def test_autocast_switched_on_mid_run() -> None:
    cb, _ = compare(Autocast, lambda: guard(), max_epochs=3)
    s = cb.summary()
    # An entry was compiled for autocast (no call ran an entry compiled without it), in
    # the code of the autocast state (each state has code of its own, H44).
    codes = [code for t in cb.engine.targets.kept for code in t.code.variants.values()]
    assert any(code.autocast and mode[3] for code in codes for mode in code.modes), s[
        "compile_events"
    ]
    assert not any(mode[3] for code in codes if not code.autocast for mode in code.modes)
    # The switch to autocast is a switch of code: no call left the stance for want of an
    # entry because of it (the entry the stance ran before was compiled without autocast).
    assert not any("autocast" in r["reason"] for r in s["rearms"]), s["rearms"]
    assert s["steady_steps"] > 0


class DoubleAtEpoch(L.Callback):
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            pl_module.double()


class DoubleBatches(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return super().training_step((x.to(self.dtype), y.to(self.dtype)), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        super().validation_step((x.to(self.dtype), y.to(self.dtype)), batch_idx)


def test_dtype_change() -> None:
    cb, _ = compare(DoubleBatches, lambda: guard(), extra=lambda: [DoubleAtEpoch()], max_epochs=3)
    reasons = [r["reason"] for r in cb.summary()["rearms"]]
    assert any("dtype" in r for r in reasons), reasons


class ResetDynamo(L.Callback):
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int
    ) -> None:
        if trainer.global_step == 2:
            torch._dynamo.reset()


def test_dynamo_reset_during_warmup() -> None:
    cb, _ = compare(TinyModule, lambda: guard(warmup_steps=4), extra=lambda: [ResetDynamo()])
    s = cb.summary()
    assert s["steady_steps"] > 0
    assert any(e["step"] == 2 for e in s["compile_events"]), s["compile_events"]


class SelfForward(TinyModule):
    """Calls self.forward(x) as the lightning-hydra-template does; one child with parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(self.backbone, self.head)
        del self.backbone, self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.forward(x), y)
        self.train_losses.append(loss.detach().clone())
        return loss


def test_self_forward_uses_compiled_code() -> None:
    cb, model = compare(SelfForward, lambda: guard())
    s = cb.summary()
    assert s["targets"] == ["net"]
    assert s["compiles"] > 0 and s["steady_steps"] > 0
    assert list(model.state_dict())[0] == "net.0.0.weight"


class Blocks(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.1)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_regional_compile_of_identical_blocks() -> None:
    cb, model = compare(
        Blocks, lambda: guard(targets=["blocks.*"], compile_kwargs={"backend": "aot_eager"})
    )
    s = cb.summary()
    assert s["targets"] == ["blocks.0", "blocks.1", "blocks.2"]
    # One shared code object (H24): a trace per mode and input kind, not per block.
    assert s["shared_code"] == [
        {"class": "Sequential", "targets": ["blocks.0", "blocks.1", "blocks.2"]}
    ]
    assert 2 <= s["compiles"] <= 4
    assert s["steady_steps"] > 0
    assert_restored(model)


class Boom(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 8:
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)


def test_exception_in_training_step_restores_everything() -> None:
    model = Boom()
    cb = guard_without_lookup()  # the lookup window's steps run with full guards
    with pytest.raises(RuntimeError, match="boom"):
        fit(model, [cb])
    assert cb.summary()["steady_steps"] > 0  # the exception came in the steady state
    assert_restored(model)
    # The process is still usable: an uncompiled and a guarded run agree.
    compare(TinyModule, lambda: guard())


def test_keyboard_interrupt_restores_everything() -> None:
    class Interrupt(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 7:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    model = Interrupt()
    cb = guard_without_lookup()
    with pytest.raises(SystemExit):  # Lightning 2.6 ends the run with exit code 1
        fit(model, [cb])
    assert cb.summary()["steady_steps"] > 0
    assert_restored(model)


def test_two_fits_in_one_process() -> None:
    compare(TinyModule, lambda: guard())
    cb, _ = compare(TinyModule, lambda: guard())
    assert cb.summary()["steady_steps"] > 0


def test_summary_counts_and_log(caplog: pytest.LogCaptureFixture) -> None:
    """Every training step is a warm-up or a steady one (no lookup window here: its
    steps with full guards are neither)."""
    model = TinyModule()
    cb = guard_without_lookup()
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        fit(model, [cb])
    s = cb.summary()
    train_batches = 3 * 7
    assert s["warmup_steps_taken"] + s["steady_steps"] == train_batches
    assert s["preset"] == "aggressive"
    assert isinstance(s["rearms"], list)
    logged = [r.getMessage() for r in caplog.records if "guardtrain summary" in r.getMessage()]
    assert len(logged) == 1
    assert f"steady steps     {s['steady_steps']}" in logged[0]


def test_checkpoint_save_and_resume(tmp_path: Any) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
    model = TinyModule()
    cb = guard_without_lookup()
    fit(model, [cb, ckpt], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path)
    first = cb.summary()
    assert first["phase"] == "steady"
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]
    saved = next(v for k, v in state.items() if k.startswith("GuardTuneCallback"))
    assert saved["compiles"] == first["compiles"]

    resumed = guard_without_lookup()
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(
        [resumed], max_epochs=3, enable_checkpointing=True, default_root_dir=tmp_path
    )
    train, val = loaders()
    model2 = TinyModule()
    spy = PhaseSpy(resumed)
    trainer.callbacks.append(spy)
    trainer.fit(model2, train, val, ckpt_path=str(tmp_path / "last.ckpt"))
    assert spy.phases[0] == "warmup"
    assert "steady" in spy.phases
    s = resumed.summary()
    assert s["compiles"] > first["compiles"]
    assert s["warmup_steps_taken"] + s["steady_steps"] == 3 * 7


def test_logger_gets_metrics_on_change(tmp_path: Any) -> None:
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="run")
    fit(TinyModule(), [guard()], logger=logger)
    logger.save()
    text = (tmp_path / "run" / "version_0" / "metrics.csv").read_text()
    header = text.splitlines()[0]
    assert "guard/phase" in header and "guard/compiles" in header and "guard/rearms" in header
    rows = [line for line in text.splitlines()[1:] if line.strip()]
    assert 1 < len(rows) < 3 * 7  # on change, not every step


def test_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARDTRAIN_DISABLE", "1")
    model = TinyModule()
    cb = guard()
    fit(model, [cb])
    s = cb.summary()
    assert s["disabled"] and s["compiles"] == 0 and s["phase"] == "off"
    assert_restored(model)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_validate_test_predict_match_eager(stage: str) -> None:
    model = Predicting()
    _, val = loaders()
    model.eval()
    with torch.no_grad():
        ref = [model(x) for x, _ in val] * 3
    model.train()
    cb = guard()
    trainer = make_trainer([cb])
    outputs = []
    compiles = []
    for _ in range(3):  # each call is a run of its own, restored after
        result = getattr(trainer, stage)(model, val)
        assert_restored(model)
        compiles.append(cb.summary()["compiles"])
        if stage == "predict":
            outputs.extend(result)
    got = outputs if stage == "predict" else model.val_losses
    if stage != "predict":
        ref = [torch.nn.functional.mse_loss(r, y) for r, (_, y) in zip(ref, list(val) * 3)]
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    # The first call compiles; the later ones reinstall its code and compile nothing (H28).
    assert compiles[0] > 0 and compiles == [compiles[0]] * 3
    assert cb.summary()["steady_steps"] == 0


def test_a_target_compiled_with_compile_is_taken_over() -> None:
    def factory() -> TinyModule:
        model = TinyModule()
        model.head.compile(backend="eager")
        return model

    cb, model = compare(factory, lambda: guard(targets=["head"]))
    assert cb.summary()["took_over"] == ["head (nn.Module.compile)"]
    assert model.head._compiled_call_impl is not None  # put back after the run


@pytest.mark.slow
def test_inductor_end_to_end() -> None:
    torch._inductor.config.fallback_random = True
    try:
        cb, _ = compare(
            TinyModule, lambda: guard(compile_kwargs={"backend": "inductor"}), exact=False
        )
    finally:
        torch._inductor.config.fallback_random = False
    assert cb.summary()["steady_steps"] > 0


def test_copy_of_callback_is_independent() -> None:
    cb = guard()
    other = copy.deepcopy(cb)
    fit(TinyModule(), [cb])
    assert other.summary()["compiles"] == 0


class BypassesTarget(TinyModule):
    """training_step uses the backbone's parts directly, so the `backbone` target never runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.backbone:
            x = layer(x)
        return self.head(x)


def test_warns_when_a_target_never_runs() -> None:
    cb = guard(targets=["backbone"])
    with pytest.warns(UserWarning, match=r"\['backbone'\] ran uncompiled all run"):
        fit(BypassesTarget(), [cb], max_epochs=1)
    assert cb.summary()["uncompiled_targets"] == ["backbone"]


class EvalProbe(L.Callback):
    """Calls the model in eval mode between steady training steps, as an EMA/probe would."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step < 15 or trainer.global_step % 3:  # under the stance by then
            return
        pl_module.eval()
        with torch.no_grad():  # eval + no_grad: compiled by validation already
            got = pl_module(self.x)
            ref = type(pl_module).forward(pl_module, self.x)  # the plain, uncompiled forward
        self.pairs.append((got, ref))
        got = pl_module(self.x).detach()  # eval with grad: a combination never compiled
        ref = type(pl_module).forward(pl_module, self.x).detach()
        self.pairs.append((got, ref))
        pl_module.train()


def test_eval_call_between_steady_steps_is_correct() -> None:
    """An eval-mode call from a callback between steady steps: the stance does not check
    ``training`` (H1); a (training, grad) combination never compiled leaves it first."""
    probe = EvalProbe()
    model = TinyModule()
    cb = guard()
    fit(model, [cb, probe])
    assert len(probe.pairs) >= 3
    for got, ref in probe.pairs:
        assert torch.equal(got, ref)
    reasons = [r["reason"] for r in cb.summary()["rearms"]]
    assert any("training=False, grad enabled=True" in r for r in reasons), reasons


def test_lookup_is_measured_and_logged(tmp_path: Any) -> None:
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="run")
    # The window profiles Dynamo's entry path, which turbo's direct calls skip
    # (test_turbo.py checks that turbo reports no figure).
    cb = guard(direct_dispatch=False, measure_lookup=True)
    compare(TinyModule, lambda: cb, logger=logger)  # measuring changes no result
    logger.save()
    lookup = cb.summary()["lookup_us"]
    assert set(lookup) == {"full_guards", "steady", "saving"}
    assert lookup["full_guards"] > 0 and lookup["steady"] > 0
    header = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "guard/lookup_us" in header
    assert "under the stance" in cb.format_summary()


def test_no_profiler_runs_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure_lookup`` is off by default: nothing starts the torch profiler in the run,
    and the summary's bottom line comes from counters and the full guard checks timed in
    the run's check windows (an estimate of the saving, said to be one)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the torch profiler was started")

    monkeypatch.setattr(torch.autograd.profiler, "profile", refuse)
    cb = guard(direct_dispatch=False)
    fit(TinyModule(), [cb])
    s = cb.summary()
    assert s["lookup_us"] == {} and s["steady_steps"] > 0, s
    step = s["step"]
    assert step["saved_us"] > 0 and "estimated" in step["note"], step
    assert step["guards_share"] is None and step["why"] is None, step
    assert step["saved_share"] == pytest.approx(
        step["saved_us"] / (step["median_us"] + step["saved_us"]), abs=1e-3
    )
    # Aggressive: no direct calls, no generate(); every steady call under the stance.
    assert s["step"]["direct_calls"] == s["step"]["generate_calls_served"] == 0
    assert s["step"]["full_guard_calls"] == 0
    assert s["step"]["guards_per_call"] > 0
    assert s["step"]["bench_guard_share"] == BENCH_GUARD_SHARE["aggressive"]
    table = cb.format_summary()
    assert "steady calls: 0 with full guards, the others under the stance" in table
    assert f"guardtrain saved about {step['saved_us']:.1f} µs/step" in table
    assert "the bench measured aggressive's guard and pre-graph time" in table


def test_lookup_window_leaves_a_users_profiler_alone() -> None:
    cb = guard(measure_lookup=True)
    with torch.autograd.profiler.profile():
        fit(TinyModule(), [cb])
    assert cb.summary()["lookup_us"] == {}
    assert cb.summary()["steady_steps"] > 0
