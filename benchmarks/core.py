"""The speed suite's parts: a workload, one configuration of it (a runner), and its turns.

A :class:`Runner` is one configuration of one workload with its own copy of the model.
:meth:`Runner.turn` runs ``settle`` untimed steps and then ``timed`` timed ones and
returns a :class:`Turn`: the wall time of each timed step, whether guardtrain counted
it steady, and every step's loss. Each guardtrain turn is one run of its adapter (a
``with tuner:`` block, one ``trainer.fit``, one ``trainer.train()``): the run warms up
in the untimed steps, and its compiled code stays from run to run. Three drivers:

* :class:`LoopRunner`: a plain loop, with :class:`~guardtrain.GuardTuner` around each
  step (Fabric too);
* :class:`LightningRunner`: one ``Trainer.fit`` per turn, with
  :class:`~guardtrain.GuardTuneCallback`;
* :class:`HFRunner`: one ``Trainer.train()`` per turn (the same ``Trainer``), with
  :class:`~guardtrain.GuardTrainerCallback`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from guardtrain.presets import PRESETS

__all__ = [
    "PLAIN",
    "HFRunner",
    "LightningRunner",
    "LoopJob",
    "LoopRunner",
    "Runner",
    "Setting",
    "SteadyProbe",
    "Turn",
    "Workload",
    "frames",
    "quiet",
]

PLAIN = "compile"
"""The configuration every other is compared with: the library's own way to compile."""


def frames() -> int:
    """Dynamo frame compiles in this process so far."""
    return int(torch._dynamo.utils.counters["frames"]["ok"])


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a workload builds one configuration for."""

    config: str
    """``eager``, ``compile`` (plain compile, the library's way) or a preset name."""
    backend: str
    tiny: bool = False
    warmup_steps: int = 4
    """The adapters' ``warmup_steps``, in training steps (the HF runner multiplies by
    the model calls per step)."""
    stable_steps: int = 2
    compile_optimizer: bool = False
    """``--compile-optimizer``: the presets run with ``compile_optimizer=True``, plain compile
    with PyTorch's recipe (``torch.compile(opt.step)``, the learning rate a tensor)."""

    @property
    def preset(self) -> str | None:
        """The adapters' preset: a name of :data:`~guardtrain.presets.PRESETS`, or ``auto``."""
        return self.config if self.config in PRESETS or self.config == "auto" else None

    @property
    def compiled(self) -> bool:
        return self.config != "eager"

    def guard_kwargs(self, calls_per_step: int = 1, **extra: Any) -> dict[str, Any]:
        """The adapters' arguments: this backend, the short warm-up, no lookup window (its
        profiled batches would fall into the timed steps), no metrics."""
        values: dict[str, Any] = {
            "compile_kwargs": {"backend": self.backend},
            "warmup_steps": self.warmup_steps * calls_per_step,
            "stable_steps": self.stable_steps * calls_per_step,
            "measure_lookup": False,
            "log_metrics": False,
        }
        values.update(extra)
        return values


@dataclasses.dataclass
class Turn:
    """One turn of one configuration."""

    times: list[float]
    """Seconds per timed step, by the wall clock."""
    cpu: list[float]
    """Seconds of the calling thread's CPU time per timed step (at one torch thread the whole
    CPU step runs on it, and other processes' load does not count)."""
    steady: list[bool]
    """Per timed step: guardtrain counted it steady and nothing re-armed or compiled
    in it (always False without guardtrain)."""
    losses: list[float]
    """Every step's loss, untimed ones first."""


class SteadyProbe:
    """Reads an adapter's counters between steps (never inside a timed step)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self._before: tuple[int, int, int] = (0, 0, 0)

    def _now(self) -> tuple[int, int, int]:
        s = self.adapter.summary()
        return s["steady_steps"], len(s["rearms"]), s["compiles"]

    def mark(self) -> None:
        self._before = self._now()

    def steady(self) -> bool:
        """Since :meth:`mark`: steady batches counted, no re-arm, no compile."""
        steady, rearms, compiles = self._now()
        b = self._before
        return steady > b[0] and rearms == b[1] and compiles == b[2]


class Runner:
    """One configuration of one workload (its own model); see the module docstring."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.adapter: Any = None
        """The guardtrain adapter (None for ``eager`` and ``compile``)."""
        self.notes: list[str] = []

    def turn(self, settle: int, timed: int, seed: int) -> Turn:
        raise NotImplementedError

    def summary(self) -> dict[str, Any] | None:
        return None if self.adapter is None else self.adapter.summary()

    def close(self) -> None:
        """Put back what the configuration changed outside its turns (nothing by default)."""


class _Clock:
    """Per-step wall times of one turn, and the steady flags, for the callback drivers."""

    def __init__(self, settle: int, probe: SteadyProbe | None) -> None:
        self.settle = settle
        self.probe = probe
        self.step = 0
        self.t0 = self.c0 = 0.0
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.steady: list[bool] = []

    def begin(self) -> None:
        if self.probe is not None and self.step >= self.settle:
            self.probe.mark()
        self.t0, self.c0 = time.perf_counter(), time.thread_time()

    def end(self) -> None:
        t, c = time.perf_counter() - self.t0, time.thread_time() - self.c0
        if self.step >= self.settle:
            self.times.append(t)
            self.cpu.append(c)
            self.steady.append(self.probe is not None and self.probe.steady())
        self.step += 1


# -- plain loops -------------------------------------------------------------------------------


class LoopJob:
    """A plain training loop: the model, its step, and how the library's users compile it.

    Subclasses set :attr:`model` (what :class:`~guardtrain.GuardTuner` gets) and
    :attr:`opt` (with :meth:`adamw`), and implement :meth:`step` (its optimizer step
    through :meth:`update`) and :meth:`compile_plain`.
    """

    model: nn.Module
    opt: Any = None
    """The optimizer (what ``compile_optimizer=True`` compiles)."""
    fabric: Any = None
    tuner_kwargs: dict[str, Any] | None = None
    """More arguments of :class:`~guardtrain.GuardTuner` (``targets``)."""
    _opt_step: Any = None

    def adamw(self, params: Any, lr: float, setting: Setting) -> torch.optim.Optimizer:
        """AdamW over ``params``; with ``--compile-optimizer`` its learning rate a tensor, as
        PyTorch's recipe for a compiled step has it (a scheduler then fills it in place)."""
        rate: Any = torch.tensor(lr) if setting.compile_optimizer else lr
        return torch.optim.AdamW(params, lr=rate)

    def update(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward, the optimizer step (PyTorch's recipe compiles it), ``zero_grad``; the
        loss, detached."""
        if self.fabric is not None:
            self.fabric.backward(loss)
        else:
            loss.backward()
        (self._opt_step or self.opt.step)()
        self.opt.zero_grad()
        return loss.detach()

    def compile_step(self, backend: str) -> None:
        """PyTorch's recipe for the optimizer step: ``torch.compile(opt.step)``."""
        self._opt_step = torch.compile(self.opt.step, backend=backend)

    def batch(self, i: int) -> Any:
        """What ``tuner.step`` gets for step ``i``."""
        return i

    def step(self, i: int) -> torch.Tensor:
        """One whole training step (forward, loss, backward, optimizer); the loss, detached."""
        raise NotImplementedError

    def compile_plain(self, backend: str) -> None:
        raise NotImplementedError


class LoopRunner(Runner):
    """A plain loop; with a preset, :class:`~guardtrain.GuardTuner` wraps each step and
    each turn is one ``with tuner:`` block."""

    def __init__(self, setting: Setting, job: LoopJob) -> None:
        super().__init__(setting)
        self.job = job
        self.i = 0
        extra = dict(job.tuner_kwargs or {})
        if setting.compile_optimizer:
            extra.update(compile_optimizer=True, optimizers=[job.opt])
        if setting.preset is not None:
            from guardtrain import GuardTuner

            self.adapter = GuardTuner(
                job.model,
                setting.preset,  # type: ignore[arg-type]
                fabric=job.fabric,
                **setting.guard_kwargs(**extra),
            )
        elif setting.compiled:
            job.compile_plain(setting.backend)
            if setting.compile_optimizer:
                job.compile_step(setting.backend)

    def turn(self, settle: int, timed: int, seed: int) -> Turn:
        torch.manual_seed(seed)
        job, tuner = self.job, self.adapter
        probe = SteadyProbe(tuner) if tuner is not None else None
        times: list[float] = []
        cpu: list[float] = []
        steady: list[bool] = []
        losses: list[torch.Tensor] = []
        perf, thread = time.perf_counter, time.thread_time
        with tuner if tuner is not None else contextlib.nullcontext():
            for k in range(settle + timed):
                i = self.i
                self.i += 1
                if probe is not None and k >= settle:
                    probe.mark()
                if tuner is not None:
                    batch = job.batch(i)
                    t0, c0 = perf(), thread()
                    with tuner.step(batch):
                        loss = job.step(i)
                    t, c = perf() - t0, thread() - c0
                else:
                    t0, c0 = perf(), thread()
                    loss = job.step(i)
                    t, c = perf() - t0, thread() - c0
                losses.append(loss)
                if k >= settle:
                    times.append(t)
                    cpu.append(c)
                    steady.append(probe is not None and probe.steady())
        return Turn(times, cpu, steady, [float(x) for x in losses])


# -- Lightning -----------------------------------------------------------------------------------


class LightningRunner(Runner):
    """One ``Trainer.fit`` over ``settle+timed`` batches per turn, on the same
    LightningModule; with a preset, one :class:`~guardtrain.GuardTuneCallback` for all
    fits (each fit is a run). A step is timed from the first ``on_train_batch_start``
    hook (a callback placed before guardtrain's) to the last ``on_train_batch_end`` hook
    (one placed after it): the training step, the backward, the optimizer step and
    both adapters' hooks; the data loading is not in it.

    Args:
        module: the LightningModule; its ``training_step`` returns the loss.
        batches: step ``i``'s batch.
        compile_plain: the plain configuration's compile of ``module`` (its network).
        targets: the callback's ``targets``.
    """

    def __init__(
        self,
        setting: Setting,
        module: Any,
        batches: Callable[[int], Any],
        compile_plain: Callable[[Any, str], None],
        targets: list[str] | None = None,
    ) -> None:
        super().__init__(setting)
        self.module = module
        self.batches = batches
        self.i = 0
        if setting.preset is not None:
            from guardtrain import GuardTuneCallback

            self.adapter = GuardTuneCallback(
                setting.preset,  # type: ignore[arg-type]
                **setting.guard_kwargs(targets=targets),
            )
        elif setting.compiled:
            compile_plain(module, setting.backend)

    def turn(self, settle: int, timed: int, seed: int) -> Turn:
        import lightning as L
        from lightning.pytorch.callbacks import Callback

        n = settle + timed
        data = [self.batches(self.i + k) for k in range(n)]
        self.i += n
        clock = _Clock(settle, SteadyProbe(self.adapter) if self.adapter is not None else None)
        losses: list[torch.Tensor] = []

        class Begin(Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                clock.begin()

        class End(Callback):
            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *a: Any) -> None:
                clock.end()
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                losses.append(loss.detach())

        callbacks: list[Any] = [Begin()]
        if self.adapter is not None:
            callbacks.append(self.adapter)
        callbacks.append(End())
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,  # one pass over the turn's n batches (max_steps would count
            # optimizer steps: two a batch with two optimizers)
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        torch.manual_seed(seed)
        loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)  # type: ignore[var-annotated, arg-type]
        trainer.fit(self.module, loader)
        return Turn(clock.times, clock.cpu, clock.steady, [float(x) for x in losses])


# -- the Hugging Face Trainer ----------------------------------------------------------------


class HFRunner(Runner):
    """One ``trainer.train()`` of ``max_steps=settle+timed`` per turn, on one ``Trainer``;
    with a preset, a :class:`~guardtrain.GuardTrainerCallback` in it (each ``train()``
    is a run; its ``warmup_steps`` count model calls: ``calls_per_step`` a step). A step
    is timed from the ``on_step_begin`` of a callback placed before guardtrain's to the
    ``on_step_end`` of one placed after it: forward and backward of each micro-batch,
    gradient clipping, the optimizer and scheduler steps, ``zero_grad``; not the data
    loading and not the logging after the step. The losses are the Trainer's logged ones
    (``logging_steps=1``).

    Plain compile is ``model.compile()`` on the Trainer's model, not
    ``torch_compile=True``: the callback takes accelerate's dynamo plugin over in its
    process-wide ``AcceleratorState``, so beside a guardtrain Trainer a plain Trainer's
    ``torch_compile=True`` would not compile. The presets get the backend as
    ``compile_kwargs``.

    Args:
        make_trainer: ``callbacks -> Trainer`` (``logging_steps=1``, ``torch_compile``
            off).
    """

    def __init__(
        self,
        setting: Setting,
        make_trainer: Callable[[list[Any]], Any],
        calls_per_step: int = 1,
    ) -> None:
        super().__init__(setting)
        from transformers import TrainerCallback

        clock_box: list[_Clock] = []
        self._clock = clock_box

        class Begin(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
                clock_box[0].begin()

        class End(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                clock_box[0].end()

        callbacks: list[Any] = [Begin()]
        if setting.preset is not None:
            from guardtrain import GuardTrainerCallback

            self.adapter = GuardTrainerCallback(
                setting.preset,  # type: ignore[arg-type]
                **setting.guard_kwargs(calls_per_step),
            )
            callbacks.append(self.adapter)
        callbacks.append(End())
        self.trainer = make_trainer(callbacks)
        from transformers.trainer_callback import PrinterCallback

        self.trainer.remove_callback(PrinterCallback)
        if setting.preset is None and setting.compiled:
            self.trainer.model.compile(backend=setting.backend)

    def turn(self, settle: int, timed: int, seed: int) -> Turn:
        trainer = self.trainer
        clock = _Clock(settle, SteadyProbe(self.adapter) if self.adapter is not None else None)
        self._clock[:] = [clock]
        trainer.args.max_steps = settle + timed
        trainer.args.seed = seed
        trainer.train()  # a fresh TrainerState: its log history is this turn's
        losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
        return Turn(clock.times, clock.cpu, clock.steady, losses)

    def close(self) -> None:
        if self.adapter is not None:
            self.adapter.release()


# -- a workload ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """A real training step, its configurations and how to time it."""

    name: str
    description: str
    build: Callable[[Setting], Runner]
    adapter: str
    """The guardtrain adapter the presets run with."""
    plain: str
    """How the plain configuration compiles (the library's users' way)."""
    requires: tuple[str, ...] = ()
    """Modules that must import; else the workload is skipped, with the reason."""
    inductor: str | None = None
    """Why inductor does not fit here: the suite then runs ``aot_eager`` (unless
    ``--no-fallback``) and says so."""
    steps: int = 24
    """Timed steps per turn (``--tiny``: :attr:`tiny_steps`)."""
    tiny_steps: int = 4
    warmup_steps: int = 4
    stable_steps: int = 2
    calls_per_step: int = 1
    """Model calls a step (the HF adapter counts calls)."""
    framework_step: str | None = None
    """Why ``--compile-optimizer`` does not run it (the framework owns the optimizer step),
    or None."""

    def warmup(self, tiny: bool) -> tuple[int, int]:
        """The adapters' ``warmup_steps`` and ``stable_steps``, in steps (``--tiny``: 2, 1)."""
        return (2, 1) if tiny else (self.warmup_steps, self.stable_steps)

    def settle(self, tiny: bool) -> int:
        """Untimed steps at the start of each turn, for every configuration: the adapters'
        warm-up and stable steps, and 2 more."""
        return sum(self.warmup(tiny)) + 2

    def missing(self) -> str | None:
        """Why a required module does not import, or None."""
        import importlib

        for name in self.requires:
            try:
                importlib.import_module(name)
            except Exception as err:  # an installed package that fails to import is missing too
                return f"{name} does not import: {type(err).__name__}: {err}"[:300]
        return None


_QUIET = (
    "lightning.pytorch",
    "lightning.fabric",
    "lightning",
    "transformers",
    "accelerate",
    "guardtrain",
    "trl",
    "peft",
    "datasets",
)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The frameworks' INFO logs (``GPU available: False``...) and guardtrain's end-of-run
    table off while the suite runs."""
    with contextlib.suppress(ImportError):
        import lightning.pytorch  # noqa: F401  (sets its loggers' levels when first imported)
    saved = {}
    for name in _QUIET:
        logger = logging.getLogger(name)
        saved[name] = logger.level
        # guardtrain's end-of-run table, once a turn, is in the results as facts
        logger.setLevel(logging.WARNING if name == "guardtrain" else logging.ERROR)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
