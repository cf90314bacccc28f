"""The optimizer step, compiled as one frame and run directly while nothing changed (H49).

``torch.compile`` of ``opt.step()`` breaks the graph in torch's step wrappers before any
op (``Optimizer.profile_hook_step``'s hooks and profiler range, then
``_use_grad_for_differentiable``'s ``graph_break()``), so Dynamo looks up three frames a
step, with guards on every parameter, gradient and state tensor and on every
hyperparameter (165-365 µs a step on a 146-parameter Adam), and its entries have no
diff guards: the stance raises on them. :class:`CompiledStep` instead

* compiles a trampoline whose closure is the optimizer's own update, below those two
  wrappers (``fullgraph=True``: one frame), and runs the hooks, the closure and the
  profiler's step marker itself, as the wrappers do;
* calls it with full guards (Dynamo may compile) whenever something its entries read may
  have changed, and then *harvests* the entry Dynamo ran: the first whose guard manager
  accepts the step (:func:`~guardtrain.compile.accept.accepting_entry`'s rule);
* otherwise runs that entry's code directly, below Dynamo's entry path (H30), after a
  check of what the guards read (:class:`Snapshot`): the ``param_groups`` list and each
  group's ``params`` list by identity, the parameters by ``id``, every other value of a
  group by identity or, for a plain value (a float ``lr``), by equality; the ``state``
  dict by identity and length; which gradients are ``None``; the parameters' and
  gradients' dtype, device, shape and strides (Dynamo's ``TensorGuards``); the global
  state Dynamo guards (grad mode, autocast, deterministic algorithms); and that Dynamo
  still knows the entry (no ``torch._dynamo.reset()``).

A scheduled float ``lr`` changes a value the guards read: that step runs with full guards
(Dynamo recompiles once, at the second value, and then takes the value as an input) and
the next one directly again. ``load_state_dict`` replaces ``state`` and
``param_groups``; ``add_param_group`` lengthens the list; a frozen parameter's gradient
is ``None``; the first step creates the state: each is seen by the check.

Blind spots, as Dynamo's own guards would see them but this check does not: a tensor
assigned by hand into ``opt.state[p]`` in place of another (the state of an existing
parameter, same keys), and a global that the optimizer's update reads (a module-level
flag of ``torch.optim``) changed between steps.

Refused (:func:`refusal`): ``LBFGS`` (its closure runs many times inside its update),
``differentiable=True`` (the update must be traced with grad mode on).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import types
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.optim.optimizer as _optimizer

from guardtrain.compile.accept import first_accepting
from guardtrain.compile.direct import live_codes
from guardtrain.compile.options import build_compile_kwargs
from guardtrain.compile.trampoline import (
    TRAMPOLINE_GLOBALS,
    cache_entry_list,
    new_trampoline,
    trampoline_function,
)
from guardtrain.errors import GuardTrainRuntimeError

__all__ = ["CompiledStep", "Snapshot", "Values", "install", "installed", "refusal", "uninstall"]

_guards = torch._C._dynamo.guards
_Tensor = torch.Tensor
_pre_hooks = _optimizer._global_optimizer_pre_hooks
_post_hooks = _optimizer._global_optimizer_post_hooks
_MISSING = object()
_RECOMPILE_LIMIT: type[Exception] = getattr(
    torch._dynamo.exc, "FailOnRecompileLimitHit", torch._dynamo.exc.TorchDynamoException
)


def refusal(optimizer: Any) -> str | None:
    """Why ``optimizer``'s step cannot be compiled here, or None."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"{type(optimizer).__name__} is not a torch.optim.Optimizer"
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS evaluates its closure many times inside its step"
    if optimizer.defaults.get("differentiable"):
        return "differentiable=True: the update is traced with grad mode off"
    return None


def raw_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The optimizer class's update below torch's two step wrappers (the hooks and
    profiler range of ``profile_hook_step``, and ``_use_grad_for_differentiable``, which
    breaks the graph): the same function, as a plain step without a closure runs it."""
    func: Any = type(optimizer).step
    if getattr(func, "hooked", False):
        func = func.__wrapped__
    code = getattr(func, "__code__", None)
    if code is not None and code.co_name == "_use_grad" and hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    return func  # type: ignore[no-any-return]


class Snapshot:
    """What the entry harvested at a full-guard step read, and a check that it is still
    so (the module docstring lists what is compared)."""

    __slots__ = ("global_state", "groups", "ids", "items", "lists", "mask", "state", "tensors")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        self.groups = groups
        self.lists = [g["params"] for g in groups]
        self.ids = [list(map(id, p)) for p in self.lists]
        self.items = [tuple(g.items()) for g in groups]
        self.state = (optimizer.state, len(optimizer.state))
        params = [p for p in self.lists for p in p]
        grads = [p.grad for p in params]
        self.mask = [g is None for g in grads]
        self.tensors = _guards.TensorGuards(
            *params,
            *[g for g in grads if g is not None],
            dynamic_dims_sizes=None,
            dynamic_dims_strides=None,
        )
        self.global_state = _guards.GlobalStateGuard()

    def values_moved(self, optimizer: torch.optim.Optimizer, values: Values | None) -> bool:
        """Whether every group value that changed is a float the entry takes as an input
        (``values``: its compile's :class:`Values`), not NaN; if so the snapshot takes
        the new values. Called after :meth:`change` said ``hyperparameters``: the groups,
        their keys and their ``params`` are as they were."""
        if values is None:
            return False
        moved: list[tuple[int, tuple[tuple[str, Any], ...]]] = []
        for i, (group, items) in enumerate(zip(optimizer.param_groups, self.items)):
            now = tuple(group.items())
            if [k for k, _ in now] != [k for k, _ in items]:
                return False
            for (key, value), (_, then) in zip(now, items):
                if _same(value, then):
                    continue
                if (
                    type(value) is not float
                    or type(then) is not float
                    or (i, key) not in values.inputs
                    or math.isnan(value)
                ):
                    return False
            moved.append((i, now))
        for i, now in moved:
            self.items[i] = now
        return True

    def change(self, optimizer: torch.optim.Optimizer) -> str | None:
        """What changed since the snapshot, or None."""
        params = self._groups_change(optimizer)
        if isinstance(params, str):
            return params
        state, n = self.state
        if optimizer.state is not state or len(state) != n:
            return "state"
        grads = [p.grad for p in params]
        if [g is None for g in grads] != self.mask:
            return "gradients None"
        if not self.tensors.check(*params, *[g for g in grads if g is not None]):
            return "tensor metadata"
        if not self.global_state.check():
            return "global state"
        return None

    def _groups_change(self, optimizer: torch.optim.Optimizer) -> str | list[Any]:
        """What changed in the groups, or (nothing) their parameters."""
        groups = optimizer.param_groups
        if groups is not self.groups or len(groups) != len(self.lists):
            return "param_groups"
        params: list[Any] = []
        for group, plist, ids, items in zip(groups, self.lists, self.ids, self.items):
            now = group["params"]
            if now is not plist or list(map(id, now)) != ids:
                return "params"
            if len(group) != len(items) or not all(
                _same(group.get(k, _MISSING), v) for k, v in items
            ):
                return "hyperparameters"
            params += now
        return params


_GROUP = re.compile(r"^bound\.__self__\.param_groups\[(\d+)\]\['([^']+)'\]")
_SHAPE_SOURCE = re.compile(r"L\['bound'\]\.__self__\.param_groups\[(\d+)\]\['([^']+)'\]")
_NOT_NAN = re.compile(
    r"^not math\.isnan\(L\['bound'\]\.__self__\.param_groups\[\d+\]\['[^']+'\]\)$"
)


_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})


@dataclasses.dataclass(frozen=True, slots=True)
class Values:
    """What one compile's guards assert of the param groups' values: the ``(group, key)``
    they pin (any guard on it or below it but a type check), and those only checked for
    NaN (a float Dynamo made an input: ``not math.isnan(...)`` its one symbolic guard)."""

    pinned: frozenset[tuple[int, str]]
    inputs: frozenset[tuple[int, str]]
    state_values: bool = False
    """A guard reads a plain value of the per-parameter state (a custom optimizer's Python
    counter, pinned or symbolic): the snapshot does not compare those, so the entry
    never runs directly."""

    @classmethod
    def of(cls, guards: Sequence[Any]) -> Values:
        """From the guards a compile passes to its guard filter."""
        pinned: set[tuple[int, str]] = set()
        symbolic: set[tuple[int, str]] = set()
        state_values = False
        for guard in guards:
            if ".state[" in guard.name and guard.guard_type in _VALUE_GUARDS:
                state_values = True
            if guard.guard_type == "SHAPE_ENV":
                for text in getattr(guard.orig_guard, "code_list", None) or ["?"]:
                    found = {(int(i), k) for i, k in _SHAPE_SOURCE.findall(text)}
                    (symbolic if _NOT_NAN.match(text) else pinned).update(found)
                    state_values = state_values or ".state[" in text
                continue
            match = _GROUP.match(guard.name)
            if match is None:
                continue
            if guard.name != match[0] or guard.guard_type != "TYPE_MATCH":
                pinned.add((int(match[1]), match[2]))
        return cls(frozenset(pinned), frozenset(symbolic - pinned), state_values)


def _same(now: Any, then: Any) -> bool:
    """A group's value is unchanged: the same object, or an equal plain value."""
    if now is then:
        return True
    if isinstance(now, _Tensor) or isinstance(then, _Tensor):
        return False
    return type(now) is type(then) and bool(now == then)


class CompiledStep:
    """One optimizer's step: compiled as one frame, direct while :class:`Snapshot` holds.

    Args:
        optimizer: the optimizer (see :func:`refusal`).
        compile_kwargs: the run's validated ``compile_kwargs`` (``fullgraph`` is set).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, compile_kwargs: dict[str, Any]) -> None:
        self.optimizer = optimizer
        self.name = type(optimizer).__name__
        self.bound = types.MethodType(raw_step(optimizer), optimizer)
        self.trampoline = new_trampoline(shared=False)
        self.closure = (types.CellType(self.bound),)
        # A fresh options dict with the recording filter; a `mode` expanded into options.
        kwargs = build_compile_kwargs(compile_kwargs, self._record)
        kwargs["fullgraph"] = True
        self.compiled = torch.compile(
            trampoline_function(self.trampoline, self.closure, shared=False), **kwargs
        )
        self.recorded: list[Values] = []  # what each compile's guards assert of the groups
        self.values: dict[int, Values] = {}  # id(entry code) -> that
        self.direct: Callable[[], Any] | None = None
        self.direct_code: Any = None
        self.snapshot: Snapshot | None = None
        self.eager: str | None = None
        """Why the step runs uncompiled for the rest of the run (Dynamo refused it)."""
        if any(group.get("fused") for group in optimizer.param_groups):
            # torch marks the fused update `torch.compiler.disable`: a graph break (plain
            # compile runs it eagerly too); it is one kernel already.
            self.eager = "fused=True: one fused kernel, which Dynamo does not trace"
        self.direct_allowed = True
        """False: every step with full guards (what direct dispatch saves, measured)."""
        self.full_steps = 0
        self.direct_steps = 0
        self.changes: collections.Counter[str] = collections.Counter()
        self.previous: Any = _MISSING  # the instance `step` install() replaced
        self.method: Any = None  # the one install() set

    def _record(self, guards: Sequence[Any]) -> list[bool]:
        """The guard filter: keeps every guard, and records which group values the
        compile's guards pin (:class:`Values`)."""
        self.recorded.append(Values.of(guards))
        return [True] * len(guards)

    def entries(self) -> int:
        """Dynamo's cache entries for the step's frame."""
        return len(cache_entry_list(self.trampoline)) if cache_entry_list is not None else 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)``: the pre-hooks, the closure, the update (direct or
        with full guards), the profiler's step marker, the post-hooks."""
        opt = self.optimizer
        args: tuple[Any, ...] = (opt,)  # as torch's wrapper gives them to the hooks
        kwargs: dict[str, Any] = {} if closure is None else {"closure": closure}
        for pre_hook in (*_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()):
            result = pre_hook(opt, args, kwargs)
            if result is not None:  # as torch's wrapper: new (args, kwargs)
                args, kwargs = result
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        loss = None
        if closure is not None:  # as the optimizers' own step: first, with grad mode on
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._update()
        # What an LR scheduler's own step wrapper records (its check before its step).
        opt._opt_called = True  # type: ignore[attr-defined]
        opt._optimizer_step_code()
        for post_hook in (*opt._optimizer_step_post_hooks.values(), *_post_hooks.values()):
            post_hook(opt, args, kwargs)
        return loss

    def _update(self) -> None:
        if self.eager is not None:
            self.bound()
            return
        direct, snapshot = self.direct, self.snapshot
        if direct is not None and snapshot is not None:
            change = snapshot.change(self.optimizer)
            if change == "hyperparameters" and snapshot.values_moved(
                self.optimizer, self.values.get(id(self.direct_code))
            ):
                # Values the entry takes as inputs (a scheduled lr): the snapshot has
                # them now; everything after them is checked as always.
                change = snapshot.change(self.optimizer)
                if change is None:
                    self.changes["hyperparameters, served directly"] += 1
            if change is None and live_codes is not None and id(self.direct_code) in live_codes:
                direct()
                self.direct_steps += 1
                return
            if change is not None:
                self.changes[change] += 1
        self._full()

    def _full(self) -> None:
        """A step with full guards (Dynamo may compile), then the entry it ran harvested."""
        self.direct = self.direct_code = None
        self.recorded.clear()
        try:
            self.compiled()
        except (torch._dynamo.exc.TorchDynamoException, _RECOMPILE_LIMIT) as err:
            # Dynamo cannot compile this update as one frame (a graph break, an
            # unsupported op, its recompile limit): it runs uncompiled from now on, as
            # plain compile runs a frame past its limit. Nothing ran before the error.
            self.eager = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            self.bound()
            return
        self.full_steps += 1
        if self.direct_allowed:
            self.snapshot = Snapshot(self.optimizer)
            self._harvest()

    def _harvest(self) -> None:
        if cache_entry_list is None or live_codes is None:
            return
        found = first_accepting(self.trampoline, {"args": (), "kwargs": {}, "bound": self.bound})
        if found is not None:
            code = found[0].code
            self.direct = types.FunctionType(
                code, TRAMPOLINE_GLOBALS, code.co_name, None, self.closure
            )
            self.direct_code = code
        if self.recorded:  # this step compiled: the newest entry is its
            self.values[id(cache_entry_list(self.trampoline)[0].code)] = self.recorded[-1]
        values = self.values.get(id(self.direct_code))
        if values is None or values.state_values:
            # What the entry's guards read is not all in the snapshot: full guards.
            self.direct = self.direct_code = None

    def summary(self) -> dict[str, Any]:
        """The facts ``summary()["optimizers"]`` shows for this optimizer."""
        return {
            "optimizer": self.name,
            "compiles": self.entries(),
            "direct_steps": self.direct_steps,
            "full_guard_steps": self.full_steps,
            "changes": dict(self.changes),
            "eager": self.eager,
        }


_INSTALLED: weakref.WeakKeyDictionary[Any, CompiledStep] = weakref.WeakKeyDictionary()
"""Each optimizer whose ``step`` is compiled, and its :class:`CompiledStep`."""


def _step(optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
    """The ``step`` installed on the optimizer. An LR scheduler made after it wraps it (it
    re-binds this function); after :func:`uninstall` such a wrapper reaches the class's
    own step through here."""
    compiled = _INSTALLED.get(optimizer)
    if compiled is None:
        return type(optimizer).step(optimizer, closure)
    return compiled.step(closure)


# An LR scheduler checks for its own wrapper (and warns that the step was replaced) and
# reads `_opt_called`, which CompiledStep.step sets; one made later keeps this step as it is.
_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def installed(optimizer: Any) -> CompiledStep | None:
    """The :class:`CompiledStep` that runs ``optimizer.step`` now, or ``None``."""
    return _INSTALLED.get(optimizer)


def install(step: CompiledStep) -> None:
    """``step.optimizer.step`` runs ``step`` until :func:`uninstall`; an instance ``step``
    already there (an LR scheduler's wrapper) is put back then."""
    opt = step.optimizer
    if opt in _INSTALLED:
        raise GuardTrainRuntimeError(
            f"The step of this {step.name} is already compiled by another live run "
            "(`compile_optimizer=True`): one run at a time may compile an optimizer."
        )
    _INSTALLED[opt] = step
    step.previous = opt.__dict__.get("step", _MISSING)
    step.method = opt.__dict__["step"] = types.MethodType(_step, opt)


def uninstall(step: CompiledStep) -> None:
    """Put back the optimizer's own ``step`` (or what was there before :func:`install`)."""
    opt = step.optimizer
    if _INSTALLED.get(opt) is step:
        del _INSTALLED[opt]
    if opt.__dict__.get("step") is step.method:
        if step.previous is _MISSING:
            del opt.__dict__["step"]
        else:
            opt.__dict__["step"] = step.previous
