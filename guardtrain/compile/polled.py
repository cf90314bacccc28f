"""What a steady call compares before it runs: dictionary versions and list contents (H33).

Events (:mod:`guardtrain.compile.watch`) tell when a module changes. What no event
sees is *polled*, but only the few objects that a target's guards read outside its
modules, never one per module:

* the namespaces of the Python modules whose globals the frames read, and the
  ``__dict__`` of plain objects on a guard's path (a config object): a write gives a
  dictionary a new version from one counter that only grows;
* the real dictionaries of the classes that a class attribute read in ``forward``
  resolves through (``Net.GAIN = 2.0``: each class of the object's type up to the one
  that defines the name, so a subclass that starts to shadow it is seen too);
* lists that the guards read (``self.active``, whose items select the blocks that run;
  ``self.scales[0]``): lists have no version, so each is compared with a copy. A list
  of plain values (bool, int, float, str, None) is compared by equality (one ``==`` in
  C, items by identity first, then by value); any other list item by identity.

Per call the dictionaries' versions are compared with those at the last reset: with
three or more, or with a list of plain values, by one Dynamo guard tree built for them
(Dynamo's C++ ``RootGuardManager`` with a dictionary-version guard on each dictionary
and an equality guard on each list of plain values against its copy, one call into
C); with fewer dictionaries and no such list, by the sum of their versions (one pass
in C; a write only ever raises a version). Then each other list, by identity. docs/bench.md
has the measurements.

Blind spots (caught at the next audit or loop boundary): a change inside an item of a
watched list that is itself a container; an item of a list of plain values replaced
by an equal value of another type (``1`` for ``1.0``); lists that the guards do not
read as lists (a list reached through a tuple or a dict item).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

from guardtrain._torch import GuardManagerType, guards

__all__ = ["Polled"]

_guards = guards
_dict_version: Callable[[dict[Any, Any]], int] = _guards.dict_version
_TREE_FROM = 3
"""From this many dictionaries on, one guard tree checks them (cheaper than the sum)."""
_GUARD_MANAGER: Any = GuardManagerType.GUARD_MANAGER
_is_not = operator.is_not
_PLAIN = (bool, int, float, str, type(None))


class Polled:
    """The dictionaries and lists one target's guards read, compared per call (:meth:`moved`).

    Holds them as they were at the last :meth:`reset` (a compile or a check). A
    dictionary or list counts once however many guards read it.
    """

    __slots__ = ("_scope", "_unchanged", "dicts", "lists", "snapshots", "total")

    def __init__(
        self, dicts: Iterable[dict[Any, Any]] = (), lists: Iterable[list[Any]] = ()
    ) -> None:
        self.dicts: tuple[dict[Any, Any], ...] = ()
        self.lists: tuple[list[Any], ...] = ()
        self.snapshots: tuple[tuple[list[Any], list[Any]], ...] = ()
        self.total = 0
        self._unchanged: Callable[[Any], bool] | None = None
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
        self.total = sum(map(_dict_version, self.dicts))
        self._unchanged, self._scope = None, None
        plain: list[tuple[list[Any], list[Any]]] = []
        others: list[tuple[list[Any], list[Any]]] = []
        for items in self.lists:
            (plain if all(type(v) in _PLAIN for v in items) else others).append(
                (items, list(items))
            )
        if _GUARD_MANAGER is not None and (len(self.dicts) >= _TREE_FROM or plain):
            self._unchanged, self._scope = _version_tree(self.dicts, plain)
        else:
            # Without a tree a list of plain values is compared by identity too: an equal
            # value that is another object says moved, and a check follows.
            others = plain + others
        self.snapshots = tuple(others)

    def successor(self) -> Polled:
        """A new :class:`Polled` over the same objects, not yet taken: it says moved until
        its :meth:`reset` (this one is kept as it is, :mod:`guardtrain.compile.known_states`)."""
        new = Polled()
        new.dicts, new.lists, new.total = self.dicts, self.lists, -1
        return new

    def moved(self) -> bool:
        """Whether a dictionary was written or a list changed since :meth:`reset`."""
        unchanged = self._unchanged
        if unchanged is not None:
            if not unchanged(self._scope):
                return True
        elif sum(map(_dict_version, self.dicts)) != self.total:
            return True
        for items, snapshot in self.snapshots:
            if len(items) != len(snapshot) or any(map(_is_not, items, snapshot)):
                return True
        return False

    def __len__(self) -> int:
        return len(self.dicts) + len(self.lists)


def _version_tree(
    dicts: tuple[dict[Any, Any], ...], lists: list[tuple[list[Any], list[Any]]]
) -> tuple[Callable[[Any], bool], Any]:
    """One Dynamo guard tree over ``dicts`` (a dictionary-version guard each, on the items
    of one tuple) and ``lists`` (``(list, its copy)``: an equality guard each, one ``==``
    in C, items by identity first, then by value) and the scope it reads:
    ``check(scope)`` is True while no dictionary was written and every list equals its
    copy."""
    root = _guards.RootGuardManager()
    live = tuple(items for items, _ in lists)
    scope: dict[str, Any] = {"d": dicts, "l": live}
    for i, node in enumerate(_items(root, "d", dicts)):
        node.add_dict_version_guard(dicts[i], [f"dict_version(d[{i}])"], None)
    for i, node in enumerate(_items(root, "l", live)):
        node.add_equals_match_guard(lists[i][1], [f"l[{i}] == copy"], None)
    return root.check, scope


def _items(root: Any, name: str, values: tuple[Any, ...]) -> list[Any]:
    """The guard managers of the items of the tuple ``scope[name]`` (``values``)."""
    node = root.dict_getitem_manager(
        key=name, source=name, example_value=values, guard_manager_enum=_GUARD_MANAGER
    )
    return [
        node.tuple_getitem_manager(
            key=i, source=f"{name}[{i}]", example_value=v, guard_manager_enum=_GUARD_MANAGER
        )
        for i, v in enumerate(values)
    ]
