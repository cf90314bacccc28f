"""Everything guardtrain changes in the process, in one place, and how each is put back.

:data:`PROCESS` (a :class:`ProcessState`) is the one owner of the process state that
guardtrain changes (H11, H41, H45). Nothing else in guardtrain sets it, and every
piece is put back when the run that changed it ends, also after an exception:

* **Dynamo's config values** of a run, its **guard-collectives hook**, and its two
  **stance values**: one :class:`DynamoSettings` per run
  (:meth:`ProcessState.start_run`). The stance is never set for the process. The
  values are handed out prebuilt (:class:`~guardtrain.compile.stances.Stances`): a
  steady call assigns the unsafe one around its own compiled call and puts back what
  it found (:mod:`guardtrain.compile.forward`); a call that may trace sets
  ``install_free_tensors`` around itself where its target uses it
  (:func:`guardtrain.compile.forward.guarded`, H12). Both are put back in a
  ``finally`` of that call, so no value outlives it.
* **The change tracking's wrappers** on ``nn.Module``, ``RemovableHandle`` and
  ``nn.Parameter`` (H33, H34, H42): :mod:`guardtrain.compile.watch` puts them in with
  the first installed target and takes them out with the last.
* **Compiles taken over** from the framework (accelerate's dynamo plugin, H38):
  :meth:`ProcessState.take` records how each is given back, :meth:`ProcessState.give_back`
  gives it back. The Trainer callback holds it from the Trainer's init until its
  ``release()``, across the Trainer's runs; one whose owner is garbage-collected without
  it is given back then.
* **The runs that hold modules** (:data:`~guardtrain.engine.holders.RUNS`, H45).
* **Compiled optimizer steps** (``compile_optimizer=True``, H49): each installed as its
  optimizer's instance ``step`` (:meth:`ProcessState.install_step`) and put back when its
  run ends (:meth:`ProcessState.restore_step`).

:meth:`ProcessState.changed` lists what is changed now: once every run has ended and
every take-over is given back, it is empty.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from guardtrain._torch import STANCE, dynamo_config, eval_frame_state
from guardtrain._torch import stance_is_unsafe as _stance_is_unsafe
from guardtrain.compile import optimizer as _optimizer
from guardtrain.compile import watch as _watch
from guardtrain.compile.optimizer import CompiledStep
from guardtrain.compile.stances import Stances
from guardtrain.engine.holders import RUNS, Runs
from guardtrain.errors import GuardTrainRuntimeError

__all__ = ["PROCESS", "DynamoSettings", "ProcessState", "stance_is_unsafe"]


def stance_is_unsafe() -> bool:
    """Whether ``skip_guard_eval_unsafe`` is set in this process now."""
    return _stance_is_unsafe()


class DynamoSettings:
    """One run's Dynamo settings: its config values (saved, set, put back), its
    guard-collectives hook, and the stance values its steady calls write.

    Made by :meth:`ProcessState.start_run`.

    Args:
        owner: named in the error when the unsafe stance is already set.
    """

    def __init__(self, owner: str = "guardtrain") -> None:
        self.owner = owner
        self.active = False
        self.stances = Stances()
        """What the targets' steady calls write (:meth:`begin` sets them)."""
        self._saved_config: dict[str, Any] = {}
        self._written: dict[str, Any] = {}
        self._paused = False
        self._collectives_prev: bool | None = None

    def begin(self, values: dict[str, Any] | None = None) -> None:
        """Take the stance values from torch's stance now and set the config ``values``
        that differ; refuse to start under the unsafe stance (warm-up needs guards).

        Raises:
            GuardTrainRuntimeError: ``skip_guard_eval_unsafe`` is already set.
        """
        stance = eval_frame_state[STANCE]
        if stance.skip_guard_eval_unsafe:
            raise GuardTrainRuntimeError(
                "The unsafe stance (skip_guard_eval_unsafe=True) is already set when the run "
                f"starts; {self.owner} needs full guards while it warms up. Call "
                "torch.compiler.set_stance('default') before the run, or drop it."
            )
        self.stances = Stances.of(stance)
        self.active = True
        cfg = dynamo_config
        for key, value in (values or {}).items():
            if getattr(cfg, key, value) != value:
                self.set_config(key, value)

    def set_config(self, key: str, value: Any) -> None:
        """Set Dynamo's config ``<key>`` for the run (saved the first time)."""
        cfg = dynamo_config
        if key not in self._saved_config:
            self._saved_config[key] = getattr(cfg, key)
        self._written[key] = value
        if not self._paused:
            setattr(cfg, key, value)

    def pause(self) -> None:
        """Put the config values back until :meth:`resume` (a bench that runs several
        configurations in one process sets each one's only while it runs)."""
        if self._paused:
            return
        self._paused = True
        cfg = dynamo_config
        for key, value in self._saved_config.items():
            setattr(cfg, key, value)

    def resume(self) -> None:
        """Set the run's config values again after :meth:`pause`."""
        if not self._paused:
            return
        self._paused = False
        cfg = dynamo_config
        for key, value in self._written.items():
            setattr(cfg, key, value)

    def set_guard_collectives(self, on: bool) -> None:
        """Dynamo's per-call guard collective (H7); the caller toggles it where every rank is."""
        if on == (self._collectives_prev is not None):
            return
        if on:
            self._collectives_prev = torch.compiler.set_enable_guard_collectives(True)
        else:
            torch.compiler.set_enable_guard_collectives(bool(self._collectives_prev))
            self._collectives_prev = None

    def changed(self) -> list[str]:
        """What this run has set now."""
        found = [] if self._paused else [f"Dynamo's config {k}" for k in self._saved_config]
        if self._collectives_prev is not None:
            found.append("guard collectives")
        return found

    def restore(self) -> None:
        """Put back the config values and the guard-collectives hook."""
        self.set_guard_collectives(False)
        self.pause()
        self._saved_config, self._written = {}, {}
        self._paused = False
        self.active = False


class ProcessState:
    """The one owner of what guardtrain changes in the process (see the module's docstring)."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs
        """The runs that hold modules (H45)."""
        self._settings: weakref.WeakSet[DynamoSettings] = weakref.WeakSet()
        self._taken: weakref.WeakKeyDictionary[Any, tuple[str, weakref.finalize[..., Any]]] = (
            weakref.WeakKeyDictionary()
        )

    def start_run(self, owner: str) -> DynamoSettings:
        """The Dynamo settings of a new run, named for its adapter ``owner``."""
        settings = DynamoSettings(owner)
        self._settings.add(settings)
        return settings

    def take(self, key: Any, what: str, give_back: Callable[[], None]) -> None:
        """Record a compile taken over from the framework by ``key`` (the adapter's object,
        held weakly): ``what`` names it, ``give_back`` puts it back (:meth:`give_back`), at
        the latest when ``key`` is garbage-collected (an adapter dropped without its
        ``release()``). ``give_back`` must not hold ``key``, or it would never be collected."""
        replaced = self._taken.pop(key, None)
        if replaced is not None:
            replaced[1].detach()  # a second take by the same key replaces the first
        done = weakref.finalize(key, give_back)
        done.atexit = False  # the process ends: nothing is left to put back for
        self._taken[key] = (what, done)

    def give_back(self, key: Any) -> None:
        """Give back what :meth:`take` recorded for ``key`` (nothing if none, or if it was
        given back already)."""
        found = self._taken.pop(key, None)
        if found is not None:
            found[1]()  # a finalizer runs once: not again when ``key`` is collected

    def install_step(self, step: CompiledStep) -> None:
        """Install a compiled optimizer step as its optimizer's ``step`` (H49)."""
        _optimizer.install(step)

    def restore_step(self, step: CompiledStep) -> None:
        """Put back the optimizer's own ``step`` (or what was there before)."""
        _optimizer.uninstall(step)

    def changed(self) -> list[str]:
        """Everything guardtrain has changed in the process now, by name: empty once every
        run has ended and every take-over is given back."""
        found = [
            f"{item} ({settings.owner}'s run)"
            for settings in list(self._settings)
            for item in settings.changed()
        ]
        if stance_is_unsafe():
            found.append("the unsafe stance")
        if _watch.patched():
            found.append("the change tracking's wrappers on nn.Module and nn.Parameter")
        found.extend(what for what, _ in self._taken.values())
        found.extend(
            f"the compiled step of a {step.name} (compile_optimizer=True)"
            for step in _optimizer.installed_steps()
        )
        found.extend(f"a run of {held.owner} holds {held.described()}" for held in self.runs)
        return found


PROCESS = ProcessState(RUNS)
"""The process's one :class:`ProcessState`."""
