"""The run's compiled optimizer steps (``compile_optimizer=True``, H49): install, restore,
and what ``summary()["optimizers"]`` shows.

The adapters hand the optimizers over when the run starts (``GuardTuner``'s
``optimizers``, the Trainer's own in Lightning); each gets a
:class:`~guardtrain.compile.optimizer.CompiledStep`, installed as the optimizer's
``step`` by :data:`~guardtrain.engine.process.PROCESS` (which lists it while installed)
and taken out when the run ends, also after an exception. Its compiles count as the
targets' do; in the batches that run with full guards (the lookup window's, audits) it
runs with full guards too, so the bottom line's saving holds the step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from guardtrain.compile.optimizer import CompiledStep, CompileHook, refusal
from guardtrain.engine.process import PROCESS
from guardtrain.errors import GuardTrainValueError

__all__ = ["OptimizerSteps"]


@dataclass(slots=True)
class OptimizerSteps:
    """The compiled steps an engine made, kept from run to run (their compiled code with
    them, as the targets', H28), and the ones installed now."""

    steps: list[CompiledStep] = field(default_factory=list)
    """Every optimizer's compiled step, in the order first given."""
    installed: list[CompiledStep] = field(default_factory=list)
    """Installed for the current run."""
    with_full_guards: bool = False
    """The installed steps run with full guards (the current batch is an audit's or a
    lookup window's)."""

    def install(
        self,
        optimizers: Iterable[Any],
        compile_kwargs: dict[str, Any],
        on_compile: CompileHook | None = None,
    ) -> None:
        """Compile each optimizer's step (or take the one an earlier run made) and install
        it; every optimizer is checked before any is installed.

        Raises:
            GuardTrainValueError: an optimizer that cannot be compiled (LBFGS, one with
                ``differentiable=True``, not a ``torch.optim.Optimizer``), or one given
                twice.
        """
        optimizers = list(optimizers)
        for i, opt in enumerate(optimizers):
            why = refusal(opt)
            if why is not None:
                raise GuardTrainValueError(
                    f"`compile_optimizer=True` cannot compile optimizer {i} ({why}): pass "
                    "`compile_optimizer=False`, or leave it out of `optimizers`."
                )
            if any(opt is other for other in optimizers[:i]):
                raise GuardTrainValueError(
                    f"`optimizers`: optimizer {i} ({type(opt).__name__}) is given twice."
                )
        for opt in optimizers:
            step = next((s for s in self.steps if s.optimizer is opt), None)
            if step is None:
                step = CompiledStep(opt, compile_kwargs)
                self.steps.append(step)
            step.on_compile = on_compile
            PROCESS.install_step(step)
            self.installed.append(step)

    def full_guards(self, on: bool) -> None:
        """Every installed step with full guards while ``on`` (a batch that runs with full
        guards: the lookup window's, an audit); :attr:`with_full_guards` says so."""
        self.with_full_guards = on and bool(self.installed)
        for step in self.installed:
            step.direct_allowed = not on

    def restore(self) -> None:
        """Each optimizer's own ``step`` back."""
        self.with_full_guards = False
        for step in self.installed:
            step.direct_allowed = True
            step.on_compile = None
            PROCESS.restore_step(step)
        self.installed.clear()

    def summary(self) -> list[dict[str, Any]]:
        """Per optimizer: its class, compiles, direct and full-guard steps, the changes
        that sent a step to full guards, why it ran eagerly."""
        return [step.summary() for step in self.steps]
