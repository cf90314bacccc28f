"""What a steady call compares before it runs: dictionary versions and list contents (H33).

Events (:mod:`guardtrain.compile.watch`) tell when a module changes. What no event
sees is *polled*, but only the few objects that a target's guards read outside its
modules, never one per module:

* the namespaces of the Python modules whose globals the frames read, and the
  ``__dict__`` of plain objects on a guard's path (a config object): a write gives a
  dictionary a new version;
* the real dictionaries of the classes that a class attribute read in ``forward``
  resolves through (``Net.GAIN = 2.0``: each class of the object's type up to the one
  that defines the name, so a subclass that starts to shadow it is seen too);
* lists that the guards read (``self.active`` whose items select the blocks that run,
  ``self.scales[0]``): lists have no version, so their length and items are compared
  with a snapshot (items by value for plain values, by identity for anything else).

:class:`Polled` builds one Dynamo guard tree over all of them
(``torch._C._dynamo.guards.RootGuardManager``: a dictionary-version guard per dictionary,
a length guard and a guard per item per list), so a call pays one call into C for
the lot, about 0.2 µs plus 0.02 µs per object (docs/bench.md). On a torch without that
tree the same comparisons run in Python.

Blind spots (caught at the next audit or loop boundary): a change inside an item of a
watched list that is itself a container, and lists that the guards do not read as
lists (a list reached through a tuple or a dict item).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["Polled"]

_PLAIN = (bool, int, float, str, type(None))
_guards = torch._C._dynamo.guards
_dict_version: Callable[[dict[Any, Any]], int] = _guards.dict_version
try:
    from torch._dynamo.guards import GuardManagerType

    _GUARD_MANAGER: Any = GuardManagerType.GUARD_MANAGER
except ImportError:  # pragma: no cover - another torch layout: the Python comparisons
    _GUARD_MANAGER = None


def _always(_: Any) -> bool:
    return True


class Polled:
    """The dictionaries and lists one target's guards read, compared per call (:meth:`moved`).

    Holds them as they were at the last :meth:`reset` (a compile or a check). A
    dictionary counts once however many guards read it.
    """

    __slots__ = ("_check", "_scope", "dicts", "lists")

    def __init__(
        self, dicts: Iterable[dict[Any, Any]] = (), lists: Iterable[list[Any]] = ()
    ) -> None:
        self.dicts: tuple[dict[Any, Any], ...] = ()
        self.lists: tuple[list[Any], ...] = ()
        self._check: Callable[[Any], bool] = _always
        self._scope: Any = None
        self.reset(dicts, lists)

    def reset(
        self,
        dicts: Iterable[dict[Any, Any]] | None = None,
        lists: Iterable[list[Any]] | None = None,
    ) -> None:
        """Remember the current state (of ``dicts`` and ``lists``, when given)."""
        if dicts is not None:
            self.dicts = tuple({id(d): d for d in dicts}.values())
        if lists is not None:
            self.lists = tuple({id(x): x for x in lists}.values())
        if not self.dicts and not self.lists:
            self._check, self._scope = _always, None
        elif _GUARD_MANAGER is not None and hasattr(_guards, "RootGuardManager"):
            self._check, self._scope = _tree(self.dicts, self.lists)
        else:  # pragma: no cover - another torch layout
            self._check, self._scope = _python(self.dicts, self.lists), None

    def moved(self) -> bool:
        """Whether a dictionary was written or a list changed since :meth:`reset`."""
        return not self._check(self._scope)

    def __len__(self) -> int:
        return len(self.dicts) + len(self.lists)


def _tree(
    dicts: tuple[dict[Any, Any], ...], lists: tuple[list[Any], ...]
) -> tuple[Callable[[Any], bool], dict[str, Any]]:
    """One guard tree over everything polled, and the scope it reads (names bound to the
    objects): ``tree.check(scope)`` is True while nothing moved."""
    root = _guards.RootGuardManager()
    scope: dict[str, Any] = {}
    for i, d in enumerate(dicts):
        name = f"d{i}"
        scope[name] = d
        node = root.dict_getitem_manager(
            key=name, source=name, example_value=d, guard_manager_enum=_GUARD_MANAGER
        )
        node.add_dict_version_guard(d, [f"dict_version({name})"], None)
    for i, items in enumerate(lists):
        name = f"l{i}"
        scope[name] = items
        node = root.dict_getitem_manager(
            key=name, source=name, example_value=items, guard_manager_enum=_GUARD_MANAGER
        )
        node.add_length_check_guard(len(items), [f"len({name}) == {len(items)}"], None)
        for j, item in enumerate(items):
            source = f"{name}[{j}]"
            child = node.list_getitem_manager(
                key=j, source=source, example_value=item, guard_manager_enum=_GUARD_MANAGER
            )
            if type(item) in _PLAIN:
                child.add_type_match_guard(id(type(item)), [f"type({source})"], None)
                child.add_equals_match_guard(item, [f"{source} == {item!r}"], None)
            else:
                child.add_id_match_guard(id(item), [f"{source} is the same object"], None)
    return root.check, scope


def _python(
    dicts: tuple[dict[Any, Any], ...], lists: tuple[list[Any], ...]
) -> Callable[[Any], bool]:
    """The same comparisons in Python (a torch without the guard tree)."""
    total = sum(map(_dict_version, dicts))
    snapshots = [
        (items, [(type(v), v if type(v) in _PLAIN else id(v)) for v in items]) for items in lists
    ]

    def unchanged(_: Any) -> bool:
        if sum(map(_dict_version, dicts)) != total:
            return False
        return all(
            [(type(v), v if type(v) in _PLAIN else id(v)) for v in items] == snap
            for items, snap in snapshots
        )

    return unchanged
