"""Shared test helpers: the tiny models, fixed data, the guard factories, eager-vs-guarded runs.

Imported by name (``from helpers import ...``); pytest puts ``tests/`` on
``sys.path``. Fixtures and pytest configuration live in ``conftest.py``.

* :class:`TinyModule`: the LightningModule of most tests (Linear -> BatchNorm
  -> ReLU -> Dropout -> Linear, as ``backbone`` and ``head``);
* :class:`Net`: the same network as one plain ``nn.Module`` (``lin``, ``bn``,
  ``drop``, ``out``), for ``GuardTuner`` and for models that delegate to a
  child; :class:`NetModule` is a TinyModule that delegates to one;
* :func:`guard`, :func:`guard_without_lookup` and :func:`guard_tuner`: the callback
  and the tuner with the tests' defaults (eager backend, a short warm-up);
* :func:`fit`, :func:`compare`, :func:`assert_same_run`: a run with fixed data,
  and a guarded run compared bitwise with an uncompiled one;
* :func:`assert_restored`: no trace of guardtrain after a run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if TYPE_CHECKING:
    from guardtrain import GuardTuneCallback, GuardTuner

EAGER = {"backend": "eager"}


LEFT_THE_STANCE = (
    "stance miss",
    "direct dispatch: no compiled entry",
    "no compiled entry that the stance would run accepts the call",
)
"""How a re-arm reason says a call left the stance because no entry fitted it: Dynamo's
miss under the stance, turbo's own guard evaluation before it runs one directly, or the
check after a change (H33) finding that the entry the stance would run refuses the call."""


def left_the_stance(reason: str) -> bool:
    """Whether a re-arm ``reason`` is a call leaving the stance for want of an entry."""
    return any(text in reason for text in LEFT_THE_STANCE)


def turbo_everywhere() -> bool:
    """With ``GUARDTRAIN_TURBO_EVERYWHERE=1`` (``pytest --turbo-everywhere``), make the preset
    named ``aggressive`` carry turbo's levers, in this process: every test (and subprocess
    script that calls this) that runs ``aggressive`` then runs turbo. Returns whether it did.

    A test that is about ``aggressive`` itself (its lookup window, ``use_stance=False``
    on it) passes ``direct_dispatch=False`` or skips itself in that mode; a test that
    tells the presets apart reads ``settings.direct_dispatch``, not the name.
    """
    import os
    from types import MappingProxyType

    if os.environ.get("GUARDTRAIN_TURBO_EVERYWHERE", "") in ("", "0"):
        return False
    from guardtrain import presets

    table = dict(presets.PRESETS)
    table["aggressive"] = presets.PRESETS["turbo"]
    presets.PRESETS = MappingProxyType(table)
    return True


# -- the guard factories ---------------------------------------------------------------------


def _test_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The tests' defaults: the eager backend and a short warm-up (3 steps, then 2 stable)."""
    kwargs.setdefault("warmup_steps", 3)
    kwargs.setdefault("stable_steps", 2)
    kwargs.setdefault("compile_kwargs", EAGER)
    return kwargs


def guard(preset: str = "aggressive", **kwargs: Any) -> GuardTuneCallback:
    """A GuardTuneCallback for tests: eager backend, a short warm-up."""
    from guardtrain import GuardTuneCallback

    return GuardTuneCallback(preset, **_test_defaults(kwargs))  # type: ignore[arg-type]


def guard_without_lookup(preset: str = "aggressive", **kwargs: Any) -> GuardTuneCallback:
    """:func:`guard` without the lookup window (its profiled batches would shift the steps)."""
    kwargs.setdefault("measure_lookup", False)
    return guard(preset, **kwargs)


def guard_tuner(model: nn.Module, preset: str = "aggressive", **kwargs: Any) -> GuardTuner:
    """A GuardTuner for tests, with :func:`guard`'s defaults."""
    from guardtrain import GuardTuner

    return GuardTuner(model, preset, **_test_defaults(kwargs))  # type: ignore[arg-type]


# -- compiles against plain compile (H51) ------------------------------------------------------

PLAIN_RECOMPILE_LIMIT = 64
"""Dynamo's recompile limit in :class:`PlainCompile`'s runs: high enough that plain compile
compiles every call it needs, where at its default (8 per frame) it would run the rest of
a run's calls uncompiled."""


class PlainCompile:
    """Plain ``module.compile()`` with its frame compiles counted as guardtrain counts its
    own: once for each frame Dynamo compiles, where it calls the guard filter (which keeps
    every guard). ``with plain:`` raises Dynamo's recompile limit to
    :data:`PLAIN_RECOMPILE_LIMIT` for the run, so that :attr:`compiles` is what plain
    compile needs for the run's calls.

    Usage::

        plain = PlainCompile()
        plain.compile(model, backend="aot_eager")
        with plain:
            train(model)
        assert_compiles_bounded(guardtrain_summary, plain.compiles)
    """

    def __init__(self) -> None:
        self.compiles = 0
        self._patch: Any = None

    def _keep_all(self, entries: Sequence[Any]) -> list[bool]:
        self.compiles += 1
        return [True] * len(entries)

    def compile(self, module: nn.Module, backend: str = "aot_eager") -> None:
        module.compile(backend=backend, options={"guard_filter_fn": self._keep_all})

    def __enter__(self) -> PlainCompile:
        self._patch = torch._dynamo.config.patch(recompile_limit=PLAIN_RECOMPILE_LIMIT)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patch.__exit__(*exc)


def assert_compiles_bounded(s: dict[str, Any], plain: int, again: bool = False) -> None:
    """guardtrain's compiles in summary ``s`` stay within the compile margin above
    ``plain`` (:class:`PlainCompile`'s count for the same run), as its per-target counts add
    up; without ``again`` (a run whose model never changes) nothing was compiled again."""
    from guardtrain.engine.handover import COMPILE_MARGIN

    why = (s["compiles"], plain, s["compiles_by_target"], s["compiled_again"], s["rearms"])
    assert sum(s["compiles_by_target"].values()) == s["compiles"], why
    assert s["compiles"] <= plain + COMPILE_MARGIN, why
    if not again:
        assert sum(s["compiled_again"].values()) == 0, why


# -- the tiny models -------------------------------------------------------------------------


class TinyModule(L.LightningModule):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear; records every loss it computes."""

    def __init__(self, width: int = 16, p: float = 0.3, grad_in_val: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(p)
        )
        self.head = nn.Linear(width, 1)
        self.grad_in_val = grad_in_val
        self.train_losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.train_losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        if self.grad_in_val:
            with torch.enable_grad():
                loss = nn.functional.mse_loss(self(x), y)
        else:
            loss = nn.functional.mse_loss(self(x), y)
        self.val_losses.append(loss.detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Net(nn.Module):
    """TinyModule's network as one plain module: Linear -> BatchNorm -> ReLU -> Dropout -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.lin(x)))))


OptimizedModule = torch._dynamo.eval_frame.OptimizedModule


class NetModule(TinyModule):
    """TinyModule whose ``forward`` delegates to ``self.net``, a :class:`Net` (the default target).

    ``compile_net=True`` does what the lightning-hydra-template's ``compile=true``
    does: ``self.net = torch.compile(self.net)`` in the module's own ``setup`` (H29).
    """

    def __init__(self, compile_net: bool = False) -> None:
        super().__init__()
        del self.backbone, self.head
        self.net = Net()
        self.compile_net = compile_net

    def setup(self, stage: str) -> None:
        if self.compile_net and stage == "fit" and not isinstance(self.net, OptimizedModule):
            self.net = torch.compile(self.net, backend="eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Predicting(TinyModule):
    """TinyModule with a ``test_step`` (recorded as validation's) and a ``predict_step``."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


# -- data, trainer, runs ---------------------------------------------------------------------


def loaders(
    n_train: int = 100, n_val: int = 50, batch_size: int = 16, drop_last: bool = False
) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_train, 8, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n_train, 1, generator=g)
    xv = torch.randn(n_val, 8, generator=g)
    yv = xv[:, :1] * 0.5
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, drop_last=drop_last)
    val = DataLoader(TensorDataset(xv, yv), batch_size=batch_size)
    return train, val


def make_trainer(callbacks: Sequence[L.Callback] = (), **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(kwargs)
    return L.Trainer(callbacks=list(callbacks), **options)


def fit(
    model: L.LightningModule,
    callbacks: Sequence[L.Callback] = (),
    data: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(callbacks, **trainer_kwargs)
    train, val = loaders(**(data or {}))
    trainer.fit(model, train, val)
    return trainer


def assert_same_run(eager: TinyModule, guarded: TinyModule, exact: bool = True) -> None:
    """Same losses at every step and the same final weights (bitwise with backend='eager')."""
    check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    assert len(eager.train_losses) == len(guarded.train_losses)
    assert len(eager.val_losses) == len(guarded.val_losses)
    for i, (a, b) in enumerate(zip(eager.train_losses, guarded.train_losses)):
        assert check(a, b), f"train loss {i}: eager {a.item()} vs guarded {b.item()}"
    for i, (a, b) in enumerate(zip(eager.val_losses, guarded.val_losses)):
        assert check(a, b), f"val loss {i}: eager {a.item()} vs guarded {b.item()}"
    sd_e, sd_g = eager.state_dict(), guarded.state_dict()
    assert list(sd_e) == list(sd_g)
    for key in sd_e:
        assert check(sd_e[key], sd_g[key]), f"weights differ at {key}"


def compare(
    factory: Callable[[], TinyModule],
    callback: Callable[[], L.Callback],
    extra: Callable[[], Sequence[L.Callback]] = lambda: (),
    exact: bool = True,
    **fit_kwargs: Any,
) -> tuple[Any, TinyModule]:
    """Fit an uncompiled model and a guarded one the same way; assert equal; return both.

    Returns the callback and the guarded model.
    """
    L.seed_everything(0, verbose=False)
    eager = factory()
    fit(eager, list(extra()), **fit_kwargs)
    L.seed_everything(0, verbose=False)
    guarded = factory()
    cb = callback()
    fit(guarded, [cb, *extra()], **fit_kwargs)
    assert_same_run(eager, guarded, exact=exact)
    return cb, guarded


class PhaseSpy(L.Callback):
    """Records ``guard.phase`` at every training batch start (after the guard's own hook)."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard
        self.phases: list[str] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.phases.append(self.guard.phase)


# -- the state guardtrain changes ------------------------------------------------------------


def stance_on() -> bool:
    """Whether guardtrain's targets are steady now: each of their calls runs under the
    stance, which that call sets for itself (H41). Torch's stance is never on between
    calls (:func:`assert_restored` checks it)."""
    from guardtrain.compile import steady_now

    return steady_now()


def _has_code_parts() -> bool:
    import dataclasses

    from torch._dynamo.types import GuardFilterEntry

    return "code_parts" in {f.name for f in dataclasses.fields(GuardFilterEntry)}


HAS_CODE_PARTS: bool = _has_code_parts()
"""Whether this torch's GuardFilterEntry has ``code_parts`` (2.15 on): re-check messages
then end with Dynamo's guard, ``(Dynamo's guard: self.temperature == 1.0)``."""


def without_dynamos_guard(reason: str, name: str) -> str:
    """``reason`` without the ``(Dynamo's guard: ...)`` that guardtrain adds where torch has
    ``code_parts``; asserts that it is there exactly then, naming ``name`` as the user does."""
    base, sep, code = reason.partition(" (Dynamo's guard: ")
    assert bool(sep) == HAS_CODE_PARTS, reason
    if sep:
        assert name in code and "L[" not in code and "_modules[" not in code, reason
    return base if not sep else base + code[code.index(")") + 1 :]


DICT_TAGS_DEFAULT: bool = torch._dynamo.config.use_recursive_dict_tags_for_guards
"""This torch's default (on in 2.11, off from 2.12 on): what a run leaves behind."""


def assert_restored(model: nn.Module | None = None) -> None:
    """No trace of guardtrain: stance, Dynamo config and (with ``model``) instance ``forward``s."""
    assert torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe is False
    assert torch._dynamo.config.install_free_tensors is False
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards is DICT_TAGS_DEFAULT
    # The change tracking's wrappers are gone (H33): every patched function is torch's own.
    from torch.utils.hooks import RemovableHandle

    from guardtrain.compile import watch
    from guardtrain.engine.process import PROCESS

    left = PROCESS.changed()
    if watch._targets:  # a CompiledTarget that a test made by hand keeps the wrappers
        left = [c for c in left if "change tracking" not in c]
    assert not left, f"still changed in the process: {left}"
    if model is not None:
        assert not [m for m in model.modules() if id(m) in watch._modules], "still watched"
    if not watch._targets:  # no CompiledTarget that a test made by hand is installed
        assert not watch.patched()
        assert nn.Module.__setattr__ is watch._module_setattr
        assert nn.Module.__delattr__ is watch._module_delattr
        assert RemovableHandle.remove is watch._handle_remove
        assert not hasattr(nn.Module.register_forward_hook, "__wrapped__")
        assert not hasattr(nn.Module._apply, "__wrapped__")
        assert not hasattr(torch.utils.swap_tensors, "__wrapped__")
        # PyTorch's registration hooks that the change tracking added are removed (H55).
        from torch.nn.modules import module as module_module

        for hooks in (
            module_module._global_buffer_registration_hooks,
            module_module._global_parameter_registration_hooks,
            module_module._global_module_registration_hooks,
        ):
            assert watch._registered not in hooks.values()
        # The requires_grad events' wrapper and property are gone (H42).
        assert "requires_grad" not in nn.Parameter.__dict__
        assert "requires_grad_" not in nn.Parameter.__dict__
    if model is not None:
        for name, module in model.named_modules():
            assert "forward" not in module.__dict__, (
                f"{name or 'root'} still has a compiled forward"
            )


def first_then_slow(first: str, *others: str) -> list[Any]:
    """A preset matrix: ``first`` in the README's test command, the ``others`` behind
    ``-m slow`` (CI runs both)."""
    return [first, *(pytest.param(p, marks=pytest.mark.slow) for p in others)]
