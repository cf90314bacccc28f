"""State that alternates between values that each have an entry costs no re-arm (H44).

* autocast on every other training step: each autocast state has code of its own, so the
  stance, which cannot tell entries apart by autocast, serves each state from its own
  entry under ``balanced`` and ``aggressive``, and a flip back to a state that ran before
  costs no check (H44, H46); turbo dispatches both directly;
* Lightning's ``toggle_optimizer`` in a manual GAN loop flips the ``requires_grad`` of the
  other network's parameters on every step: each pattern has its own code (H42).

Each run is compared with the same loop without guardtrain, step by step (``aot_eager``:
the eager backend follows autocast and ``requires_grad`` at run time and would hide a
stale entry, H43): the output's value and dtype, which parameters got a gradient, and the
weights after every step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import pytest
import torch
from helpers import guard_tuner, guard_without_lookup, make_trainer
from torch import nn

from guardtrain import PRESETS
from guardtrain.compile.code import TargetCode

pytestmark = pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader`")

AOT = {"backend": "aot_eager"}
STEPS = 34
WARMUP = {"warmup_steps": 2, "stable_steps": 2}
STANCE_PRESETS = [name for name, p in PRESETS.items() if p.use_stance]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def autocast_run(
    preset: str | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], dict[str, Any] | None, list[bool]]:
    """Autocast (bfloat16) on odd steps; per step the output, the gradients' presence and
    the weights after the step; and for each call that reached a code's compiled
    trampoline (not turbo's direct calls), whether it ran under the stance."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    under: list[bool] = []
    caller = TargetCode.caller

    def spying_caller(code: TargetCode, module: nn.Module) -> Any:
        compiled = caller(code, module)

        def spy(*args: Any, **kwargs: Any) -> Any:
            under.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)
            return compiled(*args, **kwargs)

        return spy

    monkeypatch.setattr(TargetCode, "caller", spying_caller)  # every code's, variants too
    tuner = None
    if preset is not None:
        tuner = guard_tuner(model, preset, compile_kwargs=AOT, measure_lookup=False, **WARMUP)
    seen: list[Any] = []
    with tuner if tuner is not None else contextlib.nullcontext():
        for i, (x, y) in enumerate(batches()):
            with tuner.step((x, y)) if tuner is not None else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 1):
                    out = model(x)
                loss = nn.functional.mse_loss(out.float(), y)
                loss.backward()
                grads = tuple(p.grad is not None for p in model.parameters())
                opt.step()
                opt.zero_grad()
                weights = [p.detach().clone() for p in model.parameters()]
                seen.append((out.detach().clone(), out.dtype, grads, weights))
    return seen, tuner.summary() if tuner is not None else None, under


def assert_same_steps(eager: list[Any], got: list[Any]) -> None:
    assert len(got) == len(eager) == STEPS
    for i, (a, b) in enumerate(zip(eager, got)):
        assert a[1] == b[1], f"step {i}: dtype {b[1]} against eager's {a[1]}"
        assert torch.equal(a[0], b[0]), f"step {i}: output differs from eager"
        assert a[2] == b[2], f"step {i}: other parameters got a gradient"
        assert all(torch.equal(u, v) for u, v in zip(a[3], b[3])), f"weights after step {i}"


@pytest.mark.parametrize("preset", ["off", *STANCE_PRESETS])
def test_autocast_on_every_other_step(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eager, _, _ = autocast_run(None, monkeypatch)
    got, s, under = autocast_run(preset, monkeypatch)
    assert_same_steps(eager, got)
    assert s is not None
    assert s["compiles"] <= 2, s["compile_events"]  # one entry per autocast state
    if not PRESETS[preset].use_stance:
        return
    assert len(s["rearms"]) <= 1, s["rearms"]
    assert s["phase"] == "steady"
    after_warmup = STEPS - s["warmup_steps_taken"]
    assert s["steady_steps"] == after_warmup, (s["steady_steps"], s["rearms"])
    if s["direct_dispatch"]["requested"]:  # also `aggressive` under --turbo-everywhere
        assert s["direct_dispatch"]["calls"] >= 0.8 * after_warmup, s["direct_dispatch"]
    else:
        # Each autocast state runs its own code's entry under the stance (H44): at least
        # 80% of the calls after warm-up skip full guard evaluation; every other call is
        # counted as a full-guard call, and none runs twice.
        steady_calls = under[s["warmup_steps_taken"] :]
        assert len(under) == STEPS, len(under)
        assert sum(steady_calls) + s["full_guard_calls"] == after_warmup, (
            sum(steady_calls),
            s["full_guard_calls"],
        )
        assert sum(steady_calls) >= 0.8 * after_warmup, (sum(steady_calls), after_warmup)
    assert s["state_swaps"] >= after_warmup - 4, s["state_swaps"]  # flips to a known state


# -- toggle_optimizer in a manual GAN loop ----------------------------------------------------


class GAN(L.LightningModule):
    """Two networks, two optimizers, Lightning's manual loop with ``toggle_optimizer``:
    the other network's parameters stop requiring grad for each half of a step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.automatic_optimization = False
        self.seen: list[Any] = []

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.discriminator(self.generator(z))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        z, real = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        self.toggle_optimizer(opt_g)
        fake_score = self(z)
        g_loss = nn.functional.softplus(-fake_score).mean()
        self.manual_backward(g_loss)
        grads_g = tuple(p.grad is not None for p in self.parameters())
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = (
            nn.functional.softplus(-self.discriminator(real)).mean()
            + nn.functional.softplus(self.discriminator(fake)).mean()
        )
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        weights = [p.detach().clone() for p in self.parameters()]
        self.seen.append((fake_score.detach().clone(), fake_score.dtype, grads_g, weights))

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.05),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.05),
        )


def gan_run(preset: str | None) -> tuple[list[Any], dict[str, Any] | None]:
    model = GAN()
    callbacks = []
    if preset is not None:
        # Both networks, each called in both halves of a step: with its own parameters
        # trainable in one half and frozen in the other, two patterns per network.
        targets = ["generator", "discriminator"]
        callbacks = [guard_without_lookup(preset, compile_kwargs=AOT, targets=targets, **WARMUP)]
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * STEPS, 4, generator=g), torch.randn(4 * STEPS, 8, generator=g)
    )
    L.seed_everything(0, verbose=False)
    make_trainer(callbacks, max_epochs=1).fit(
        model, torch.utils.data.DataLoader(data, batch_size=4)
    )
    return model.seen, callbacks[0].summary() if callbacks else None


@pytest.mark.parametrize("preset", ["off", "aggressive", "turbo"])
def test_toggle_optimizer_costs_no_rebuild_per_step(preset: str) -> None:
    eager, _ = gan_run(None)
    got, s = gan_run(preset)
    assert_same_steps(eager, got)
    assert s is not None
    assert "requires_grad" in s["caught_changes"], s["caught_changes"]
    # Per network, one compile per requires_grad pattern (the discriminator's frozen half
    # has one call, its trainable half two), all in the first steps.
    assert s["compiles"] <= 4, s["compile_events"]
    if preset != "off":
        assert len(s["rearms"]) <= 1, s["rearms"]
        assert s["phase"] == "steady"
        assert s["steady_steps"] >= STEPS - s["warmup_steps_taken"] - 1, s["rearms"]


def epochs_run(
    preset: str | None, monkeypatch: pytest.MonkeyPatch, epochs: int = 8
) -> tuple[list[torch.Tensor], dict[str, Any] | None, list[int]]:
    """Epochs of 6 training batches (``train()``, dropout) and 2 validation batches
    (``eval()``, ``no_grad``), each in its own ``tuner.loop``; every output, the summary,
    and per epoch the general checks (``forward._check``) its calls took."""
    import guardtrain.compile.forward as forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches(8)
    checks: list[int] = []
    general = forward._check

    def counted(*args: Any) -> None:
        checks[-1] += 1
        general(*args)

    monkeypatch.setattr(forward, "_check", counted)
    outs: list[torch.Tensor] = []
    tuner = guard_tuner(model, preset, compile_kwargs=AOT, **WARMUP) if preset else None
    torch.manual_seed(3)
    with tuner if tuner is not None else contextlib.nullcontext():
        for _ in range(epochs):
            checks.append(0)
            model.train()
            with tuner.loop("train") if tuner else contextlib.nullcontext():
                for x, y in data[:6]:
                    with tuner.step((x, y)) if tuner else contextlib.nullcontext():
                        out = model(x)
                        (out - y).square().mean().backward()
                        opt.step()
                        opt.zero_grad()
                    outs.append(out.detach().clone())
            model.eval()
            validate = tuner.loop("validate") if tuner else contextlib.nullcontext()
            with validate, torch.no_grad():
                for x, _y in data[6:]:
                    with tuner.step((x,)) if tuner else contextlib.nullcontext():
                        outs.append(model(x))
    return outs, tuner.summary() if tuner else None, checks


@pytest.mark.parametrize("preset", STANCE_PRESETS)
def test_loop_passes_keep_the_known_states(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stance goes off at each loop pass's start and end, and nothing changes there:
    a ``train()`` / ``eval()`` switch between the passes is a swap, not a general check
    (H46), and the checks' cost never hands the target over (H51). Outputs bitwise equal
    to eager, dropout included (``aot_eager``)."""
    eager, _, _ = epochs_run(None, monkeypatch)
    got, s, checks = epochs_run(preset, monkeypatch)
    assert len(eager) == len(got)
    for i, (a, b) in enumerate(zip(eager, got)):
        assert torch.equal(a, b), f"output {i} differs from eager"
    assert s is not None
    assert s["phase"] == "steady", s["rearms"]
    assert not s["full_guard_targets"], s["full_guard_targets"]
    # The first epochs learn both states (and compile the eval entry); after that every
    # switch, two an epoch, is a swap.
    assert checks[3:] == [0] * (len(checks) - 3), checks
    assert s["state_swaps"] >= 2 * (len(checks) - 3), s["state_swaps"]
