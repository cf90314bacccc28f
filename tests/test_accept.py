""":mod:`guardtrain.compile.accept` on its own: which entry the stance would run, whether
it accepts a call, and the verdicts of :func:`admit`, on fake cache entries.

Each fake guard manager answers from a predicate on the call's scope and counts its
evaluations, so a test sees both the verdict and whether guards were evaluated for it.
End to end, with Dynamo's entries: ``test_shapes.py`` (H26), ``test_midepoch.py`` (H32)
and ``test_alternating.py`` (H44).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from guardtrain.compile import accept
from guardtrain.compile.accept import (
    ACCEPT_LIMIT,
    ADMITTED,
    BROKEN,
    FULL_GUARDS,
    GUARD_SAMPLES,
    MISSED,
    accepting_entry,
    accepts,
    admit,
    remember_full_guards,
    stance_choice,
)
from guardtrain.compile.call_mode import call_key, masked, structure
from guardtrain.compile.known_states import Learnt

X = torch.randn(2, 3)
MODE = (True, True, False, False)
OTHER_MODE = (False, True, False, False)
Scope = dict[str, Any]


def _always(scope: Scope) -> bool:
    return True


def _never(scope: Scope) -> bool:
    return False


class Guards:
    """A guard manager (or its diff-guard root): ``check(scope)`` answers ``accept(scope)``."""

    def __init__(self, accept: Callable[[Scope], bool], name: str = "") -> None:
        self.accept, self.name = accept, name
        self.seen: list[Scope] = []

    def check(self, scope: Scope) -> bool:
        self.seen.append(scope)
        return self.accept(scope)


def _manager(
    full: Callable[[Scope], bool],
    diff: Callable[[Scope], bool] | None = None,
    sources: set[str] | None = None,
    name: str = "",
) -> Guards:
    manager = Guards(full, name)
    manager.diff_guard_root = None if diff is None else Guards(diff)  # type: ignore[attr-defined]
    manager.diff_guard_sources = sources  # type: ignore[attr-defined]
    return manager


def _whole() -> Any:
    """An entry's code that runs its call as one graph (:func:`~guardtrain.compile.direct.whole`)."""
    return SimpleNamespace(co_names=("__compiled_fn_1",))


def _entry(manager: Any, code: Any = None) -> SimpleNamespace:
    return SimpleNamespace(guard_manager=manager, code=code or _whole())


def _target(graph_breaks: bool = False) -> SimpleNamespace:
    """What accept.py reads and writes of a :class:`~guardtrain.compile.target_state.TargetState`."""
    return SimpleNamespace(
        code=SimpleNamespace(trampoline=object(), graph_breaks=graph_breaks),
        call_scope=lambda args, kwargs: {"args": args, "kwargs": kwargs},
        checks=0,
        guard_ns=[],
        learnt=Learnt(),
        last_key=None,
        last_mode=None,
    )


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The fake cache entries of every target's code, newest first (fill the list)."""
    entries: list[Any] = []
    monkeypatch.setattr(accept, "cache_entry_list", lambda code: entries)
    return entries


def _arg(n: int) -> Callable[[Scope], bool]:
    """Accepts calls whose second positional argument is ``n``."""
    return lambda scope: scope["args"][1] == n


def _evaluations(*managers: Guards) -> int:
    return sum(len(m.seen) for m in managers)


# -- stance_choice ----------------------------------------------------------------------------


def test_no_entry_list_on_this_torch_is_no_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accept, "cache_entry_list", None)
    assert stance_choice(_target(), (X,), {}) is None
    assert accepting_entry(_target(), (X,), {}) is None
    assert accepts(_target(), (X,), {}) is False


def test_the_stance_runs_the_first_entry_whose_diff_guards_pass(cache: list[Any]) -> None:
    skipped = _manager(_always, diff=_never, name="skipped")
    chosen = _manager(_always, diff=_always, name="chosen")
    later = _manager(_always, diff=_always, name="later")
    cache += [_entry(None), _entry(skipped), _entry(chosen), _entry(later)]
    target = _target()
    assert stance_choice(target, (X, 1), {"k": 2}) is chosen
    assert skipped.seen == []  # its diff guards failed: its full guards are not evaluated
    assert later.seen == []
    assert chosen.seen == [{"args": (X, 1), "kwargs": {"k": 2}}]  # the call's scope


def test_an_entry_without_diff_guards_is_the_stances_choice(cache: list[Any]) -> None:
    first = _manager(_always)
    cache += [_entry(first), _entry(_manager(_always, diff=_always))]
    assert stance_choice(_target(), (X,), {}) is first


def test_the_stances_choice_refusing_is_no_choice_though_another_accepts(
    cache: list[Any],
) -> None:
    """The stance would run the refusing entry (H26): a later accepting one is not its pick."""
    cache += [_entry(_manager(_never, diff=_always)), _entry(_manager(_always, diff=_always))]
    assert stance_choice(_target(), (X,), {}) is None


def test_no_diff_guards_passing_is_no_choice(cache: list[Any]) -> None:
    cache += [_entry(_manager(_always, diff=_never))]
    assert stance_choice(_target(), (X,), {}) is None


# -- accepts (H26) -------------------------------------------------------------------------------


def test_accepts_counts_only_accepted_calls(cache: list[Any]) -> None:
    cache += [_entry(_manager(_arg(1), diff=_always))]
    target = _target()
    assert accepts(target, (X, 1), {}) is True
    assert accepts(target, (X, 1), {}) is True
    assert target.checks == 2
    assert accepts(target, (X, 2), {}) is False
    assert target.checks == 2
    # Each accepted call's full guard check is timed (for the summary's estimate), the
    # refused one is not, and no more than GUARD_SAMPLES are kept.
    assert len(target.guard_ns) == 2 and all(ns >= 0 for ns in target.guard_ns)
    for _ in range(GUARD_SAMPLES + 3):
        accepts(target, (X, 1), {})
    assert len(target.guard_ns) == GUARD_SAMPLES


# -- accepting_entry ------------------------------------------------------------------------------


def test_accepting_entry_is_dynamos_choice_with_full_guards(cache: list[Any]) -> None:
    """In cache order, full guards only: the diff guards play no part."""
    refusing = _entry(_manager(_never, diff=_always))
    accepting = _entry(_manager(_always, diff=_never))
    later = _entry(_manager(_always, diff=_always))
    cache += [_entry(None), refusing, accepting, later]
    assert accepting_entry(_target(), (X,), {}) == (accepting, 4)
    assert later.guard_manager.seen == []


def test_accepting_entry_is_none_when_no_entry_accepts(cache: list[Any]) -> None:
    assert accepting_entry(_target(), (X,), {}) is None  # no entries
    cache += [_entry(_manager(_never)), _entry(None)]
    assert accepting_entry(_target(), (X,), {}) is None


# -- remember_full_guards (H44) --------------------------------------------------------------------


def test_full_guards_are_remembered_only_when_an_entry_accepts(cache: list[Any]) -> None:
    cache += [_entry(_manager(_arg(1)))]
    target = _target()
    assert remember_full_guards(target, MODE, ("k2",), (X, 2), {}) is False
    assert target.learnt.verdicts == {}
    assert remember_full_guards(target, MODE, ("k1",), (X, 1), {}) is True
    assert target.learnt.verdicts == {MODE: {("k1",): FULL_GUARDS}}


def test_remembered_full_guard_keys_start_again_past_the_limit(cache: list[Any]) -> None:
    cache += [_entry(_manager(_always))]
    target = _target()
    for i in range(ACCEPT_LIMIT):
        assert remember_full_guards(target, MODE, (i,), (X,), {})
    assert len(target.learnt.verdicts[MODE]) == ACCEPT_LIMIT
    assert remember_full_guards(target, MODE, ("new",), (X,), {})
    assert target.learnt.verdicts == {MODE: {("new",): FULL_GUARDS}}


# -- admit (H26, H32, H44) ----------------------------------------------------------------------------


def _key(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    found = call_key(args, kwargs)
    assert found is not None
    return found[0]


def _admit(target: SimpleNamespace, *args: Any, mode: Any = MODE) -> str:
    return admit(target, mode, _key(*args), args, {})


def test_a_key_the_stances_choice_accepts_is_admitted_and_remembered(cache: list[Any]) -> None:
    manager = _manager(_arg(1), diff=_always)
    cache += [_entry(manager)]
    target = _target()
    assert _admit(target, X, 1) == ADMITTED
    key = _key(X, 1)
    assert target.learnt.verdicts == {MODE: {key: ADMITTED}}
    assert (target.last_key, target.last_mode) == (key, MODE)
    assert _evaluations(manager) == 1
    assert _admit(target, X, 1) == ADMITTED  # remembered: no guard evaluated again
    assert _evaluations(manager) == 1


def test_a_key_whose_stance_entry_breaks_the_graph_runs_with_full_guards(
    cache: list[Any],
) -> None:
    """H4: a mixed target's call whose entry breaks the graph never runs under the stance,
    where a miss in a resumed frame would come after part of the call ran."""
    broken = SimpleNamespace(co_names=("__compiled_fn_1", "__resume_at_12_2"))
    cache += [_entry(_manager(_arg(1), diff=_always), code=broken)]
    target = _target(graph_breaks=True)
    assert _admit(target, X, 1) == FULL_GUARDS
    assert target.learnt.verdicts == {MODE: {_key(X, 1): BROKEN}}
    assert target.last_key is None
    cache[0] = _entry(_manager(_arg(1), diff=_always))  # an entry that runs whole
    assert _admit(_target(graph_breaks=True), X, 1) == ADMITTED


def test_keys_are_remembered_per_mode(cache: list[Any]) -> None:
    manager = _manager(_arg(1), diff=_always)
    cache += [_entry(manager)]
    target = _target()
    assert _admit(target, X, 1) == ADMITTED
    assert _admit(target, X, 1, mode=OTHER_MODE) == ADMITTED
    assert _evaluations(manager) == 2
    assert target.last_mode == OTHER_MODE


def test_a_plain_argument_no_entry_was_compiled_against_is_missed(cache: list[Any]) -> None:
    """H32: the stance does not check a plain argument, so without this check a call with a
    new value would run an entry compiled for the old one."""
    cache += [_entry(_manager(_arg(1), diff=_always))]
    target = _target()
    assert _admit(target, X, 1) == ADMITTED
    before = (target.last_key, target.last_mode)
    assert _admit(target, X, 2) == MISSED
    assert target.learnt.verdicts == {MODE: {_key(X, 1): ADMITTED}}  # nothing for a miss
    assert (target.last_key, target.last_mode) == before


def test_another_entry_accepting_runs_with_full_guards_and_is_remembered(
    cache: list[Any],
) -> None:
    """H44: the stance's choice refuses, a later entry (another autocast state) accepts."""
    stance_pick = _manager(_arg(1), diff=_always)
    other = _manager(_arg(2), diff=_always)
    cache += [_entry(stance_pick), _entry(other)]
    target = _target()
    assert _admit(target, X, 2) == FULL_GUARDS
    # Remembered, and not admitted under the stance.
    assert target.learnt.verdicts == {MODE: {_key(X, 2): FULL_GUARDS}}
    assert target.last_key is None
    seen = _evaluations(stance_pick, other)
    assert _admit(target, X, 2) == FULL_GUARDS  # remembered: no guard evaluated again
    assert _evaluations(stance_pick, other) == seen


@pytest.mark.parametrize(
    ("remembered", "expected"),
    [(ADMITTED, ADMITTED), (FULL_GUARDS, FULL_GUARDS), (BROKEN, FULL_GUARDS)],
)
def test_a_remembered_verdict_is_served_without_guards(
    cache: list[Any], remembered: str, expected: str
) -> None:
    """One verdict per call kind: what is remembered for a mode and key decides its calls,
    with no guard evaluated; the same key in another mode is evaluated afresh."""
    manager = _manager(_never, diff=_always)
    cache += [_entry(manager)]
    target = _target()
    target.learnt.verdicts[MODE] = {_key(X, 1): remembered}
    assert _admit(target, X, 1) == expected
    assert _evaluations(manager) == 0
    assert _admit(target, X, 1, mode=OTHER_MODE) == MISSED
    assert _evaluations(manager) > 0


def test_delegated_values_are_the_plain_values_in_the_diff_guards(cache: list[Any]) -> None:
    """A plain value whose source is a diff guard is checked by the stance itself (H32)."""
    sources = {"L['args'][0]", "L['args'][1]", "L['kwargs']['flag']"}
    cache += [_entry(_manager(_always, diff=_always, sources=sources))]
    target = _target()
    args, kwargs = (X, 3, "s"), {"flag": True}
    key = _key(*args, **kwargs)
    assert admit(target, MODE, key, args, kwargs) == ADMITTED
    # positions: 0 count, 1 the tensor (a source, but not a plain value), 2 the int,
    # 3 the str (no diff guard), 4 the keyword names, 5 the flag.
    assert target.learnt.delegated == {structure(key): frozenset({2, 5})}
    assert target.learnt.verdicts == {
        MODE: {key: ADMITTED, masked(key, frozenset({2, 5})): ADMITTED}
    }


def test_a_new_value_the_stance_checks_itself_is_admitted_without_guards(
    cache: list[Any],
) -> None:
    """An int that Dynamo made dynamic: its diff guards see each value, so a new one is
    admitted by its masked key, with no guard evaluated (H32)."""
    manager = _manager(_always, diff=_always, sources={"L['args'][1]"})
    cache += [_entry(manager)]
    target = _target()
    assert _admit(target, X, 3) == ADMITTED
    seen = _evaluations(manager)
    assert _admit(target, X, 4) == ADMITTED
    assert _evaluations(manager) == seen
    assert target.last_key == _key(X, 4)
    assert _key(X, 4) not in target.learnt.verdicts[MODE]  # its masked key stands for it
    assert _admit(target, X, 4.0) == ADMITTED  # another type: another structure
    assert _evaluations(manager) > seen


def test_a_new_value_the_stance_does_not_check_evaluates_the_guards(cache: list[Any]) -> None:
    manager = _manager(_always, diff=_always, sources=None)
    cache += [_entry(manager)]
    target = _target()
    assert _admit(target, X, 3) == ADMITTED
    assert target.learnt.delegated == {structure(_key(X, 3)): frozenset()}
    assert target.learnt.verdicts == {MODE: {_key(X, 3): ADMITTED}}  # no masked key
    seen = _evaluations(manager)
    assert _admit(target, X, 4) == ADMITTED
    assert _evaluations(manager) > seen


def test_delegated_positions_are_found_once_per_structure(cache: list[Any]) -> None:
    """The first admitted key of a structure fixes its delegated positions."""
    cache += [_entry(_manager(_always, diff=_always, sources={"L['args'][1]"}))]
    target = _target()
    assert _admit(target, X, 3) == ADMITTED
    cache[0].guard_manager.diff_guard_sources = set()
    assert _admit(target, X, 5) == ADMITTED
    assert target.learnt.delegated == {structure(_key(X, 3)): frozenset({2})}


def test_a_mode_past_the_limit_keeps_the_other_modes_verdicts(cache: list[Any]) -> None:
    """A key that changes on every call in one mode (a step counter in evaluation)
    empties that mode's table only."""
    cache += [_entry(_manager(_always, diff=_always))]
    target = _target()
    assert _admit(target, X, "train", mode=OTHER_MODE) == ADMITTED
    for i in range(ACCEPT_LIMIT + 1):
        assert _admit(target, X, i) == ADMITTED
    assert target.learnt.verdicts[OTHER_MODE] == {_key(X, "train"): ADMITTED}


def test_a_target_with_graph_breaks_admits_no_key_by_its_masked_key(cache: list[Any]) -> None:
    """A new value that the stance checks itself could pick another entry, one that breaks
    the graph (H4): on a target with graph breaks each new key is evaluated."""
    manager = _manager(_always, diff=_always, sources={"L['args'][1]"})
    cache += [_entry(manager)]
    target = _target(graph_breaks=True)
    assert _admit(target, X, 3) == ADMITTED
    seen = _evaluations(manager)
    assert _admit(target, X, 4) == ADMITTED
    assert _evaluations(manager) > seen
    assert target.learnt.verdicts == {MODE: {_key(X, 3): ADMITTED, _key(X, 4): ADMITTED}}


def test_admitted_keys_start_again_past_the_limit(cache: list[Any]) -> None:
    """Past :data:`ACCEPT_LIMIT` verdicts the table is emptied, masked keys with it."""
    manager = _manager(_always, diff=_always, sources={"L['args'][2]"})
    cache += [_entry(manager)]
    target = _target()
    for i in range(ACCEPT_LIMIT // 2):  # each admitted key and its masked key
        assert _admit(target, X, i, "a") == ADMITTED
    assert len(target.learnt.verdicts[MODE]) == ACCEPT_LIMIT
    assert _admit(target, X, "new", "a") == ADMITTED
    key = _key(X, "new", "a")
    assert target.learnt.verdicts == {MODE: {key: ADMITTED, masked(key, frozenset({3})): ADMITTED}}
