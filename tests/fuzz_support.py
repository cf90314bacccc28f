"""Differential fuzzing support: a tiny network driven through a plan of events in a real Trainer.

A :class:`Scenario` is a preset plus epochs of planned training batches; each
step carries events (train/eval, freezing, parameter replacement, module
attributes, hooks, autocast, grad mode, dtype, ``torch._dynamo.reset()`` ...).
:func:`run_scenario` fits a :class:`FuzzModule` with ``GuardTuneCallback``
first and a :class:`Driver` callback second, so that:

* an event placed ``"epoch"`` is applied in ``Driver.on_train_epoch_start``
  (after the guard's epoch-start hook, before its first batch hook: a
  boundary, where the contract promises detection of every change);
* an event placed ``"batch"`` is applied in ``Driver.on_train_batch_start``,
  i.e. *after* the guard's per-batch check of that batch (mid-epoch).

Every forward through the compiled network (training and validation) is
compared with the plain uncompiled forward ``type(net).forward(net, x)`` on
the same state, the same RNG seed, grad mode and autocast: output bitwise,
``requires_grad``, gradients of every trainable parameter, and the buffers
the call wrote (BatchNorm running stats). Buffers are put back between the
two calls, so each forward sees the state an uncompiled run would.

The outcome of a call is one of: equal; a ``GuardTrainError`` (a documented,
clear error: recorded); the same exception type in both (recorded); or a
:class:`Divergence`. A divergence right after an event that the contract
checks only at boundaries (``BOUNDARY``: since issue 17 only ``dtype``, whose
``Module.to`` writes new buffers straight into ``_buffers``), applied
mid-epoch, is recorded as *tolerated* until the next loop or epoch boundary
(README, "Known limits"); any other divergence, and every crash, fails the
run. Attribute assignments, hooks, replaced parameters and freezing are in
``ANYWHERE``: checked strictly in every call.

The changes of ``STRICT`` (issue 17) may come anywhere, at an epoch start or
between any two steps, and never open such a window: the plain arguments the
module passes to the network's ``forward`` (an int, a float, a str, an
optional tensor given or ``None``, a keyword given on some calls only), a
module attribute, a module global (``GAIN``), a config object's field, a
forward hook added to or removed from a submodule, a replaced parameter, and
a submodule's own ``train(False)``/``train(True)``. A divergence after one of
them is a failure wherever it happens, except inside a window that a
mid-epoch ``BOUNDARY`` event opened before it (the harness cannot tell the two
apart there; the fuzz that checks ``STRICT`` places ``BOUNDARY`` events at
epoch starts only).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from helpers import stance_on
from torch import nn

from guardtrain import GuardTrainError, GuardTuneCallback

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*configure_optimizers.*")
warnings.filterwarnings("ignore", ".*is an iterable.*")
warnings.filterwarnings("ignore", ".*recompile_limit.*")
warnings.filterwarnings("ignore", ".*guardtrain: .*")
logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
logging.getLogger("torch._dynamo").setLevel(logging.ERROR)

PRESETS = ("off", "safe", "balanced", "aggressive", "turbo")

#: Events whose change the callback promises to see on every batch / in every call. Since
#: issue 17 this includes assignments to module attributes, hooks and replaced parameters
#: (the change tracking, H33-H35).
ANYWHERE = (
    "train_eval",
    "inplace",
    "autocast",
    "no_grad",
    "reset",
    "freeze",
    "replace_attr",
    "replace_assign",
    "scale",
    "dropout_p",
    "bn_momentum",
    "hook",
    "sub_eval",
)
#: Events the callback checks only at loop and epoch boundaries (README, known limits).
#: ``dtype`` converts the network: ``Module.to`` writes the new buffers straight into
#: ``_buffers`` (no event), and the batches switch to that dtype from the same step on.
BOUNDARY = ("dtype",)
KINDS = ANYWHERE + BOUNDARY
#: Mid-epoch changes that must be seen at once, in every call, for every preset (issue 17).
#: ``arg_*`` change what :class:`FuzzModule` passes to ``Net.forward``: ``arg_int`` ``k``,
#: ``arg_float`` ``t``, ``arg_str`` ``mode`` (an arg sets the value), ``arg_tensor`` toggles
#: ``extra`` between a tensor and ``None``, ``arg_kw`` toggles whether ``shift`` is given.
#: ``attr`` sets ``Net.temp``, ``global`` this module's ``GAIN``, ``cfg`` toggles
#: ``Net.cfg.negate``; ``hook_add``/``hook_remove`` add or remove a doubling forward hook
#: on the submodule named by the arg (``Scenario.hooked`` starts with some);
#: ``replace_param`` replaces that submodule's ``bias``; ``sub_mode`` toggles that
#: submodule's ``training``; ``user_fn`` sets the weight that the user's own compiled
#: function, called after each call of the network (between two target calls), is given
#: (H41: it runs with full guards, never under guardtrain's stance).
STRICT = (
    "arg_int",
    "arg_float",
    "arg_str",
    "arg_tensor",
    "arg_kw",
    "attr",
    "global",
    "cfg",
    "hook_add",
    "hook_remove",
    "replace_param",
    "sub_mode",
    "user_fn",
)
ALL_KINDS = KINDS + STRICT

#: A module global read by ``Net.forward`` (the ``global`` event); 1.0 at every run's start.
GAIN = 1.0


@dataclass(frozen=True)
class Event:
    kind: str
    where: str = "epoch"  # "epoch" (boundary) or "batch" (mid-epoch, after the guard's check)
    arg: Any = None

    def __str__(self) -> str:
        arg = "" if self.arg is None else f"={self.arg!r}"
        return f"{self.kind}{arg}@{self.where}"


@dataclass(frozen=True)
class Step:
    batch_size: int
    events: tuple[Event, ...] = ()


@dataclass(frozen=True)
class Scenario:
    preset: str
    epochs: tuple[tuple[Step, ...], ...]
    warmup_steps: int = 2
    stable_steps: int = 1
    sanity_steps: int = 0
    val_sizes: tuple[int, ...] = (3,)
    audit_every: int | None = None
    guard_kwargs: tuple[tuple[str, Any], ...] = ()
    """More GuardTuneCallback arguments, e.g. ``(("measure_lookup", False),)``."""
    hooked: tuple[str, ...] = ()
    """Submodules of ``Net`` that carry a doubling forward hook from the start (before the
    compile), for ``hook_remove``."""

    def describe(self) -> str:
        lines = [
            f"Scenario(preset={self.preset!r}, warmup_steps={self.warmup_steps}, "
            f"stable_steps={self.stable_steps}, sanity_steps={self.sanity_steps}, "
            f"val_sizes={self.val_sizes}, audit_every={self.audit_every}, "
            f"guard_kwargs={dict(self.guard_kwargs)}, hooked={self.hooked})"
        ]
        for e, steps in enumerate(self.epochs):
            for i, s in enumerate(steps):
                ev = ", ".join(str(x) for x in s.events)
                lines.append(f"  epoch {e} batch {i}: bs={s.batch_size} {ev}")
        return "\n".join(lines)


class FuzzConfig:
    """A plain config object the network holds (``Net.cfg``); ``cfg`` toggles its field."""

    def __init__(self) -> None:
        self.negate = False


class Net(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear, times a float ``scale``.

    Not :class:`helpers.Net`: the events set ``scale`` and ``temp`` (float
    attributes read in ``forward``), ``cfg.negate`` and this module's ``GAIN``, and
    name ``lin1``, ``lin2``, ``bn`` and ``drop``; the planned batches have 4 features.
    The keyword arguments change the computation only when given another value than
    their default (``STRICT``'s ``arg_*`` events); with the defaults the result is
    bitwise that of the plain network.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.25)
        self.lin2 = nn.Linear(8, 3)
        self.scale = 1.0
        self.temp = 1.0
        self.cfg = FuzzConfig()

    def forward(
        self,
        x: torch.Tensor,
        k: int = 1,
        t: float = 1.0,
        mode: str = "relu",
        extra: torch.Tensor | None = None,
        shift: float | None = None,
    ) -> torch.Tensor:
        h = self.bn(self.lin1(x))
        h = torch.tanh(h) if mode == "tanh" else torch.relu(h)
        if extra is not None:
            h = h + extra
        out = self.lin2(self.drop(h)) * self.scale
        out = out * k / t / self.temp * GAIN
        if shift is not None:
            out = out + shift
        return -out if self.cfg.negate else out


class Divergence(AssertionError):
    """The compiled network gave another result than the uncompiled one."""


@dataclass
class Record:
    """What happened in one run."""

    calls: int = 0
    checked: int = 0
    tolerated: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    stance_at_events: list[bool] = field(default_factory=list)


def _add_one(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output + 1.0


def _double(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 2.0


#: The tensor ``arg_tensor`` passes as ``extra`` (added after the activation).
EXTRA = torch.full((8,), 0.25)


class FuzzModule(L.LightningModule):
    """Compares every compiled forward with the uncompiled one; never steps an optimizer."""

    def __init__(self, record: Record) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = Net()
        self.record = record
        self.use_autocast = False
        self.use_no_grad = False
        self.hook: Any = None
        self.hooks: dict[str, Any] = {}
        """``STRICT``'s doubling hooks, by submodule name (``Scenario.hooked``, ``hook_add``)."""
        self.call_kwargs: dict[str, Any] = {}
        """The keyword arguments passed to the network's ``forward`` (``arg_*`` events)."""
        self.tainted: str | None = None
        """Set while a boundary-only event applied mid-epoch is not yet at a boundary."""
        self.guard: GuardTuneCallback | None = None
        self.user_w = 1.0
        """The weight given to the user's compiled function (``user_fn``)."""
        self.user_fn = torch.compile(_user_function, backend="aot_eager")

    def configure_optimizers(self) -> Any:
        return None

    def _context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.use_no_grad:
            stack.enter_context(torch.no_grad())
        if self.use_autocast:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        return stack

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.check("train", batch[0])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x = batch[0].to(self.net.lin1.weight.dtype)
        self.check("validate", x)

    # -- the comparison ---------------------------------------------------------------------

    def check(self, loop: str, x: torch.Tensor) -> None:
        rec = self.record
        rec.calls += 1
        seed = 1000 + rec.calls
        net = self.net
        if self.guard is not None:
            engine = self.guard.engine
            rec.phases.append(engine.run.machine.phase(loop) if engine.active else "-")
        buffers = list(net.buffers())
        before = [b.detach().clone() for b in buffers]
        where = f"call {rec.calls} ({loop}, training={net.training}, x={tuple(x.shape)} {x.dtype})"
        if self.call_kwargs:
            where += f" kwargs={_describe(self.call_kwargs)}"

        compiled: tuple[torch.Tensor, Any, list[torch.Tensor]] | None = None
        compiled_err: BaseException | None = None
        torch.manual_seed(seed)
        try:
            with self._context():
                out = net(x, **self.call_kwargs)
            compiled = (out, self._grads(out), [b.detach().clone() for b in buffers])
        except GuardTrainError as err:  # documented, clear error
            rec.errors.append(f"{where}: {type(err).__name__}: {err}")
            self._put_back(buffers, before)
            return
        except Exception as err:
            compiled_err = err
        self._put_back(buffers, before)

        torch.manual_seed(seed)
        try:
            with self._context():
                ref = type(net).forward(net, x, **self.call_kwargs)
            eager = (ref, self._grads(ref), [b.detach().clone() for b in buffers])
        except Exception as err:
            if compiled_err is not None and type(compiled_err) is type(err):
                rec.errors.append(f"{where}: both raised {type(err).__name__}")
                return
            raise Divergence(
                f"{where}: eager raised {type(err).__name__}: {err}, compiled did not"
            ) from err
        if compiled_err is not None:
            raise Divergence(
                f"{where}: compiled call crashed ({type(compiled_err).__name__}: "
                f"{compiled_err}); eager did not\n" + self._context_text()
            ) from compiled_err
        assert compiled is not None
        problem = self._difference(compiled, eager) or self._user_difference(compiled[0], eager[0])
        if problem is None:
            rec.checked += 1
            return
        if self.tainted is not None:
            rec.tolerated.append(f"{where} after {self.tainted}: {problem}")
            return
        raise Divergence(f"{where}: {problem}\n" + self._context_text())

    def _user_difference(self, out: torch.Tensor, ref: torch.Tensor) -> str | None:
        """The user's own compiled function, called between two target calls with a float
        that ``user_fn`` changes: it must run with full guards (H41), never stale."""
        got = self.user_fn(out.detach(), self.user_w)
        want = _user_function(ref.detach(), self.user_w)
        if torch.equal(got, want):
            return None
        return f"the user's compiled function (w={self.user_w}) differs from eager"

    def _grads(self, out: torch.Tensor) -> Any:
        """Gradients of every trainable parameter (None where unused), or None without a graph."""
        if not out.requires_grad:
            return None
        params = [p for p in self.net.parameters() if p.requires_grad]
        return torch.autograd.grad(out.float().sum(), params, allow_unused=True)

    @staticmethod
    def _put_back(buffers: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for b, v in zip(buffers, values):
                if b.shape == v.shape and b.dtype == v.dtype:
                    b.copy_(v)

    @staticmethod
    def _difference(compiled: Any, eager: Any) -> str | None:
        out, g_out, buf_out = compiled
        ref, g_ref, buf_ref = eager
        if out.dtype != ref.dtype or out.shape != ref.shape:
            return f"output {out.dtype} {tuple(out.shape)} vs eager {ref.dtype} {tuple(ref.shape)}"
        if out.requires_grad != ref.requires_grad:
            return f"output requires_grad {out.requires_grad} vs eager {ref.requires_grad}"
        if not torch.equal(out, ref):
            diff = (out.double() - ref.double()).abs().max().item()
            return f"output differs from eager (max abs diff {diff:.3g})"
        for i, (a, b) in enumerate(zip(buf_out, buf_ref)):
            if a.dtype != b.dtype or not torch.equal(a, b):
                return f"buffer {i} written by the call differs from eager"
        if g_ref is not None:
            if g_out is None or len(g_out) != len(g_ref):
                return "gradients differ from eager"
            for i, (a, b) in enumerate(zip(g_out, g_ref)):
                if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                    return f"gradient of trainable parameter {i} differs from eager"
        return None

    def _context_text(self) -> str:
        lines = ["events so far:", *("  " + h for h in self.record.history[-25:])]
        if self.guard is not None:
            s = self.guard.summary()
            lines.append(f"guard phase={s['phase']} phases={s['phases']}")
            lines.extend(f"  rearm step {r['step']}: {r['reason']}" for r in s["rearms"][-10:])
            lines.extend(
                f"  compile step {c['step']}: {c['reason']}" for c in s["compile_events"][-10:]
            )
        return "\n".join(lines)

    # -- events -----------------------------------------------------------------------------

    def apply(self, event: Event, label: str) -> None:
        net = self.net
        kind = event.kind
        if kind == "train_eval":
            self.train(not self.training)
        elif kind == "sub_eval":
            net.bn.train(not net.bn.training)
        elif kind == "freeze":
            for p in getattr(net, event.arg).parameters():
                p.requires_grad_(not p.requires_grad)
        elif kind == "replace_attr":
            old = net.lin2.weight
            net.lin2.weight = nn.Parameter(old.detach() * 0.5 + 0.05, old.requires_grad)
        elif kind == "replace_assign":
            sub = getattr(net, event.arg)
            new = {k: v.detach().clone() + 0.125 for k, v in sub.state_dict().items()}
            if "num_batches_tracked" in new:
                new["num_batches_tracked"] = sub.num_batches_tracked.detach().clone()
            sub.load_state_dict(new, assign=True)
        elif kind == "inplace":
            with torch.no_grad():
                for i, p in enumerate(net.parameters()):
                    p.add_(0.01 * (i + 1))
        elif kind == "dtype":
            net.to(event.arg)
        elif kind == "autocast":
            self.use_autocast = not self.use_autocast
        elif kind == "no_grad":
            self.use_no_grad = not self.use_no_grad
        elif kind == "scale":
            net.scale = event.arg
        elif kind == "dropout_p":
            net.drop.p = event.arg
        elif kind == "bn_momentum":
            net.bn.momentum = event.arg
        elif kind == "hook":
            if self.hook is None:
                self.hook = getattr(net, event.arg or "lin2").register_forward_hook(_add_one)
            else:
                self.hook.remove()
                self.hook = None
        elif kind == "reset":
            torch._dynamo.reset()
        elif kind in STRICT:
            self._apply_strict(event)
        else:  # pragma: no cover
            raise ValueError(kind)
        stance = stance_on()
        self.record.stance_at_events.append(stance)
        self.record.history.append(f"{label}: {event}" + (" (stance on)" if stance else ""))
        if event.where == "batch" and kind in BOUNDARY:
            self.tainted = f"{event} at {label}"

    def _apply_strict(self, event: Event) -> None:
        global GAIN
        net = self.net
        kind, arg = event.kind, event.arg
        kwargs = self.call_kwargs
        if kind in ("arg_int", "arg_float", "arg_str"):
            kwargs[{"arg_int": "k", "arg_float": "t", "arg_str": "mode"}[kind]] = arg
        elif kind == "arg_tensor":
            kwargs["extra"] = EXTRA if kwargs.get("extra") is None else None
        elif kind == "arg_kw":
            if kwargs.pop("shift", None) is None:
                kwargs["shift"] = 0.5
        elif kind == "attr":
            net.temp = arg
        elif kind == "global":
            GAIN = arg
        elif kind == "cfg":
            net.cfg.negate = not net.cfg.negate
        elif kind == "hook_add":
            if arg not in self.hooks:
                self.hooks[arg] = getattr(net, arg).register_forward_hook(_double)
        elif kind == "hook_remove":
            handle = self.hooks.pop(arg, None)
            if handle is not None:
                handle.remove()
        elif kind == "replace_param":
            sub = getattr(net, arg)
            old = sub.bias
            sub.bias = nn.Parameter(old.detach() + 0.125, old.requires_grad)
        elif kind == "sub_mode":
            sub = getattr(net, arg)
            sub.train(not sub.training)
        elif kind == "user_fn":
            self.user_w = arg
        else:  # pragma: no cover
            raise ValueError(kind)


def _user_function(out: torch.Tensor, w: float) -> torch.Tensor:
    """The user's own function, compiled by the user (``FuzzModule.user_fn``)."""
    return out * w + 1.0


def _describe(kwargs: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={'<tensor>' if isinstance(v, torch.Tensor) else repr(v)}" for k, v in kwargs.items()
    )


class Driver(L.Callback):
    """Applies the planned events; placed after GuardTuneCallback in ``callbacks``."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario

    def _events(self, epoch: int, batch_idx: int, where: str) -> list[Event]:
        steps = self.scenario.epochs[epoch]
        if batch_idx >= len(steps):
            return []
        return [e for e in steps[batch_idx].events if e.where == where]

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.tainted = None  # a boundary: the guard checks before the first batch
        for event in self._events(trainer.current_epoch, 0, "epoch"):
            pl_module.apply(event, f"epoch {trainer.current_epoch} start")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        for event in self._events(trainer.current_epoch, batch_idx, "batch"):
            pl_module.apply(event, f"epoch {trainer.current_epoch} batch {batch_idx}")

    def on_validation_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        pl_module.tainted = None  # a loop boundary


def plan_batches(scenario: Scenario) -> list[list[torch.Tensor]]:
    """The training inputs of every epoch: shapes from the plan, dtype from `dtype` events."""
    g = torch.Generator().manual_seed(7)
    dtype = torch.float32
    plan: list[list[torch.Tensor]] = []
    for steps in scenario.epochs:
        epoch: list[torch.Tensor] = []
        for step in steps:
            for e in step.events:
                if e.kind == "dtype":
                    dtype = e.arg
            epoch.append(torch.randn(step.batch_size, 4, generator=g).to(dtype))
        plan.append(epoch)
    return plan


class PlannedLoader:
    """An iterable of the planned batches of ``trainer.current_epoch`` (read lazily)."""

    def __init__(self, plan: list[list[torch.Tensor]], per_epoch: int) -> None:
        self.plan = plan
        self.per_epoch = per_epoch
        self.trainer: L.Trainer | None = None

    def __len__(self) -> int:
        return self.per_epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor]]:
        assert self.trainer is not None
        for x in self.plan[self.trainer.current_epoch]:
            yield (x,)


class ListLoader:
    """A fixed list of batches as one iterable (a plain list would be several loaders)."""

    def __init__(self, batches: list[tuple[torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor]]:
        return iter(self.batches)


def val_batches(sizes: Sequence[int]) -> ListLoader:
    g = torch.Generator().manual_seed(11)
    return ListLoader([(torch.randn(n, 4, generator=g),) for n in sizes])


def backend(scenario: Scenario) -> str:
    """``aot_eager`` when the scenario freezes or unfreezes: the eager backend follows
    ``requires_grad`` at run time and would hide a stale entry (H43); else ``eager``."""
    kinds = {e.kind for steps in scenario.epochs for step in steps for e in step.events}
    return "aot_eager" if "freeze" in kinds else "eager"


def make_guard(scenario: Scenario, **kwargs: Any) -> GuardTuneCallback:
    kwargs.setdefault("warmup_steps", scenario.warmup_steps)
    kwargs.setdefault("stable_steps", scenario.stable_steps)
    kwargs.setdefault("compile_kwargs", {"backend": backend(scenario)})
    kwargs.setdefault("audit_every", scenario.audit_every)
    for key, value in scenario.guard_kwargs:
        kwargs.setdefault(key, value)
    return GuardTuneCallback(scenario.preset, **kwargs)


def run_scenario(
    scenario: Scenario, **guard_kwargs: Any
) -> tuple[Record, GuardTuneCallback, FuzzModule]:
    """Fit the planned scenario; raise :class:`Divergence` on a silent wrong result."""
    global GAIN
    torch._dynamo.reset()
    torch.compiler.set_stance("default")
    L.seed_everything(0, verbose=False)
    GAIN = 1.0
    try:
        return _run(scenario, guard_kwargs)
    finally:
        GAIN = 1.0


def _run(
    scenario: Scenario, guard_kwargs: dict[str, Any]
) -> tuple[Record, GuardTuneCallback, FuzzModule]:
    per_epoch = len(scenario.epochs[0])
    assert all(len(e) == per_epoch for e in scenario.epochs), "same batches per epoch"
    record = Record()
    model = FuzzModule(record)
    for name in scenario.hooked:
        model.hooks[name] = getattr(model.net, name).register_forward_hook(_double)
    guard = make_guard(scenario, **guard_kwargs)
    model.guard = guard
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=len(scenario.epochs),
        num_sanity_val_steps=scenario.sanity_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[guard, Driver(scenario)],
    )
    loader = PlannedLoader(plan_batches(scenario), per_epoch)
    loader.trainer = trainer
    trainer.fit(model, loader, val_batches(scenario.val_sizes) if scenario.val_sizes else None)
    expected = len(scenario.epochs) * per_epoch
    assert guard.engine.train_batches() == expected, (guard.engine.train_batches(), expected)
    return record, guard, model
