"""Runs that hold modules: a new run releases one that is no longer live (H45).

A run *holds* the modules it compiled in place, from
:meth:`~guardtrain.engine.engine.GuardEngine.activate` until its ``restore()``. A run
that ends without its end event (KeyboardInterrupt inside a Hugging Face
``train()``, whose ``Trainer`` has no exception event) still holds them, its hooks
stay on the model and its Dynamo config stays set. When a new run starts (its
``setup()``) and again when it compiles its targets, each holder is asked whether its
run is still *live* (the adapter answers, through
:attr:`~guardtrain.engine.host.Host.live`):

* a holder that is not live is released through its own ``restore()`` (on any model:
  its config is process-wide), and its adapter removes what it put on the model; the
  new run starts fresh (:meth:`Runs.release_dead`);
* a live holder of a module the new run compiles (the same module, one inside it, or
  one around it) refuses the new run, naming both adapters and the module
  (:meth:`Runs.refuse_live`).

The registry holds its runs weakly: a run whose adapter and model are both gone is
forgotten with them. Blind spot: a live holder whose modules are all outside the new
run's root (the new root is inside the old one's target) is not seen; the forward
found compiled then still raises, in :func:`~guardtrain.compile.resolve.forward_function`.

>>> from torch import nn
>>> class Run:
...     owner = "GuardTuner"
...     def __init__(self, modules, live): self.modules, self.is_live = modules, live
...     def held_modules(self): return self.modules
...     def live(self): return self.is_live
...     def described(self): return "the model"
...     def release_dead(self): self.modules = []
>>> net = nn.Sequential(nn.Linear(2, 2))
>>> runs = Runs()
>>> dead = Run([net[0]], live=False)
>>> runs.hold(dead)
>>> runs.release_dead(Run([], True))
[('GuardTuner', 'the model')]
>>> dead.modules
[]
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterator, Protocol, Sequence

from torch import nn

from guardtrain.engine.host import Host
from guardtrain.errors import GuardTrainRuntimeError

__all__ = ["RUNS", "Holder", "Runs", "claim", "overlaps", "release_dead_runs"]


class Holder(Protocol):
    """A run as the registry sees it (each engine registers one for itself)."""

    @property
    def owner(self) -> str:
        """The adapter that runs it (``"GuardTrainerCallback"``)."""

    def held_modules(self) -> list[nn.Module]:
        """The modules it has compiled in place now."""

    def live(self) -> bool:
        """Whether its run is still going (its adapter's answer)."""

    def described(self) -> str:
        """What it holds, as its adapter names it (`` `model.transformer` ``)."""

    def release_dead(self) -> None:
        """Put back what the run changed and let its adapter remove its hooks."""


def overlaps(name: str, names: Sequence[str]) -> bool:
    """Whether the module ``name`` is one of ``names``, inside one, or around one.

    >>> overlaps("transformer.h.0", ["transformer"]), overlaps("lm_head", ["transformer"])
    (True, False)
    >>> overlaps("", ["lm_head"])
    True
    """
    for other in names:
        inner, outer = (name, other) if len(name) >= len(other) else (other, name)
        if outer == "" or inner == outer or inner.startswith(outer + "."):
            return True
    return False


class Runs:
    """The runs that hold modules now, in this process."""

    def __init__(self) -> None:
        self._runs: weakref.WeakSet[Holder] = weakref.WeakSet()

    def __iter__(self) -> Iterator[Holder]:
        return iter(list(self._runs))

    def hold(self, run: Holder) -> None:
        """``run`` has compiled modules in place (until :meth:`drop`)."""
        self._runs.add(run)

    def drop(self, run: Holder) -> None:
        """``run`` put its modules back."""
        self._runs.discard(run)

    def release_dead(self, run: Holder) -> list[tuple[str, str]]:
        """Release every other run that is not live (on any model: its config changes are
        process-wide). Returns each released run's adapter and what it held."""
        released: list[tuple[str, str]] = []
        for other in list(self._runs):
            if other is run or other.live():
                continue
            held = other.described()
            other.release_dead()
            self.drop(other)
            released.append((other.owner, held))
        return released

    def refuse_live(
        self,
        run: Holder,
        root: nn.Module,
        names: Sequence[str],
        owner: str,
        known_as: Callable[[str], str],
    ) -> None:
        """Before ``run`` compiles ``names`` in ``root``: refuse it when another run holds
        one of them, a module inside one, or one around one (after :meth:`release_dead`,
        every other run is live).

        Raises:
            GuardTrainRuntimeError: such a run exists (``owner`` and ``known_as`` name it).
        """
        where = {id(module): name for name, module in root.named_modules()}
        for other in list(self._runs):
            if other is run:
                continue
            held = [where[id(m)] for m in other.held_modules() if id(m) in where]
            clash = next((n for n in held if overlaps(n, names)), None)
            if clash is not None:
                raise GuardTrainRuntimeError(
                    f"{known_as(clash)} is compiled by a {other.owner} whose run is still "
                    f"going; {owner} cannot compile it too. Let that run finish first, or "
                    f"give this {owner} other `targets`."
                )


def release_dead_runs(run: Holder, host: Host) -> None:
    """:meth:`Runs.release_dead` on :data:`RUNS` for a run of ``host``'s adapter, with one
    warning per released run."""
    for owner, held in RUNS.release_dead(run):
        host.warn(
            f"guardtrain: a {owner} run that ended without its end event (an exception or "
            f"KeyboardInterrupt inside it) still held {held}. {host.owner} released it "
            "(its compiled forward and its hooks are removed) and starts afresh."
        )


def claim(run: Holder, root: nn.Module, names: Sequence[str], host: Host) -> None:
    """Before ``run`` compiles ``names`` in ``root``: release the runs that are not live,
    then refuse a live one that holds a module it compiles (:class:`Runs`)."""
    release_dead_runs(run, host)
    RUNS.refuse_live(run, root, names, host.owner, host.known_as)


RUNS = Runs()
"""The process's registry (each engine holds and drops itself)."""
