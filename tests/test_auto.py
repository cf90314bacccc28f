"""``auto``, the default preset, and the bottom line (``summary()["step"]``).

``auto`` has turbo's levers; where direct dispatch is refused (FSDP, guard collectives) its targets run under aggressive's stance, and the setup line
and ``summary()["auto"]`` say so. FSDP2 for real is in ``tests/test_fsdp2.py``
(``plain_auto_regional``). The step figures are tested for shape and consistency, never
for timing.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import EAGER, NetModule, compare, guard
from lightning.pytorch.loggers import Logger
from torch import nn

from guardtrain import GuardTrainerCallback, GuardTuneCallback, GuardTuner, get_preset
from guardtrain.engine.config import make_config
from guardtrain.engine.engine import GuardEngine
from guardtrain.engine.steps import StepClock, bottom_line, cuda_events

AOT = {"backend": "aot_eager"}


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Breaking(Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(y)


def _train(
    model: nn.Module, tuner: GuardTuner | None = None, steps: int = 10
) -> list[torch.Tensor]:
    """SGD steps on fixed data, under ``tuner`` (None: eager); the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.ones(16, 1)
    losses = []
    with tuner or contextlib.nullcontext():
        for _ in range(steps):
            with tuner.step((x,)) if tuner is not None else contextlib.nullcontext():
                loss = (model(x) - y).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("adapter", [GuardTuneCallback, GuardTuner, GuardTrainerCallback])
def test_auto_is_the_default_of_every_adapter(adapter: Any) -> None:
    assert inspect.signature(adapter.__init__).parameters["preset"].default == "auto"
    assert make_config().preset == "auto"
    assert get_preset("auto") == get_preset("turbo")


def test_a_plain_model_runs_turbo(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = Mlp()
    eager = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="guardtrain"):
        tuner = GuardTuner(model, warmup_steps=2, stable_steps=1, compile_kwargs=AOT)
        got = _train(model, tuner)
    assert got == _train(eager)
    s = tuner.summary()
    assert s["preset"] == "auto"
    assert s["auto"] == {
        "chose": "turbo",
        "why": "direct dispatch is refused nowhere",
        "targets": {},
    }
    assert s["direct_dispatch"]["calls"] > 0
    assert "preset auto" not in caplog.text  # turbo, auto's usual choice: no line at setup
    assert "auto chose       turbo" in tuner.format_summary()
    step = s["step"]  # GuardTuner's step is its batch
    assert step["steady_steps"] >= 2 and step["median_us"] > 0, step


def test_the_hf_trainer_times_its_optimizer_steps(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from hf_helpers import guard as hf_guard
    from hf_helpers import losses, run_pair

    cb = hf_guard("auto", measure_lookup=True, lookup_window=2)
    eager, guarded = run_pair(tmp_path, cb, max_steps=16)
    assert losses(guarded) == losses(eager)
    s = cb.summary()
    assert s["auto"]["chose"] == "turbo", s["auto"]
    step = s["step"]
    assert step["steady_steps"] >= 2 and step["median_us"] > 0, step
    assert step["saved_us"] is not None and step["note"], step


def test_a_model_with_a_graph_break_runs_its_calls_with_full_guards() -> None:
    """An explicit target whose every entry breaks the graph runs its calls with full
    guards, never under the stance (H4), and the summary names it (the default targets
    would be split)."""
    torch.manual_seed(0)
    model = Breaking()
    eager = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="graph breaks"):
        tuner = GuardTuner(
            model, targets=[""], warmup_steps=2, stable_steps=1, compile_kwargs=EAGER
        )
        got = _train(model, tuner, steps=10)
    assert got == _train(eager, steps=10)
    s = tuner.summary()
    assert s["auto"]["chose"] == "turbo", s["auto"]
    assert s["direct_dispatch"]["broken_targets"] == ["<model>"]
    assert s["steady_steps"] == 0 and "graph breaks" in (s["stance_blocked"] or "")
    assert s["direct_dispatch"]["calls"] == 0
    assert [m["target"] for m in s["mixed_targets"]] == ["<model>"]


def test_a_default_target_that_breaks_is_split_and_runs_turbo() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = Mlp(), Mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.first(x)
            torch._dynamo.graph_break()
            return self.second(y.expand(-1, 8))

    torch.manual_seed(0)
    model = Outer()
    eager = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="compiling its parts"):
        tuner = GuardTuner(model, warmup_steps=2, stable_steps=1, compile_kwargs=EAGER)
        got = _train(model, tuner)
    assert got == _train(eager)
    s = tuner.summary()
    assert s["targets"] == ["first", "second"]
    assert s["auto"]["chose"] == "turbo" and s["direct_dispatch"]["calls"] > 0, s["auto"]


def test_guard_collectives_on_several_processes_run_aggressive(
    capsys: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder
) -> None:
    engine = GuardEngine(make_config(guard_collectives=True))
    engine.setup(world_size=2, rank=0)  # a bare engine's host prints its messages
    auto = engine.summary()["auto"]
    assert auto["chose"] == "aggressive" and "guard_collectives=True" in auto["why"], auto
    assert "preset auto chose aggressive's stance" in capsys.readouterr().out
    # A choice, said once at INFO: not the warning a named turbo gives.
    assert not [w for w in recwarn if "refused" in str(w.message)]


def test_named_presets_say_nothing_of_auto() -> None:
    engine = GuardEngine(make_config("aggressive"))
    engine.setup()
    assert engine.summary()["auto"] is None
    assert "auto chose" not in engine.format_summary()


# -- the bottom line ----------------------------------------------------------------------------


def test_bottom_line_figures_are_consistent() -> None:
    clock = StepClock()
    clock.times.extend([2_000_000, 1_000_000, 3_000_000])
    got = bottom_line(clock, {"full_guards": 50.0, "steady": 5.0})
    assert got["steady_steps"] == 3 and got["median_us"] == 2000.0
    assert got["saved_us"] == 45.0
    assert math.isclose(got["saved_share"], 45.0 / 2045.0, abs_tol=1e-4)
    assert math.isclose(got["guards_share"], 5.0 / 2000.0, abs_tol=1e-4)
    assert got["why"] is None
    assert got["note"] is None
    turbo = bottom_line(clock, {"full_guards": 50.0, "steady": 0.0}, direct=True)
    assert turbo["saved_us"] == 50.0 and "direct calls' own checks" in turbo["note"]
    unmeasured = bottom_line(clock, {})
    assert unmeasured["saved_us"] is None and "not measured in this run" in unmeasured["why"]
    estimated = bottom_line(clock, {}, estimated=20.0)
    assert estimated["saved_us"] == 20.0 and "estimated" in estimated["note"], estimated
    assert math.isclose(estimated["saved_share"], 20.0 / 2020.0, abs_tol=1e-4)
    assert estimated["guards_share"] is None and estimated["why"] is None
    profiled = bottom_line(clock, {"full_guards": 50.0, "steady": 5.0}, estimated=20.0)
    assert profiled["saved_us"] == 45.0 and profiled["note"] is None  # the profile wins
    assert bottom_line(StepClock(), {})["why"] == "fewer than 2 steady training steps"


def test_a_step_counts_only_when_steady_throughout() -> None:
    clock = StepClock()
    clock.start((True, 3, 0))
    clock.end((True, 4, 0))  # compiled during the step
    clock.start((False, 4, 0))
    clock.end((False, 4, 0))  # not steady
    clock.start((True, 4, 0))
    clock.end((True, 4, 1))  # re-armed
    assert not clock.times
    clock.start((True, 4, 1))
    clock.end((True, 4, 1))
    assert len(clock.times) == 1 and clock.times[0] > 0


class _FakeEvent:
    """A CUDA timing event on a fake device: the device reaches an event when the test says
    so, at the time the test gives (ms)."""

    device_ms: ClassVar[float] = 0.0
    reached: ClassVar[list[_FakeEvent]] = []

    def __init__(self, enable_timing: bool = True) -> None:
        self.at: float | None = None
        self.done = False

    def record(self) -> None:
        _FakeEvent.reached.append(self)

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.done and end.done and self.at is not None and end.at is not None
        return end.at - self.at

    @staticmethod
    def run_device(ms: float) -> None:
        """The device reaches every event recorded so far, each ``ms`` after the last."""
        for event in _FakeEvent.reached:
            _FakeEvent.device_ms += ms
            event.at, event.done = _FakeEvent.device_ms, True
        _FakeEvent.reached = []


def test_on_cuda_a_step_is_timed_by_events_on_the_device_without_a_sync() -> None:
    """The code path of CUDA's step clock, on the CPU: each steady step records an event at
    its two marks; a pair is read only once the device has passed its end (never waited
    for); steps the device has not finished are not counted yet."""
    clock = StepClock(events=_FakeEvent)
    clock.start((True, 0, 0))
    clock.end((True, 0, 0))
    clock.start((True, 0, 0))
    clock.end((True, 0, 0))
    assert not clock.times and len(clock.pending) == 2  # the device has run nothing yet
    _FakeEvent.run_device(5.0)  # 5 ms between the events: the device's time, not the host's
    clock.start((True, 0, 0))
    clock.end((True, 0, 1))  # re-armed: not counted, and records no pair
    assert list(clock.times) == [] and len(clock.pending) == 2
    got = bottom_line(clock, {})
    assert list(clock.times) == [5_000_000, 5_000_000] and not clock.pending
    assert got["median_us"] == 5000.0 and got["steady_steps"] == 2
    assert cuda_events([torch.nn.Linear(2, 2)]) is None  # parameters on the CPU: the wall clock


class _Metrics(Logger):  # type: ignore[misc]
    """A Lightning logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_lightning_reports_the_step_and_logs_the_saving_once_per_epoch() -> None:
    logger = _Metrics()
    cb, _ = compare(
        NetModule,
        lambda: guard("aggressive", measure_lookup=True, lookup_window=2),
        max_epochs=4,
        logger=logger,
    )
    step = cb.summary()["step"]
    assert step["steady_steps"] >= 2 and step["median_us"] > 0, step
    assert step["saved_us"] is not None, step
    assert step["saved_share"] == pytest.approx(
        step["saved_us"] / (step["median_us"] + step["saved_us"]), abs=1e-3
    )
    assert "step (steady)" in cb.format_summary() and "saved" in cb.format_summary()
    epochs = [m for m in logger.logged if "guard/step_ms" in m]
    assert 1 <= len(epochs) <= 4, logger.logged  # at most once per epoch
    assert "guard/saved_us_per_step" in epochs[-1], epochs
    assert epochs[-1]["guard/saved_us_per_step"] == step["saved_us"]
