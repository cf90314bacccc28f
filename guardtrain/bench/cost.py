"""``--callback-cost``: µs per training step of the callback's hooks in the steady state,
and of ``GuardTuner.step``.

Only public API: the callback's hooks, its ``engine`` (``batch_start`` /
``batch_end``), ``phase``, ``config`` and ``summary()``, and
:func:`guardtrain.signatures.batch_signature`.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from guardtrain.presets import PresetName

__all__ = ["callback_cost", "format_callback_cost"]

HOOKS = "hooks (on_train_batch_start + on_train_batch_end)"
TUNER_STEP = "GuardTuner.step (with tuner.step(batch): pass)"


def _per_step(fn: Callable[[], Any], n: int, repeats: int) -> float:
    """Median over ``repeats`` of the µs per call of ``n`` calls of ``fn`` (gc off)."""
    values = []
    for _ in range(repeats):
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            t1 = time.perf_counter_ns()
        finally:
            gc.enable()
        values.append((t1 - t0) / 1e3 / n)
    return statistics.median(values)


def _cprofile(fn: Callable[[], Any], n: int) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return buf.getvalue()


def _pieces(
    guard: Any, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
) -> dict[str, Callable[[], Any]]:
    """What is timed: the hooks as Lightning calls them, and their parts."""
    from guardtrain.signatures import batch_signature

    start, end = guard.on_train_batch_start, guard.on_train_batch_end
    engine = guard.engine

    def hooks() -> None:
        start(trainer, pl_module, batch, idx)
        end(trainer, pl_module, outputs, batch, idx)

    def empty() -> None:
        pass

    return {
        HOOKS: hooks,
        "engine.batch_start": lambda: engine.batch_start("train", batch, True),
        "engine.batch_end": lambda: engine.batch_end("train"),
        "batch_signature": lambda: batch_signature(batch),
        "phase (property)": lambda: guard.phase,
        "empty call (loop + lambda)": empty,
    }


def _lightning_classes() -> tuple[type, type]:
    """A tiny LightningModule and the probe callback (Lightning imported only here)."""
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Probe(L.Callback):
        """Times the guard callback's hooks once, inside a steady training batch."""

        def __init__(self, guard: Any, iterations: int, repeats: int, profile: bool) -> None:
            self.guard, self.iterations = guard, iterations
            self.repeats, self.profile = repeats, profile
            self.measured: dict[str, Any] = {}

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            guard = self.guard
            if self.measured or guard.phase != "steady" or batch_idx < 12:
                return
            pieces = _pieces(guard, trainer, pl_module, outputs, batch, batch_idx)
            m = self.measured
            m["us"] = {k: _per_step(f, self.iterations, self.repeats) for k, f in pieces.items()}
            m["audit_every"] = guard.config.audit_every
            m["steady"] = guard.phase == "steady"  # steady before (above) and after
            if self.profile:
                m["cprofile"] = _cprofile(pieces[HOOKS], self.iterations)
            trainer.should_stop = True

    return Net, Probe


def _tuner_step_cost(preset: PresetName, iterations: int, repeats: int) -> tuple[float, bool]:
    """µs per ``with tuner.step(batch): pass`` in the steady state, on the same batch.

    A tiny model trained for 16 real steps under :class:`~guardtrain.GuardTuner`
    (eager backend, the same warm-up as the callback's run) reaches the steady
    state; the timed steps then run no model (audits every ``audit_every`` steps
    included, amortised).
    """
    from guardtrain.tuner import GuardTuner

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = (torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
    with GuardTuner(
        model, preset, warmup_steps=4, stable_steps=2, compile_kwargs={"backend": "eager"}
    ) as tuner:
        for _ in range(16):
            with tuner.step(batch):
                loss = nn.functional.mse_loss(model(batch[0]), batch[1])
                loss.backward()
                opt.step()
                opt.zero_grad()
        if tuner.phase != "steady":
            raise RuntimeError(
                f"GuardTuner never reached the steady state (phase {tuner.phase!r}); "
                f"summary: {tuner.summary()}"
            )
        step = tuner.step

        def one_step() -> None:
            with step(batch):
                pass

        return _per_step(one_step, iterations, repeats), tuner.phase == "steady"


def _fit(guard: Any, probe: Any, net: Any) -> None:
    """A short ``Trainer.fit`` on random data with the guard callback and the probe."""
    import tempfile
    import warnings

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 16, 8, generator=g)
    y = torch.randn(64 * 16, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=CSVLogger(tmp),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[guard, probe],
        )
        trainer.fit(net, loader)


def callback_cost(
    preset: PresetName = "aggressive",
    iterations: int = 20000,
    repeats: int = 7,
    profile: bool = True,
) -> dict[str, Any]:
    """µs per training step of the callback's hooks in the steady state, and what costs what.

    A tiny real ``Trainer.fit`` (eager backend, a CSV logger) runs until the
    callback is steady; then, inside a later ``on_train_batch_end``, the
    callback's ``on_train_batch_start`` + ``on_train_batch_end`` are called
    directly on that batch ``iterations`` times (Lightning's hook dispatch is
    not included), ``repeats`` times; medians are reported. Then the same for
    ``with tuner.step(batch): pass`` of a steady :class:`~guardtrain.GuardTuner`
    (row ``GuardTuner.step``).
    """
    from guardtrain.callback import GuardTuneCallback

    guard = GuardTuneCallback(
        preset, warmup_steps=4, stable_steps=2, compile_kwargs={"backend": "eager"}
    )
    net_cls, probe_cls = _lightning_classes()
    probe = probe_cls(guard, iterations, repeats, profile)
    _fit(guard, probe, net_cls())
    measured = probe.measured
    if not measured:
        raise RuntimeError(
            f"the callback never reached the steady state (phase {guard.phase!r}); "
            f"summary: {guard.summary()}"
        )
    tuner_us, tuner_steady = _tuner_step_cost(preset, iterations, repeats)
    return {
        "torch": torch.__version__,
        "preset": preset,
        "iterations": iterations,
        "repeats": repeats,
        "us_per_step": {**measured["us"], TUNER_STEP: tuner_us},
        "steady": measured["steady"] and tuner_steady,
        "cprofile": measured.get("cprofile", ""),
        "audit_every": measured.get("audit_every"),
    }


def format_callback_cost(data: dict[str, Any]) -> str:
    lines = [
        f"callback cost, preset {data['preset']}, steady state, median of {data['repeats']} x "
        f"{data['iterations']} iterations (torch {data['torch']}); the hooks include the "
        f"callback's audit batch every {data.get('audit_every')} steps, amortised",
    ]
    width = max(len(k) for k in data["us_per_step"])
    for name, us in data["us_per_step"].items():
        lines.append(f"  {name.ljust(width)}  {us:7.2f} µs")
    if data.get("cprofile"):
        lines.append("")
        lines.append("cProfile of the hooks (tottime; cProfile inflates every call):")
        lines.append(data["cprofile"].strip())
    return "\n".join(lines)
