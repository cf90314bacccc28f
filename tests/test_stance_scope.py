"""The stance is guardtrain's alone (H41): the user's own compiled code runs with full guards.

Torch's stance is one value for the process. guardtrain sets it only around a target's own
compiled call, so the user's other compiled functions, called between the target's calls,
never run under it:

* PyTorch's compiled-optimizer recipe (``@torch.compile`` over ``opt.step()`` and
  ``sched.step()``, Adam): under a process-wide stance its outer frame, which breaks the
  graph before any op, missed on every call and raised at the first steady batch;
* a compiled update that reads a scheduled float learning rate, and a compiled loss whose
  weight is annealed: under a process-wide stance their one entry ran the first value on
  every later step, silently.

Each case runs with ``GuardTuner`` and in Lightning (automatic and manual optimization),
under every preset, beside the same loop without guardtrain and with the user's functions
uncompiled: the loss of every step, which parameters got a gradient, and the weights after
every step are equal. The user's functions compile with ``aot_eager`` (the eager backend
follows what it is given at run time and would hide a stale entry, H43); the target with
the tests' eager backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import pytest
import torch
from helpers import fit, guard_tuner, guard_without_lookup, loaders
from torch import nn

from guardtrain import PRESETS

pytestmark = pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader`")

STEPS = 24
CHANGE = 8
"""The step from which the learning rate and the loss weight change on every step."""
DATA = {"n_train": 8 * STEPS, "batch_size": 8}
WARMUP = {"warmup_steps": 2, "stable_steps": 2}
USER = {"backend": "aot_eager"}
ALL_PRESETS = list(PRESETS)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(x)))


def _factor(step: int) -> float:
    """1 through warm-up and the first steady steps; from CHANGE on a new value every step."""
    return 1.0 if step < CHANGE else 0.9 ** (step - CHANGE + 1)


@dataclasses.dataclass
class Record:
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: list[tuple[bool, ...]] = dataclasses.field(default_factory=list)
    weights: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] | None = None

    def after_backward(self, net: nn.Module) -> None:
        self.grads.append(tuple(p.grad is not None for p in net.parameters()))

    def after_step(self, net: nn.Module) -> None:
        self.weights.append([p.detach().clone() for p in net.parameters()])


class UserCode:
    """The user's loss and optimizer step for one case, compiled by the user or not."""

    def __init__(self, case: str, net: nn.Module, compiled: bool) -> None:
        self.case = case
        self.step_index = 0
        wrap: Callable[[Any], Any] = (
            (lambda f: torch.compile(f, **USER)) if compiled else (lambda f: f)
        )
        self.step: Callable[[], Any]
        if case == "optimizer-step":
            # PyTorch's compiled-optimizer recipe: Adam and a scheduler, one compiled step.
            self.opt: torch.optim.Optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
            sched = torch.optim.lr_scheduler.LinearLR(self.opt, total_iters=CHANGE + 4)

            def step() -> None:
                self.opt.step()
                sched.step()

            self.step = wrap(step)
        elif case == "update-scheduled-lr":
            # A compiled update without a graph break that reads the scheduled float lr.
            self.opt = torch.optim.SGD(net.parameters(), lr=0.05)
            lr_sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: _factor(s + 1))
            params = list(net.parameters())

            def update() -> None:
                lr = self.opt.param_groups[0]["lr"]
                with torch.no_grad():
                    for p in params:
                        p.add_(p.grad, alpha=-lr)

            compiled_update = wrap(update)

            def update_step() -> None:
                compiled_update()
                lr_sched.step()

            self.step = update_step
        else:  # "loss-weight": a compiled loss whose weight is annealed
            self.opt = torch.optim.SGD(net.parameters(), lr=0.05)
            self.step = self.opt.step

        def loss(out: torch.Tensor, y: torch.Tensor, w: float) -> torch.Tensor:
            return nn.functional.mse_loss(out, y) * w

        self._loss = wrap(loss) if case == "loss-weight" else loss

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = _factor(self.step_index) if self.case == "loss-weight" else 1.0
        return self._loss(out, y, w)

    def optimizer_step(self) -> None:
        self.step()
        self.step_index += 1


PLAIN = "plain"
"""Not a preset: the user's functions compiled, the target not (no guardtrain)."""


def run_tuner(case: str, preset: str | None) -> Record:
    torch.manual_seed(0)
    net = Net()
    user = UserCode(case, net, compiled=preset is not None)
    record = Record()
    use = preset not in (None, PLAIN)
    tuner = guard_tuner(net, preset, measure_lookup=False, **WARMUP) if use else None
    with tuner if tuner is not None else contextlib.nullcontext():
        for x, y in loaders(**DATA)[0]:
            with tuner.step((x, y)) if tuner is not None else contextlib.nullcontext():
                loss = user.loss(net(x), y)
                loss.backward()
                record.losses.append(loss.detach().clone())
                record.after_backward(net)
                user.optimizer_step()  # the user's compiled code, between the target's calls
                record.after_step(net)
                user.opt.zero_grad()
    if tuner is not None:
        record.summary = tuner.summary()
    return record


class Host(L.LightningModule):
    """Delegates to ``self.net`` (the default target); the user's step in
    ``optimizer_step`` (automatic optimization) or in ``training_step`` (manual)."""

    def __init__(self, case: str, compiled: bool, manual: bool) -> None:
        super().__init__()
        self.net = Net()
        self.user = UserCode(case, self.net, compiled)
        self.automatic_optimization = not manual
        self.record = Record()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = self.user.loss(self(x), y)
        self.record.losses.append(loss.detach().clone())
        if self.automatic_optimization:
            return loss
        self.optimizers().zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        self.record.after_backward(self.net)
        self.user.optimizer_step()
        self.record.after_step(self.net)
        return None

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any) -> None:
        closure()  # training_step and backward
        self.record.after_backward(self.net)
        self.user.optimizer_step()
        self.record.after_step(self.net)

    def configure_optimizers(self) -> Any:
        return self.user.opt


def run_lightning(case: str, preset: str | None, manual: bool) -> Record:
    L.seed_everything(0, verbose=False)
    torch.manual_seed(0)
    model = Host(case, compiled=preset is not None, manual=manual)
    callbacks = [guard_without_lookup(preset, **WARMUP)] if preset not in (None, PLAIN) else []
    fit(model, callbacks, data=DATA, max_epochs=1, limit_val_batches=0)
    record = model.record
    if callbacks:
        record.summary = callbacks[0].summary()
    return record


ADAPTERS: dict[str, Callable[[str, str | None], Record]] = {
    "tuner": run_tuner,
    "lightning": lambda case, preset: run_lightning(case, preset, manual=False),
    "lightning-manual": lambda case, preset: run_lightning(case, preset, manual=True),
}
CASES = ["optimizer-step", "update-scheduled-lr", "loss-weight"]
_RUNS: dict[tuple[str, str, str | None], Record] = {}


def recorded(adapter: str, case: str, preset: str | None) -> Record:
    key = (adapter, case, preset)
    if key not in _RUNS:
        _RUNS[key] = ADAPTERS[adapter](case, preset)
    return _RUNS[key]


def assert_same(eager: Record, got: Record, exact: bool = True) -> None:
    """Every step's loss, which parameters got a gradient, and the weights after it (to
    float rounding where ``exact`` is False: a compiled Adam step against the eager one)."""

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-6)

    assert len(got.losses) == len(eager.losses) == STEPS
    stale = [i for i, (a, b) in enumerate(zip(eager.losses, got.losses)) if not same(a, b)]
    assert not stale, f"losses differ from eager at steps {stale}"
    assert got.grads == eager.grads
    assert len(got.weights) == len(eager.weights) == STEPS
    for i, (a, b) in enumerate(zip(eager.weights, got.weights)):
        assert all(same(u, v) for u, v in zip(a, b)), f"weights differ after step {i}"


#: Each adapter with each case; Lightning's manual loop is the compiled optimizer step's.
PAIRS = [
    (adapter, case)
    for adapter in ADAPTERS
    for case in CASES
    if adapter != "lightning-manual" or case == "optimizer-step"
]


@pytest.mark.parametrize("preset", ALL_PRESETS)
@pytest.mark.parametrize(("adapter", "case"), PAIRS)
def test_the_users_compiled_code_runs_with_full_guards(
    adapter: str, case: str, preset: str
) -> None:
    got = recorded(adapter, case, preset)
    if case == "optimizer-step":
        # Dynamo's Adam rounds differently from eager's: bitwise against the same compiled
        # step without guardtrain, and close to the uncompiled optimizer.
        assert_same(recorded(adapter, case, PLAIN), got)
        assert_same(recorded(adapter, case, None), got, exact=False)
    else:
        assert_same(recorded(adapter, case, None), got)
    s = got.summary
    assert s is not None
    if PRESETS[preset].use_stance:
        # The target itself stays steady: the user's functions changed nothing it reads.
        assert s["phase"] == "steady", s["rearms"]
        assert s["steady_steps"] >= STEPS - 8, (s["steady_steps"], s["rearms"])
        assert not s["rearms"], s["rearms"]
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe


def test_every_case_changes_what_eager_computes() -> None:
    """The cases test something: from step CHANGE on the user's value changes every step,
    and a run that keeps the first value differs from eager."""
    eager = recorded("tuner", "update-scheduled-lr", None)
    assert len({round(w[0].sum().item(), 7) for w in eager.weights}) == STEPS
    factors = [_factor(s) for s in range(STEPS)]
    assert factors[:CHANGE] == [1.0] * CHANGE and len(set(factors[CHANGE:])) == STEPS - CHANGE


def test_a_target_called_from_the_users_compiled_code_writes_no_stance() -> None:
    """A target called inside the user's own compiled function is traced into it: the
    per-call path writes nothing while Dynamo traces (H41), and the result equals eager."""
    torch.manual_seed(0)
    net, ref = Net(), Net()
    ref.load_state_dict(net.state_dict())
    outer = torch.compile(lambda m, x: m(x).sum(), **USER)
    xs = [torch.randn(4, 8) for _ in range(10)]
    with guard_tuner(net, "aggressive", measure_lookup=False, **WARMUP) as tuner:
        for x in xs:
            with tuner.step((x,)), torch.no_grad():
                net(x)  # the target's own calls: steady after warm-up
                got = outer(net, x)
                assert torch.allclose(got, ref(x).sum(), rtol=1e-6, atol=1e-6)
        assert tuner.phase == "steady"
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe


@contextlib.contextmanager
def steady_tuner() -> Iterator[tuple[Net, Any, list[torch.Tensor]]]:
    """A ``Net`` under ``GuardTuner`` (``aggressive``), steady after 8 steps."""
    torch.manual_seed(0)
    net = Net()
    xs = [torch.randn(4, 8) for _ in range(8)]
    with guard_tuner(net, "aggressive", measure_lookup=False, **WARMUP) as tuner:
        for x in xs:
            with tuner.step((x,)):
                net(x)
        assert tuner.phase == "steady"
        yield net, tuner, xs


def test_a_stance_the_user_sets_is_left_as_it_is() -> None:
    """``force_eager`` set by the user around steady calls: they run under it, eagerly
    (nothing compiles, nothing raises), counted as full-guard calls; afterwards the stance
    is the user's again, then the default."""
    with steady_tuner() as (net, tuner, xs):
        with torch.compiler.set_stance("force_eager"):
            with tuner.step((xs[0],)):
                out = net(xs[0])
            assert torch._dynamo.eval_frame._stance.stance == "force_eager"
        summary = tuner.summary()
    assert torch.equal(out, net(xs[0]))
    assert summary["full_guard_calls"] >= 1
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_a_new_stance_object_equal_to_the_runs_is_treated_as_it() -> None:
    """``with set_stance("default")`` makes a new stance object equal to the one the run
    started under: steady calls still run under the stance (no full-guard calls), and the
    user's object is what is there after each call."""
    with steady_tuner() as (net, tuner, xs):
        before = tuner.summary()["full_guard_calls"]
        with torch.compiler.set_stance("default"):
            mine = torch._dynamo.eval_frame._stance
            with tuner.step((xs[0],)):
                out = net(xs[0])
            assert torch._dynamo.eval_frame._stance is mine
        assert tuner.summary()["full_guard_calls"] == before
        assert tuner.phase == "steady"
    assert torch.equal(out, net(xs[0]))
