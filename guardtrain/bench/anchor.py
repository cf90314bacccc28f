"""The bench's anchor ``aot``: PyTorch's ``aot_compile().disable_guard_check()``, unsound.

What PyTorch itself offers for a call with no guards at all (the dispatch vLLM uses):
``torch.compile(fn, fullgraph=True).aot_compile(((module, *args), kwargs))`` traces ``fn``
(here the class's own ``forward``, unbound) in one graph; after ``disable_guard_check()``
the ``AOTCompiledFunction`` runs the compiled code with no guard evaluated and no Dynamo
entry path (``torch/_dynamo/aot_compile.py``: two attribute tests, then the compiled
bytecode, which reads the parameters off the module it is given and calls the graph).
Nothing is checked: the caller picks what to run. The bench picks by the kind of call: one
function compiled under ``no_grad`` for the ``no_grad`` calls, one in grad mode for the
training step, both in training mode (so after ``eval()`` the ``no_grad`` call still runs
the training graph, dropout on, as with ``floor``).

A model compiled whole is called through the function; for regional targets
(``blocks.*``) each block's ``_compiled_call_impl`` (what ``block.compile()`` sets) is the
function bound to that block, blocks of one structure
(:func:`~guardtrain.compile.code.structure_key` and equal scalar attributes) sharing one
function. The functions installed change only when the kind of call changes.

It cannot serve a model with a graph break (``aot_compile`` needs ``fullgraph=True``), a
backend whose output is not serializable, or a torch without ``aot_compile``: its row then
shows ``-`` and says why (``unavailable``); a training step it cannot compile is ``-``
with its own reason (``step_unavailable``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from guardtrain._torch import COMPILED_CALL
from guardtrain.bench.runner import Runner
from guardtrain.compile import resolve_targets
from guardtrain.compile.code import structure_key
from guardtrain.errors import GuardTrainValueError

__all__ = ["ANCHOR", "AotRunner", "anchor_missing"]

ANCHOR = "aot"
"""The anchor's configuration name."""


def anchor_missing() -> str | None:
    """Why this torch has no ``aot_compile().disable_guard_check()``, or None."""
    from torch._dynamo import config

    if not getattr(config, "enable_aot_compile", False):
        return f"torch {torch.__version__} has no torch.compile(...).aot_compile"
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
    except ImportError:  # pragma: no cover - depends on torch
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile"
    if not hasattr(AOTCompiledFunction, "disable_guard_check"):  # pragma: no cover
        return f"torch {torch.__version__} has no AOTCompiledFunction.disable_guard_check"
    return None


def _share_key(module: nn.Module) -> tuple[Any, ...]:
    """What two modules must have in common to run one compiled function with no guards:
    the structure, and every scalar attribute's value (a guard would tell those apart)."""
    scalars = tuple(
        (name, key, value)
        for name, sub in module.named_modules()
        for key, value in sorted(vars(sub).items())
        if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None)))
    )
    return (structure_key(module, type(module).forward), scalars)


def _example(value: Any) -> Any:
    """A tensor argument as an example input (a leaf with the same ``requires_grad``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def _why(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0][:160]
    if "graph break" in str(err).lower() or "fullgraph" in str(err).lower():
        return f"graph break (aot_compile needs fullgraph=True): {first}"
    return f"{type(err).__name__}: {first}"


class AotRunner(Runner):
    """The ``aot`` anchor: each target's ``forward`` compiled ahead of time, one function
    per kind of call, run with the guard check disabled."""

    def _compile(self, config: str, backend: str, kwargs: dict[str, Any]) -> None:
        self.unavailable = anchor_missing()
        self.kind: bool | None = None  # grad mode of the functions installed
        self.installed: dict[bool, list[tuple[nn.Module, Callable[..., Any]]]] = {}
        if self.unavailable is not None:
            return
        whole = self.model.targets == [""]
        targets = resolve_targets(self.module, self.model.targets)
        for grad in (False, True) if self.with_step else (False,):
            try:
                self.installed[grad] = self._compiled(targets, grad, backend)
            except Exception as err:  # any failure is the row's reason
                if not grad:
                    self.unavailable = _why(err)
                    self.installed.clear()
                    return
                self.step_unavailable = _why(err)
        if whole:
            self.whole = {grad: fns[0][1] for grad, fns in self.installed.items()}

    def _compiled(
        self, targets: list[tuple[str, nn.Module]], grad: bool, backend: str
    ) -> list[tuple[nn.Module, Callable[..., Any]]]:
        """Each target's function for one grad mode, bound to its target."""
        examples = self._examples([m for _, m in targets], grad)
        shared: dict[tuple[Any, ...], Any] = {}
        out: list[tuple[nn.Module, Callable[..., Any]]] = []
        for name, module in targets:
            key = _share_key(module)
            fn = shared.get(key)
            if fn is None:
                if id(module) not in examples:
                    raise GuardTrainValueError(f"target {name!r} was not called by the model")
                args, kwargs = examples[id(module)]
                compiled = torch.compile(type(module).forward, fullgraph=True, backend=backend)
                with torch.set_grad_enabled(grad):
                    fn = compiled.aot_compile(((module, *args), kwargs))  # type: ignore[attr-defined]
                fn.disable_guard_check()
                shared[key] = fn
                self.compiles += 1
            out.append((module, functools.partial(fn, module)))
        return out

    def _examples(
        self, targets: list[nn.Module], grad: bool
    ) -> dict[int, tuple[tuple[Any, ...], dict[str, Any]]]:
        """Each target's arguments in one eager call of the model in this grad mode."""
        if self.model.targets == [""]:
            return {id(targets[0]): (tuple(_example(a) for a in self.args), {})}
        seen: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ex = (tuple(_example(a) for a in args), {k: _example(v) for k, v in kwargs.items()})
            seen.setdefault(id(module), ex)

        hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in targets]
        try:
            with torch.set_grad_enabled(grad):
                self.module(*self.args)
        finally:
            for h in hooks:
                h.remove()
        return seen

    def _install(self, grad: bool) -> None:
        """The functions of one grad mode: the model's call, or each block's call."""
        self.kind = grad
        if self.model.targets == [""]:
            self.call = self.whole[grad]
            return
        for module, fn in self.installed[grad]:
            setattr(module, COMPILED_CALL, fn)

    def forward_no_grad(self) -> Any:
        if self.kind is not False:
            self._install(False)
        with torch.no_grad():
            return self.call(*self.args)

    def train_step(self) -> None:
        if self.kind is not True:
            self._install(True)
        super().train_step()

    def extra(self) -> dict[str, Any]:
        """The anchor's own facts: the functions compiled, and why it could not serve."""
        seen: dict[str, Any] = {"functions": self.compiles}
        if self.unavailable:
            seen["unavailable"] = self.unavailable
        if self.step_unavailable:
            seen["step_unavailable"] = self.step_unavailable
        return {"anchor": seen}

    def close(self) -> None:
        if self.model.targets != [""]:
            for module, _ in self.installed.get(False, []):
                setattr(module, COMPILED_CALL, None)
        self.installed = {}
        super().close()
