"""Stale compiled calls after a mid-epoch change: torch.compile, the guide's recipe, guardtrain.

For each kind of change that issue 17 lists (a plain argument of ``forward``, a
global, a module attribute, a config field, dropout ``p``, a submodule's mode, a
replaced parameter, a lazily created buffer, a forward hook added or removed, a
swapped global function), a tiny module is trained for ``--steps`` steps of a
plain loop (SGD, backend ``"eager"``) and the change is made between two steps
(at ``--change-at``). Every call is compared, bitwise, with the uncompiled
``forward`` run on the same module state with the same RNG seed (under
``no_grad``, before the compiled call; the state the reference call wrote is put
back). A call whose output differs is *stale*.

Columns (each run starts from ``torch._dynamo.reset()`` and a restored Dynamo
config and stance):

* ``torch.compile``: ``module.compile(backend="eager")``, torch's default guards.
* ``guide recipe``: PyTorch's guide by hand: ``install_free_tensors=True``,
  ``guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe`` and
  ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` after ``--warmup``
  steps. A call that raises (a miss under the stance) ends the run: ``error``.
* ``off`` ... ``turbo``: ``guardtrain.GuardTuner`` with that preset
  (``warmup_steps=2, stable_steps=2``, default ``audit_every``).

A cell is ``stale/calls`` over the calls from the change on (the lazy buffer is
created by the first call, so its row counts every call); ``error`` when a call
raised. A ``*`` marks a run with stale calls before the change (a harness bug),
``°`` a stance configuration that was not under the stance at the change.

Usage (``guardtrain`` is the one the interpreter imports: the editable install of
``scripts/setup.sh``; ``PYTHONPATH=.`` for another checkout or worktree)::

    .venv/bin/python scripts/soundness_table.py [--out docs/table.md] [--cases a,b] [--configs x,y]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

STEPS = 24
CHANGE_AT = 10
WARMUP = 3
PRESETS = ("off", "safe", "balanced", "aggressive", "turbo")
CONFIGS = ("torch.compile", "guide recipe", *PRESETS)
STANCE_CONFIGS = ("guide recipe", "balanced", "aggressive", "turbo")

# -- globals read by forward (reset before every run) -------------------------------------

GAIN = 1.0


def relu_act(h: torch.Tensor) -> torch.Tensor:
    return torch.relu(h)


def tanh_act(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h)


ACT = relu_act


def _double(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 2.0


def _reset_globals() -> None:
    global GAIN, ACT
    GAIN = 1.0
    ACT = relu_act
    ClassGain.GAIN = 1.0


# -- the modules -----------------------------------------------------------------------------


class Base(nn.Module):
    """Linear(4, 8) -> ReLU -> Linear(8, 3): no randomness, no BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.lin2 = nn.Linear(8, 3)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


class IntArg(Base):
    def forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return self.body(x) * k


class FloatArg(Base):
    def forward(self, x: torch.Tensor, t: float) -> torch.Tensor:
        return self.body(x) / t


class StrArg(Base):
    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        h = self.lin1(x)
        h = torch.tanh(h) if mode == "tanh" else torch.relu(h)
        return self.lin2(h)


class OptionalTensor(Base):
    def forward(self, x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        h = torch.relu(self.lin1(x))
        if extra is not None:
            h = h + extra
        return self.lin2(h)


class Keyword(Base):
    def forward(self, x: torch.Tensor, shift: float | None = None) -> torch.Tensor:
        out = self.body(x)
        if shift is not None:
            out = out + shift
        return out


class GlobalScalar(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * GAIN


class Attribute(Base):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) / self.temperature


class WithDropout(Base):
    """Dropout in training mode: both calls of a step get the same seed."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.drop(torch.relu(self.lin1(x))))


class Config:
    def __init__(self) -> None:
        self.negate = False


class ConfigField(Base):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return -out if self.cfg.negate else out


class LazyBuffer(Base):
    """Creates a counting buffer on its first call (litgpt's LoRA pattern, H39)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "calls"):
            self.register_buffer("calls", torch.zeros(()))
        self.calls.add_(1)
        return self.body(x) + self.calls


class Plain(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Hooked(Base):
    def __init__(self) -> None:
        super().__init__()
        self.handle = self.lin1.register_forward_hook(_double)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class GlobalFunction(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(ACT(self.lin1(x)))


class ListScale(Base):
    def __init__(self) -> None:
        super().__init__()
        self.scales = [1.0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scales[0]


class ListBlocks(Base):
    """``self.active`` (a plain list) picks the blocks that run after ``lin1``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.active = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin1(x))
        for i in self.active:
            h = torch.tanh(self.blocks[i](h))
        return self.lin2(h)


class ClassGain(Base):
    GAIN = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.GAIN


class FrozenFirst(Base):
    """``lin1`` frozen from the start (a backbone to unfreeze)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


# -- the cases -------------------------------------------------------------------------------


def _no_args(step: int, after: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), {}


def _set_gain(model: nn.Module) -> None:
    global GAIN
    GAIN = 2.0


def _swap_act(model: nn.Module) -> None:
    global ACT
    ACT = tanh_act


def _replace_weight(model: nn.Module) -> None:
    old = model.lin2.weight
    model.lin2.weight = nn.Parameter(old.detach() * 0.5 + 0.05)


def _nothing(model: nn.Module) -> None:
    pass


@dataclass(frozen=True)
class Case:
    name: str
    change: str
    build: Callable[[], nn.Module]
    args: Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]] = _no_args
    """The call's positional and keyword arguments at ``step``, ``after`` steps after the
    change (negative before it)."""
    apply: Callable[[nn.Module], None] = _nothing
    """The change, made between two steps."""
    from_first_call: bool = False
    """The change is made by the first call itself (count every call)."""
    backend: str = "eager"
    """``aot_eager`` where the eager backend would hide a stale entry (H43)."""
    grads: bool = False
    """A call is also stale when its parameters' gradients differ from eager's (which
    got one, and its value)."""
    user: str | None = None
    """The user's own compiled code called after each call (H41): ``"loss weight"``, a
    compiled function given a weight that changes from the change on (stale when it
    differs from eager); ``"optimizer step"``, PyTorch's compiled-optimizer recipe
    (Adam and a scheduler): a run it raises in is ``error``."""


_EXTRA = torch.full((8,), 0.25)

CASES: tuple[Case, ...] = (
    Case(
        "int argument",
        "`k` 1, then `2 + step % 3` (3, 4, 2, ...)",
        IntArg,
        args=lambda s, a: ((2 + s % 3 if a >= 0 else 1,), {}),
    ),
    Case(
        "float argument",
        "`t` 1.0, then 0.9, 0.81, ... (annealed)",
        FloatArg,
        args=lambda s, a: ((round(0.9 ** (a + 1), 6) if a >= 0 else 1.0,), {}),
    ),
    Case(
        "str argument",
        '`mode` "relu", then "tanh"',
        StrArg,
        args=lambda s, a: (("tanh" if a >= 0 else "relu",), {}),
    ),
    Case(
        "optional tensor",
        "`extra` None, then a tensor on every other step",
        OptionalTensor,
        args=lambda s, a: ((_EXTRA if a >= 0 and a % 2 == 0 else None,), {}),
    ),
    Case(
        "keyword on some steps",
        "`shift=0.5` given on every other step",
        Keyword,
        args=lambda s, a: ((), {"shift": 0.5} if a >= 0 and a % 2 == 0 else {}),
    ),
    Case("global scalar", "module global `GAIN` 1.0 -> 2.0", GlobalScalar, apply=_set_gain),
    Case(
        "module attribute",
        "`self.temperature` 1.0 -> 0.5",
        Attribute,
        apply=lambda m: setattr(m, "temperature", 0.5),
    ),
    Case(
        "dropout p",
        "`self.drop.p` 0.1 -> 0.5",
        WithDropout,
        apply=lambda m: setattr(m.drop, "p", 0.5),
    ),
    Case(
        "config field",
        "`self.cfg.negate` False -> True",
        ConfigField,
        apply=lambda m: setattr(m.cfg, "negate", True),
    ),
    Case(
        "submodule train(False)",
        "`self.drop.train(False)`, the root stays in training",
        WithDropout,
        apply=lambda m: m.drop.train(False),
    ),
    Case(
        "replaced parameter",
        "`lin2.weight = nn.Parameter(...)`",
        Plain,
        apply=_replace_weight,
    ),
    Case(
        "lazy buffer",
        "`register_buffer` on the first call, then counted up",
        LazyBuffer,
        from_first_call=True,
    ),
    Case(
        "forward hook added",
        "`lin1.register_forward_hook(...)` (doubles)",
        Plain,
        apply=lambda m: m.lin1.register_forward_hook(_double),
    ),
    Case(
        "forward hook removed",
        "the hook on `lin1` removed",
        Hooked,
        apply=lambda m: m.handle.remove(),
    ),
    Case(
        "swapped global function",
        "module global `ACT` relu -> tanh",
        GlobalFunction,
        apply=_swap_act,
    ),
    Case(
        "list item in place",
        "`self.scales[0] = 2.0`",
        ListScale,
        apply=lambda m: m.scales.__setitem__(0, 2.0),
    ),
    Case(
        "list appended",
        "`self.active.append(1)`: a second block runs",
        ListBlocks,
        apply=lambda m: m.active.append(1),
    ),
    Case(
        "class attribute",
        "`ClassGain.GAIN = 2.0`",
        ClassGain,
        apply=lambda m: setattr(ClassGain, "GAIN", 2.0),
    ),
    Case(
        "unfrozen layer",
        "`lin1.requires_grad_(True)` (aot_eager, gradients compared)",
        FrozenFirst,
        apply=lambda m: m.lin1.requires_grad_(True),
        backend="aot_eager",
        grads=True,
    ),
    Case(
        "frozen layer",
        "`lin1.weight.requires_grad = False` (aot_eager, gradients compared)",
        Plain,
        apply=lambda m: setattr(m.lin1.weight, "requires_grad", False),
        backend="aot_eager",
        grads=True,
    ),
    Case(
        "user's compiled loss weight",
        "the user's `torch.compile(f)(out, w)`, `w` 1.0, then 0.9, 0.81, ...",
        Plain,
        user="loss weight",
    ),
    Case(
        "user's compiled optimizer step",
        "`@torch.compile` over Adam's `step()` and a scheduler's",
        Plain,
        user="optimizer step",
    ),
)
CASE_NAMES = tuple(c.name for c in CASES)


# -- one run ---------------------------------------------------------------------------------


@dataclass
class Result:
    config: str = ""
    stale: int = 0
    calls: int = 0
    stale_before: int = 0
    error: str | None = None
    stance_at_change: bool | None = None
    stale_steps: list[int] = field(default_factory=list)

    def cell(self) -> str:
        text = "error" if self.error else f"{self.stale}/{self.calls}"
        if self.stale_before:
            text += "*"
        if self.stance_at_change is False and self.config in STANCE_CONFIGS:
            text += "°"
        return text


class _State:
    """What a reference call may change, to put back: buffer objects and values, new keys."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = list(model.modules())
        self.keys = [set(m.__dict__) for m in self.modules]
        self.buffers = [dict(m._buffers) for m in self.modules]
        self.values = [
            {k: None if b is None else b.detach().clone() for k, b in m._buffers.items()}
            for m in self.modules
        ]

    def restore(self) -> None:
        for m, keys, buffers, values in zip(self.modules, self.keys, self.buffers, self.values):
            for k in [k for k in m.__dict__ if k not in keys]:
                del m.__dict__[k]
            for k in [k for k in m._buffers if k not in buffers]:
                del m._buffers[k]
            for k, b in buffers.items():
                if m._buffers.get(k) is not b:
                    m._buffers[k] = b
                v = values[k]
                if b is not None and v is not None and not torch.equal(b, v):
                    with torch.no_grad():
                        b.copy_(v)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN equal to NaN), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0]


def _stance_on() -> bool:
    """The guide's recipes set torch's stance for the process; guardtrain's targets set it
    around their own compiled calls only (H41), so between calls it is their state."""
    from guardtrain.compile import steady_now

    return bool(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe) or steady_now()


@contextlib.contextmanager
def _clean() -> Iterator[None]:
    """A fresh Dynamo, and Dynamo's config, the stance and this module's globals restored."""
    saved = torch._dynamo.config.get_config_copy()
    torch._dynamo.reset()
    torch.compiler.set_stance("default")
    _reset_globals()
    try:
        yield
    finally:
        torch.compiler.set_stance("default")
        now = torch._dynamo.config.get_config_copy()
        for key, value in saved.items():
            if now.get(key) != value:
                setattr(torch._dynamo.config, key, value)
        torch._dynamo.reset()
        _reset_globals()


def _batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 4, generator=g) for _ in range(steps)]


def run_case(
    case: Case | str, config: str, steps: int = STEPS, change_at: int = CHANGE_AT
) -> Result:
    """Train ``case``'s module under ``config``; count stale calls (see the module docstring)."""
    if isinstance(case, str):
        case = next(c for c in CASES if c.name == case)
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; one of {CONFIGS}")
    with _clean(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = case.build()
        model.train()
        _, optimizer_step = _optimizer(case, model, steps)
        with _compiled(model, config, case.backend) as (step_context, after_warmup):
            return _loop(
                config, case, model, optimizer_step, step_context, after_warmup, steps, change_at
            )


def _optimizer(case: Case, model: nn.Module, steps: int) -> tuple[Any, Callable[[], None]]:
    """The optimizer and the step the loop calls: SGD's own, or PyTorch's compiled-optimizer
    recipe (the user's code, compiled in every column) for the ``optimizer step`` case."""
    if case.user != "optimizer step":
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def sgd_step() -> None:
            opt.step()
            opt.zero_grad()

        return opt, sgd_step
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(adam, total_iters=steps)

    @torch.compile(backend="aot_eager")
    def compiled_step() -> None:
        adam.step()
        sched.step()

    def adam_step() -> None:
        compiled_step()
        adam.zero_grad()

    return adam, adam_step


def _weighted(out: torch.Tensor, w: float) -> torch.Tensor:
    """The user's loss weight (``loss weight``); compiled by the user in every column."""
    return out * w


def _weight(after: int) -> float:
    return 1.0 if after < 0 else round(0.9 ** (after + 1), 6)


@contextlib.contextmanager
def _compiled(
    model: nn.Module, config: str, backend: str = "eager"
) -> Iterator[tuple[Callable[[Any], Any], Callable[[int], None]]]:
    """Compile ``model`` in place for ``config``: (the per-step context, a per-step hook)."""
    if config == "torch.compile":
        model.compile(backend=backend)
        yield (lambda batch: contextlib.nullcontext()), (lambda step: None)
        return
    if config == "guide recipe":
        torch._dynamo.config.install_free_tensors = True
        filter_fn = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        model.compile(backend=backend, options={"guard_filter_fn": filter_fn})

        def after_step(step: int) -> None:
            if step + 1 == WARMUP:
                torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)

        yield (lambda batch: contextlib.nullcontext()), after_step
        return
    from guardtrain import GuardTuner

    tuner = GuardTuner(
        model, preset=config, compile_kwargs={"backend": backend}, warmup_steps=2, stable_steps=2
    )
    with tuner:
        yield tuner.step, (lambda step: None)


def _loop(
    config: str,
    case: Case,
    model: nn.Module,
    optimizer_step: Callable[[], None],
    step_context: Callable[[Any], Any],
    after_step: Callable[[int], None],
    steps: int,
    change_at: int,
) -> Result:
    result = Result(config)
    forward = type(model).forward
    first = 0 if case.from_first_call else change_at
    user_fn = torch.compile(_weighted, backend="aot_eager")
    for step, x in enumerate(_batches(steps)):
        if step == change_at and not case.from_first_call:
            result.stance_at_change = _stance_on()
            case.apply(model)
        args, kwargs = case.args(step, step - change_at)
        seed = 1000 + step
        state = _State(model)
        torch.manual_seed(seed)
        with torch.no_grad():
            ref = forward(model, x, *args, **kwargs)
        state.restore()
        ref_grads = _reference_grads(model, forward, x, args, kwargs, seed) if case.grads else None
        with step_context((x,)):
            torch.manual_seed(seed)
            try:
                out = model(x, *args, **kwargs)
                stale = not _same(out.detach(), ref)
                if case.user == "loss weight":
                    w = _weight(step - change_at)
                    stale |= not _same(user_fn(out.detach(), w), _weighted(ref, w))
                out.sum().backward()
                if ref_grads is not None:
                    stale |= not _same_grads(model, ref_grads)
                optimizer_step()  # the user's code between two target calls (H41)
            except Exception as err:  # a miss under the stance, say
                result.error = f"step {step}: {type(err).__name__}: {_first_line(err)}"
                return result
        after_step(step)
        if step >= first:
            result.calls += 1
            if stale:
                result.stale += 1
                result.stale_steps.append(step)
        elif stale:
            result.stale_before += 1
    if case.from_first_call:
        result.stance_at_change = None
    return result


def _reference_grads(
    model: nn.Module, forward: Any, x: torch.Tensor, args: Any, kwargs: Any, seed: int
) -> list[torch.Tensor | None]:
    """Eager's gradient of every parameter (None where it requires none) for this step."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    state = _State(model)
    torch.manual_seed(seed)
    out = forward(model, x, *args, **kwargs)
    found = iter(torch.autograd.grad(out.sum(), trainable, allow_unused=True))
    state.restore()
    return [next(found) if p.requires_grad else None for p in params]


def _same_grads(model: nn.Module, ref: list[torch.Tensor | None]) -> bool:
    for p, g in zip(model.parameters(), ref):
        if (p.grad is None) != (g is None) or (g is not None and not _same(p.grad, g)):
            return False
    return True


# -- the table -------------------------------------------------------------------------------


def table(
    cases: tuple[str, ...] = CASE_NAMES,
    configs: tuple[str, ...] = CONFIGS,
    steps: int = STEPS,
    change_at: int = CHANGE_AT,
    progress: Callable[[str], None] | None = None,
) -> tuple[str, dict[tuple[str, str], Result]]:
    results: dict[tuple[str, str], Result] = {}
    for name in cases:
        for config in configs:
            try:
                results[name, config] = run_case(name, config, steps, change_at)
            except Exception as err:  # a run that could not start: say so, go on
                results[name, config] = Result(
                    config, error=f"{type(err).__name__}: {_first_line(err)}"
                )
            if progress is not None:
                progress(f"{name:>24} | {config:<13} | {results[name, config].cell()}")
    by_name = {c.name: c for c in CASES}
    lines = [
        "| change | what changes | " + " | ".join(f"`{c}`" for c in configs) + " |",
        "|---|---|" + "---:|" * len(configs),
    ]
    for name in cases:
        cells = " | ".join(results[name, c].cell() for c in configs)
        lines.append(f"| {name} | {by_name[name].change} | {cells} |")
    errors = [(k, r.error) for k, r in results.items() if r.error]
    if errors:
        lines.append("")
        lines.append("Errors:")
        lines.append("")
        lines.extend(f"* {n}, `{c}`: {e}" for (n, c), e in errors)
    return "\n".join(lines), results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the Markdown table to this file")
    parser.add_argument("--cases", help=f"comma-separated, of: {', '.join(CASE_NAMES)}")
    parser.add_argument("--configs", help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--change-at", type=int, default=CHANGE_AT)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    ns = parser.parse_args(argv)
    cases = tuple(ns.cases.split(",")) if ns.cases else CASE_NAMES
    configs = tuple(ns.configs.split(",")) if ns.configs else CONFIGS
    for name in cases:
        if name not in CASE_NAMES:
            parser.error(f"unknown case {name!r}")
    for config in configs:
        if config not in CONFIGS:
            parser.error(f"unknown configuration {config!r}")
    if not 0 < ns.change_at < ns.steps:
        parser.error("--change-at must lie between 0 and --steps")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    logging.getLogger("guardtrain").setLevel(logging.ERROR)
    start = time.perf_counter()
    progress = None if ns.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        body, _ = table(cases, configs, ns.steps, ns.change_at, progress)
    finally:
        torch.set_num_threads(threads)
    import guardtrain

    header = (
        f"Stale calls out of the calls from the change on (step {ns.change_at} of "
        f"{ns.steps}), {datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"guardtrain {guardtrain.__version__}, backend eager (aot_eager for `requires_grad`), "
        f"{time.perf_counter() - start:.0f} s.\n"
    )
    if progress is not None:
        progress(f"guardtrain imported from {os.path.dirname(guardtrain.__file__)}")
    text = header + "\n" + body + "\n"
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
