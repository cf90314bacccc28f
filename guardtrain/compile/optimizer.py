"""The optimizer step, compiled as one frame and run directly while nothing changed (H49).

``torch.compile`` of ``opt.step()`` breaks the graph in torch's step wrappers before any
op (``Optimizer.profile_hook_step``'s hooks and profiler range, then
``_use_grad_for_differentiable``'s ``graph_break()``), so Dynamo looks up three frames a
step, with guards on every parameter, gradient and state tensor and on every
hyperparameter, and its entries have no diff guards: the stance raises on them.
:class:`CompiledStep` instead

* compiles a trampoline whose closure is the optimizer's own update, below those two
  wrappers (``fullgraph=True``: one frame), and runs the hooks, the closure and the
  profiler's step marker itself, as the wrappers do;
* calls it with full guards (Dynamo may compile) whenever something its entries read may
  have changed, and then *harvests* the entry Dynamo ran, as any target's
  (:class:`~guardtrain.compile.direct.DirectEntry`: the first entry whose guard manager
  accepts the step, its code run as a function, the gradients' ``TensorGuards`` and
  Dynamo's global-state guard);
* otherwise runs that entry directly, below Dynamo's entry path (H30), after
  :class:`StepCheck`: versions of the dictionaries that a change writes (the
  optimizer's ``__dict__``, each param group, the state and each parameter's state, the
  namespaces whose globals the update reads), the groups' ``params`` lists by identity,
  which gradients are ``None``, and the gradients' metadata. Its cost per step is a few
  C calls plus a pass over the gradients.

A step whose hyperparameters took new values (a scheduled float ``lr``) runs with full
guards: Dynamo's own guards decide it (it recompiles once, at the lr's second value, and
then takes the lr as an input), and the entry is harvested again at the first step after
one whose values had not changed. Asking the harvested entry's guard manager first and
then running it directly cost more than that full-guards step (docs/bench.md). A write
that leaves every value as it was (a constant schedule) is no change: plain values are
compared by type and value; any other value (a tensor, a list) counts as changed.
``load_state_dict`` rewrites the optimizer's ``__dict__``; ``add_param_group`` lengthens
the list; a frozen parameter's gradient is ``None``; the first step creates the state; a
tensor assigned by hand into ``opt.state[p]`` writes that parameter's state; a
module-level flag of ``torch.optim`` assigned writes its namespace: each is seen by the
check. Its compiles are told to the run (``on_compile``), as the targets' are.

Blind spots: a parameter's or a state tensor's metadata changed in place (``p.data =``
a tensor of another dtype or shape) after the backward that made its gradient and
before the step; both wait for the run's next step with full guards (an audit).

Refused (:func:`refusal`): ``LBFGS`` (its closure runs many times inside its update),
``differentiable=True`` (the update must be traced with grad mode on).
"""

from __future__ import annotations

import collections
import math
import operator
import types
import weakref
from typing import Any, Callable, Sequence

import torch

from guardtrain._torch import (
    LR_SCHEDULER_WRAPPED,
    STEP_CALLED,
    STEP_POST_HOOKS,
    STEP_PRE_HOOKS,
    STEP_PROFILE,
    DynamoException,
    RecompileLimitHit,
    guards,
    optimizer_post_hooks,
    optimizer_pre_hooks,
)
from guardtrain.compile.accept import first_accepting
from guardtrain.compile.assertions import (
    kept_global_assertions,
    polled_objects,
    reads_state_values,
)
from guardtrain.compile.direct import DirectEntry, live_codes
from guardtrain.compile.options import build_compile_kwargs
from guardtrain.compile.polled import Polled
from guardtrain.compile.trampoline import (
    CLOSURE_NAME,
    TRAMPOLINE_GLOBALS,
    cache_entry_list,
    compiling_frame,
    new_trampoline,
    trampoline_function,
)
from guardtrain.errors import GuardTrainRuntimeError

__all__ = [
    "CompileHook",
    "CompiledStep",
    "StepCheck",
    "install",
    "installed",
    "installed_steps",
    "refusal",
    "uninstall",
]

_dict_version: Callable[[dict[Any, Any]], int] = guards.dict_version
_grad = operator.attrgetter("grad")
_Tensor = torch.Tensor
_pre_hooks = optimizer_pre_hooks
_post_hooks = optimizer_post_hooks
_MISSING = object()
_RECOMPILE_LIMIT: type[BaseException] = RecompileLimitHit


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


class StepCheck:
    """What a direct step checks before it runs the harvested entry, and what changed.

    Versions where a write has one: the optimizer's own ``__dict__``
    (``load_state_dict``, any attribute assigned) and each param group's dictionary (a
    hyperparameter written, ``params`` replaced); in one C call (:class:`Polled`), the
    ``state`` dictionary (a parameter's state added), each parameter's state (a tensor
    assigned by hand into ``opt.state[p]``) and the namespaces whose globals the update
    reads. The ``param_groups`` list's length (``add_param_group``), and each group's
    ``params`` list by identity (changed in place). Per step, what no write marks: the
    gradients, by Dynamo's ``TensorGuards`` (dtype, device, sizes, strides; a ``None``
    where a gradient was fails it; the backward gives a parameter's gradient its metadata),
    Dynamo's global state, and that Dynamo still knows the entry: the harvested
    :class:`~guardtrain.compile.direct.DirectEntry`'s own checks."""

    __slots__ = (
        "attributes",
        "direct",
        "groups",
        "lists",
        "mask",
        "params",
        "polled",
        "state_total",
        "states",
        "values",
        "versions",
    )

    def __init__(
        self, optimizer: torch.optim.Optimizer, direct: DirectEntry, namespaces: list[Any]
    ) -> None:
        self.direct = direct
        groups = optimizer.param_groups
        self.groups = groups
        self.versions = [_dict_version(g) for g in groups]
        self.values = [_hyperparameters(g) for g in groups]
        self.lists = [(g["params"], list(g["params"])) for g in groups]
        self.params = tuple(p for g in groups for p in g["params"])
        state = optimizer.state
        self.states = [state[p] for p in self.params if p in state]
        self.polled = Polled([state, *self.states, *namespaces])
        self.state_total = sum(map(_dict_version, [state, *self.states]))
        mask = [p.grad is None for p in self.params]
        self.mask = mask if any(mask) else None
        """Which gradients are ``None``, where some are (None: every one is a tensor)."""
        self.attributes = _dict_version(optimizer.__dict__)

    def change(self, optimizer: torch.optim.Optimizer) -> str | None:
        """What changed since the entry was harvested, or None (the step may run it)."""
        return self._structure_change(optimizer) or self._tensor_change()

    def _structure_change(self, optimizer: torch.optim.Optimizer) -> str | None:
        """The optimizer's attributes, groups, parameter lists and polled dicts."""
        if _dict_version(optimizer.__dict__) != self.attributes:
            if optimizer.param_groups is not self.groups:
                return "param_groups"
            return "state" if optimizer.state is not self.polled.dicts[0] else "attributes"
        groups, versions = self.groups, self.versions
        if len(groups) != len(versions):
            return "param_groups"
        for group, version in zip(groups, versions):
            if _dict_version(group) != version:
                return self._group_change()
        for now, then in self.lists:
            if not _same_items(now, then):
                return "params"
        if self.polled.moved():
            return self._moved()
        return None

    def _tensor_change(self) -> str | None:
        """The gradients' presence and metadata, the global state, the entry's life."""
        grads = list(map(_grad, self.params))
        direct, mask = self.direct, self.mask
        if mask is not None:
            if [g is None for g in grads] != mask:
                return "gradients None"
            grads = [g for g in grads if g is not None]
        # The parameters and their gradients in one call (a None fails it too).
        if not direct.tensors.check(*self.params, *grads):
            return "gradients None" if any(g is None for g in grads) else "tensor metadata"
        if not direct.global_state.check():
            return "global state"
        if live_codes is None or id(direct.code) not in live_codes:
            return "entry forgotten"  # Dynamo's reset()
        return None

    def same_values(self) -> bool:
        """Whether every group holds the values it held at the harvest, though written (a
        scheduler writing an unchanged lr): then its versions are taken as they are now,
        and the check goes on from them."""
        if [_hyperparameters(g) for g in self.groups] != self.values:
            return False
        self.versions = [_dict_version(g) for g in self.groups]
        return True

    def _group_change(self) -> str:
        """A group's dictionary was written: its ``params`` replaced, or a hyperparameter."""
        for group, (params, _) in zip(self.groups, self.lists):
            if group.get("params") is not params:
                return "params"
        return "hyperparameters"

    def _moved(self) -> str:
        """What a polled version says: a parameter's ``state`` written, or ``globals``."""
        states = self.polled.dicts[: len(self.states) + 1]
        return "state" if sum(map(_dict_version, states)) != self.state_total else "globals"


_PLAIN = (int, bool, str, type(None))


def _key(value: Any) -> Any:
    """A hyperparameter as the check compares it: a plain value (a float, int, bool, str,
    None, or a tuple of them: Adam's ``betas``) by type and value, a float's sign too (a
    ``-0.0`` for a ``0.0``). Anything else (a NaN, a tensor, a list that may have changed
    in place) gets a key of its own, equal to no other step's: a change."""
    kind = type(value)
    if kind is float and value == value:
        return (kind, value, math.copysign(1.0, value))
    if kind in _PLAIN:
        return (kind, value)
    if kind is tuple:
        return (kind, tuple(map(_key, value)))
    return object()


def _hyperparameters(group: dict[str, Any]) -> list[tuple[str, Any]]:
    """A param group's entries but ``params``, in order, by :func:`_key`."""
    return [(k, _key(v)) for k, v in group.items() if k != "params"]


def _same_items(now: list[Any], then: list[Any]) -> bool:
    """Whether a ``params`` list holds the same objects as its copy, by identity (a list's
    ``==`` would fall back to a tensor's own ``==``, which a one-element tensor answers
    True for another object)."""
    return len(now) == len(then) and all(map(operator.is_, now, then))


CompileHook = Callable[[str, "str | None"], None]
"""Told of each compile of a step: the optimizer's label and Dynamo's recompile reason."""


class CompiledStep:
    """One optimizer's step: compiled as one frame, direct while :class:`StepCheck` holds.

    Args:
        optimizer: the optimizer (see :func:`refusal`).
        compile_kwargs: the run's validated ``compile_kwargs`` (``fullgraph`` is set).
        on_compile: told of each compile (the run's compile count, H6).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        compile_kwargs: dict[str, Any],
        on_compile: CompileHook | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.name = type(optimizer).__name__
        self.on_compile = on_compile
        self.bound = types.MethodType(raw_step(optimizer), optimizer)
        self.trampoline = new_trampoline(shared=False)
        self.closure = (types.CellType(self.bound),)
        # A fresh options dict with the recording filter; a `mode` expanded into options.
        kwargs = build_compile_kwargs(compile_kwargs, self._record)
        kwargs["fullgraph"] = True
        self.compiled = torch.compile(
            trampoline_function(self.trampoline, self.closure, shared=False), **kwargs
        )
        self.recorded: list[tuple[bool, list[Any]]] = []
        """Per compile of this step: whether its guards read a plain value of the
        per-parameter state (:func:`reads_state_values`), and the namespaces whose globals
        they read."""
        self.values: dict[int, tuple[Any, bool, list[Any]]] = {}
        """``id(entry code)`` -> ``(that code, what its compile recorded)``: the code is
        compared by identity, as a forgotten code's id may be reused."""
        self.check: StepCheck | None = None
        self.eager: str | None = None
        """Why the step runs uncompiled for the rest of the run (Dynamo refused it)."""
        if any(group.get("fused") for group in optimizer.param_groups):
            # torch marks the fused update `torch.compiler.disable`: a graph break (plain
            # compile runs it eagerly too); it is one kernel already.
            self.eager = "fused=True: one fused kernel, which Dynamo does not trace"
        self.group_values: list[list[tuple[str, Any]]] = []
        """The groups' hyperparameters at the last step without a harvested entry."""
        self.direct_allowed = True
        """False: every step with full guards (the run's lookup window and audits; the
        bench's measure of what direct dispatch saves)."""
        self.full_steps = 0
        self.direct_steps = 0
        self.changes: collections.Counter[str] = collections.Counter()
        self.previous: Any = _MISSING  # the instance `step` install() replaced
        self.method: Any = None  # the one install() set

    def _record(self, guards: Sequence[Any]) -> list[bool]:
        """The guard filter: keeps every guard, records what the compile's guards assert of
        the groups and which namespaces' globals they read, and tells ``on_compile``."""
        keep = [True] * len(guards)
        scope = {"G": TRAMPOLINE_GLOBALS, CLOSURE_NAME: self.bound}
        found = polled_objects([tuple(kept_global_assertions(guards, keep))], scope)[0]
        self.recorded.append((reads_state_values(guards), found))
        if self.on_compile is not None:
            self.on_compile(f"{self.name}.step", compiling_frame()[1])
        return keep

    def entries(self) -> int:
        """Dynamo's cache entries for the step's frame."""
        return len(cache_entry_list(self.trampoline)) if cache_entry_list is not None else 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)``: the pre-hooks, the closure, the update (direct or
        with full guards), the profiler's step marker, the post-hooks."""
        opt = self.optimizer
        args: tuple[Any, ...] = (opt,)  # as torch's wrapper gives them to the hooks
        kwargs: dict[str, Any] = {} if closure is None else {"closure": closure}
        for pre_hook in (*_pre_hooks.values(), *getattr(opt, STEP_PRE_HOOKS).values()):
            result = pre_hook(opt, args, kwargs)
            if result is not None:  # as torch's wrapper: new (args, kwargs)
                args, kwargs = result
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        loss = None
        if closure is not None:  # as the optimizers' own step: first, with grad mode on
            with torch.enable_grad():
                loss = closure()
        # What an LR scheduler's own step wrapper records (its check before its step);
        # written once, before the check reads the optimizer's version.
        if opt.__dict__.get(STEP_CALLED) is not True:
            setattr(opt, STEP_CALLED, True)
        with torch.no_grad():
            self._update()
        getattr(opt, STEP_PROFILE)()
        for post_hook in (*getattr(opt, STEP_POST_HOOKS).values(), *_post_hooks.values()):
            post_hook(opt, args, kwargs)
        return loss

    def _update(self) -> None:
        if self.eager is not None:
            self.bound()
            return
        if not self.direct_allowed:  # a batch with full guards: what was harvested stays
            self._guarded()
            return
        check = self.check
        if check is not None:
            change = check.change(self.optimizer)
            if change == "hyperparameters" and check.same_values():
                change = check.change(self.optimizer)  # written, not changed: the rest
            if change is None:
                check.direct.fn()
                self.direct_steps += 1
                return
            self.changes[change] += 1
            if change != "hyperparameters":
                self._full()
                return
            self.check = None
        # No harvested entry, or hyperparameters changed (a scheduled lr): this step with
        # full guards, and a harvest only after a step whose values had not changed.
        values = [_hyperparameters(g) for g in self.optimizer.param_groups]
        moved = values != self.group_values
        if moved and check is None and self.group_values:
            self.changes["hyperparameters"] += 1  # changed again before a harvest
        self.group_values = values
        if self._guarded() and not moved:
            self._harvest()

    def _full(self) -> None:
        """A step with full guards (Dynamo may compile), then the entry it ran harvested."""
        self.check = None
        if self._guarded():
            self._harvest()

    def _scope(self) -> dict[str, Any]:
        """The step's frame locals, as its entries' guard managers read them."""
        return {"args": (), "kwargs": {}, CLOSURE_NAME: self.bound}

    def _values_of(self, code: Any) -> tuple[bool, list[Any]] | None:
        """What the compile of the entry whose code is ``code`` recorded, or None."""
        found = self.values.get(id(code))
        return None if found is None or found[0] is not code else (found[1], found[2])

    def _guarded(self) -> bool:
        """The update with full guards; False when Dynamo refused it (it then runs
        uncompiled from now on, as plain compile runs a frame past its limit). When it
        compiled, what the compile recorded is kept for its entry (the newest)."""
        self.recorded.clear()
        try:
            self.compiled()
        except (DynamoException, _RECOMPILE_LIMIT) as err:
            # A graph break, an unsupported op, the recompile limit: raised before any of
            # the update ran.
            self.eager = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            self.check = None
            self.bound()
            return False
        self.full_steps += 1
        if self.recorded and cache_entry_list is not None:
            code = cache_entry_list(self.trampoline)[0].code
            self.values[id(code)] = (code, *self.recorded[-1])
        return True

    def _harvest(self) -> None:
        """The entry Dynamo ran (the first whose guards accept the step, H30), held as any
        harvested entry is, with the step's :class:`StepCheck`."""
        if cache_entry_list is None or live_codes is None:
            return
        scope = self._scope()
        found = first_accepting(self.trampoline, scope)
        if found is None:
            return
        entry = found[0]
        recorded = self._values_of(entry.code)
        if recorded is None or recorded[0]:
            return  # what the entry's guards read is not all in the check: full guards
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        # The parameters' metadata too: the entry's guards check it (a `p.data = ...` of
        # another dtype, a requires_grad flip with its gradient kept).
        direct = DirectEntry(entry, self.closure, (), [*params, *grads], False, scope, [])
        self.check = StepCheck(opt, direct, recorded[1])

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
# reads the mark that CompiledStep.step sets; one made later keeps this step as it is.
setattr(_step, LR_SCHEDULER_WRAPPED, True)


def installed(optimizer: Any) -> CompiledStep | None:
    """The :class:`CompiledStep` that runs ``optimizer.step`` now, or ``None``."""
    return _INSTALLED.get(optimizer)


def installed_steps() -> list[CompiledStep]:
    """Every :class:`CompiledStep` installed now (what ``PROCESS.changed()`` lists)."""
    return list(_INSTALLED.values())


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
