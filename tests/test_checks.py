"""The checks find and never act (``guardtrain/engine/findings.py``): fakes, no compile."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from guardtrain.compile import Miss, MissReason, grads
from guardtrain.engine import findings as checks
from guardtrain.engine.changes import Action, Change, Found, found_in, revalidate
from guardtrain.engine.findings import Checks
from guardtrain.fingerprints import fingerprint_change, module_fingerprint


def _target(module: nn.Module, free: bool = False, **overrides: Any) -> Any:
    """What the checks read of a compiled target; ``take_reference`` and
    ``forget_reference`` fail the test (a check must not act)."""

    def acted() -> None:
        raise AssertionError("a check changed the target")

    t = types.SimpleNamespace(
        calls=0,
        cache_entries=lambda: 1,
        reference=module_fingerprint(module),
        module=module,
        code=types.SimpleNamespace(install_free_tensors=free, pattern=grads.pattern(())),
        params=(),
        check_assertions=lambda: (None, None),
        take_reference=acted,
        forget_reference=acted,
        under_stance=True,
        last_failed=None,
        grads=None,
        tensor_attribute=None,
    )
    vars(t).update(overrides)
    return t


def _swapped(t: Any) -> Any:
    t.module.weight = nn.Parameter(t.module.weight.detach().clone())  # FSDP's swap
    return t


def test_a_swapped_parameter_rebuilds_but_under_fsdp_only_the_hooks_count() -> None:
    """Under a strategy that swaps parameters (FSDP) and without install_free_tensors, the
    check compares the fingerprint's hooks only (before a call and at a boundary alike)
    and leaves the fingerprint as it is; with no such strategy, or with
    install_free_tensors, a swapped parameter rebuilds."""
    plain = _swapped(_target(nn.Linear(2, 2)))
    replaced = "parameter 'weight' was replaced by another tensor object"
    assert revalidate(plain, True, None) == Found(Action.REBUILD, Change.PARAMETERS, replaced)
    for under_stance in (True, False):
        fsdp = _swapped(_target(nn.Linear(2, 2)))
        before = fsdp.reference
        assert revalidate(fsdp, under_stance, "accelerate's FSDP") is None
        assert fsdp.reference is before  # the check never acts on the target
    free = _swapped(_target(nn.Linear(2, 2), free=True))
    found = revalidate(free, True, "accelerate's FSDP")
    assert found is not None and found.action is Action.REBUILD
    hooked = _swapped(_target(nn.Linear(2, 2)))
    hooked.module.register_forward_hook(lambda *a: None)
    assert revalidate(hooked, True, "accelerate's FSDP") == Found(
        Action.REBUILD, Change.HOOKS, "a forward hook was added to '<root>'"
    )


def test_a_stale_assertion_rebuilds_and_an_unmatched_one_leaves_only_under_the_stance() -> None:
    stale = _target(nn.Linear(2, 2), check_assertions=lambda: ("x == 1", None))
    assert revalidate(stale, False, None) == Found(
        Action.REBUILD, Change.MODULE_STATE, "x == 1 (a guard that was dropped or skipped)"
    )
    unmatched = _target(nn.Linear(2, 2), check_assertions=lambda: (None, "self.p == 2"))
    assert revalidate(unmatched, True, None) == Found(
        Action.LEAVE, Change.MODULE_STATE, "self.p == 2"
    )
    assert revalidate(unmatched, False, None) is None
    assert revalidate(_target(nn.Linear(2, 2)), True, None) is None


def test_code_dynamo_skipped_is_found_once_per_target() -> None:
    """A called target without entries: Dynamo skipped its code (H18); rebuilt once."""
    ch = Checks()
    skipped = _target(nn.Linear(2, 2), calls=3, cache_entries=lambda: 0)
    assert ch.skipped_code(skipped, "lin") == Found(
        Action.REBUILD, Change.SKIPPED, "Dynamo skipped its code, it ran uncompiled"
    )
    assert ch.skipped == ["lin"]
    assert ch.skipped_code(skipped, "lin") is None
    assert ch.skipped_code(_target(nn.Linear(2, 2), calls=3), "other") is None


class HookProj(nn.Module):
    """A module whose parameter's name holds the word "hook"."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_proj = nn.Linear(2, 2)


def test_a_change_is_classified_by_what_moved_not_by_its_words() -> None:
    """A replaced parameter named ``hook_proj.weight`` is a parameter change; a hook added
    names the submodule whose hooks changed, as data."""
    module = HookProj()
    before = module_fingerprint(module)
    module.hook_proj.weight = nn.Parameter(torch.ones(2, 2))
    moved = fingerprint_change(before, module_fingerprint(module))
    assert moved is not None and (moved.row, moved.name) == ("parameter", "hook_proj.weight")
    found = found_in(moved)
    assert (found.kind, found.hooks_of) == (Change.PARAMETERS, None), found
    assert "hook_proj.weight" in found.detail
    before = module_fingerprint(module)
    module.hook_proj.register_forward_hook(lambda *a: None)
    hooked = found_in(fingerprint_change(before, module_fingerprint(module)))  # type: ignore[arg-type]
    assert (hooked.kind, hooked.hooks_of) == (Change.HOOKS, "hook_proj"), hooked
    before = module_fingerprint(module)
    module.register_forward_hook(lambda *a: None)
    own = found_in(fingerprint_change(before, module_fingerprint(module)))  # type: ignore[arg-type]
    assert (own.kind, own.hooks_of) == (Change.HOOKS, None), own  # the module's own hooks


def test_miss_names_the_kind_and_the_reason() -> None:
    kind, reason = checks.miss("lin", Miss(MissReason.UNSEEN_ARGUMENTS, "a new int"), None, False)
    assert kind is Change.ARGUMENTS and reason == "lin: a new int"
    kind, reason = checks.miss("lin", Miss(MissReason.WRITTEN, "g changed"), None, False)
    assert kind is Change.GLOBALS and reason.startswith("lin: g changed: no compiled entry")
    kind, reason = checks.miss("lin", Miss(MissReason.UNACCEPTED, ""), "(x: 4)", False)
    assert kind is None and reason.startswith("unseen batch signature (x: 4)")
    kind, reason = checks.miss("lin", Miss(MissReason.UNACCEPTED, ""), None, False)
    assert kind is None and reason.startswith("direct dispatch")
    kind, reason = checks.miss("lin", Miss(MissReason.MODE, "eval"), None, True)
    assert (
        kind is None
        and reason
        == "stance miss in 'lin': eval (here or on another rank: guard collectives share misses)"
    )


def test_audit_reason_names_the_last_compile() -> None:
    assert "(a new shape)" in checks.audit_reason([{"reason": "x"}, {"reason": "a new shape"}])
    assert "(unknown)" in checks.audit_reason([])
