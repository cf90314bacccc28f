"""Guards that guardtrain checks itself instead of Dynamo's per-frame guards (H31).

``aggressive`` (and ``turbo``, where it exists) drops identity guards on global
modules, functions and builtins, and the saved-tensor-hooks guard. Each moved
check must still catch its change:

* a global function, builtin or module swapped between epochs is caught at the
  boundary, one swapped inside an epoch at the next audit (target rebuilt, eager-
  equal from then on); value guards on global scalars stay per frame;
* saved-tensor hooks entered inside the training step, under the stance, give
  eager-equal results; hooks that Dynamo inlines (``fx.GraphModule`` pack and
  unpack) make the target keep their guard and recompile.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import lightning as L
import pytest
import torch
from helpers import EAGER, TinyModule, compare, fit, guard, guard_without_lookup
from torch import nn

from guardtrain import PRESETS, filters
from guardtrain.compile import CompiledTarget

#: The presets that drop the rechecked guards (``turbo`` once it exists).
MOVED = [p for p in ("aggressive", "turbo") if p in PRESETS]
CHANGE_AT = 10
GAIN = 1.0  # a global scalar: its value guard stays per frame


def act(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def act_swapped(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2.0


BUILTIN = torch.tanh
ops: Any = torch.nn.functional
_shim = types.ModuleType("shim")
_shim.tanh = lambda x: torch.tanh(x) * 2.0  # type: ignore[attr-defined]

#: what -> (global name, original, replacement)
SWAPS: dict[str, tuple[str, Any, Any]] = {
    "function": ("act", act, act_swapped),
    "builtin": ("BUILTIN", torch.tanh, torch.sigmoid),
    "module": ("ops", torch.nn.functional, _shim),
}


def _set(name: str, value: Any) -> None:
    globals()[name] = value


class Swapping(L.LightningModule):
    """Calls the three globals of :data:`SWAPS` in ``forward``; checks every compiled
    output against the plain ``forward`` on the same input (no dropout, no BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.matches: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = act(self.inp(x))
        h = BUILTIN(h) + ops.tanh(h)
        return self.out(h) * GAIN

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        with torch.no_grad():
            ref = type(self).forward(self, x)
        self.matches.append(torch.equal(out.detach(), ref))
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SwapAtStep(L.Callback):
    def __init__(self, what: str, at: int) -> None:
        self.name, self.old, self.new = SWAPS[what]
        self.at = at

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        _set(self.name, self.new if trainer.global_step >= self.at else self.old)


class SwapAtEpoch(L.Callback):
    def __init__(self, what: str, epoch: int) -> None:
        self.name, self.old, self.new = SWAPS[what]
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        _set(self.name, self.new if trainer.current_epoch >= self.epoch else self.old)


@pytest.fixture(autouse=True)
def _restore_globals() -> Any:
    saved = {name: old for name, old, _ in SWAPS.values()}
    yield
    for name, old in saved.items():
        _set(name, old)


def stale_steps(model: Swapping) -> list[int]:
    return [i for i, ok in enumerate(model.matches) if not ok]


def rearm_reasons(cb: Any) -> list[str]:
    return [r["reason"] for r in cb.summary()["rearms"]]


# -- what the filter moves, and what it records ----------------------------------------------


def _compiled_with_spy() -> tuple[CompiledTarget, list[tuple[Any, bool]]]:
    """A :class:`Swapping` target compiled once with aggressive's filter (floor added),
    and every guard entry the filter saw with its keep decision."""
    flt = filters.with_floor(filters.resolve(PRESETS["aggressive"].guard_filter))
    seen: list[tuple[Any, bool]] = []

    def spy(entries: Any) -> list[bool]:
        keep = flt(entries)
        seen.extend(zip(entries, keep))
        return keep

    model = Swapping()
    target = CompiledTarget(
        "", model, EAGER, spy, True, on_compile=lambda *a: None, on_miss=lambda *a: True
    )
    with torch.no_grad():
        model(torch.randn(4, 8))
    return target, seen


def test_the_filter_drops_global_identity_and_hooks_guards_and_records_them() -> None:
    target, seen = _compiled_with_spy()
    by_type = {(e.guard_type, e.name): k for e, k in seen}
    # Identity guards on globals: dropped by the filter ...
    moved = [(t, n) for (t, n), k in by_type.items() if n.startswith("G[") and not k]
    assert {t for t, _ in moved} >= {"MODULE_MATCH", "CLOSURE_MATCH"}, moved
    # ... and recorded for the boundary re-check, named as the user knows them.
    labels = {a.label for entry in target.code.assertions for a in entry if a.glob}
    assert "test_global_guards.act.__code__" in labels, labels
    assert {"test_global_guards.BUILTIN", "test_global_guards.ops"} <= labels, labels
    # The value of a global scalar stays per frame (H19); so do the floor's guards.
    assert by_type[("CONSTANT_MATCH", "G['__import_test_global_guards'].GAIN")] is True
    assert by_type[("GLOBAL_STATE", "")] is True
    # The saved-tensor-hooks guard is checked per call by the wrapper instead.
    assert by_type[("AUTOGRAD_SAVED_TENSORS_HOOKS", "")] is False
    assert target.check_assertions() == (None, None)
    _set("act", act_swapped)
    stale, _ = target.check_assertions()
    assert stale == "test_global_guards.act.__code__: identity changed", stale
    assert target.check_assertions(globals_too=False) == (None, None)


def test_balanced_keeps_its_global_guards() -> None:
    """Only the filter of ``aggressive`` (``skip_all_nn_modules``) moves them."""
    flt = filters.with_floor(filters.resolve(PRESETS["balanced"].guard_filter))
    kept: list[tuple[str, bool]] = []

    def spy(entries: Any) -> list[bool]:
        keep = flt(entries)
        kept.extend((e.guard_type, k) for e, k in zip(entries, keep) if e.name.startswith("G["))
        return keep

    torch.compile(Swapping(), backend="eager", options={"guard_filter_fn": spy})(torch.randn(2, 8))
    assert kept and all(k for _, k in kept), kept


# -- a swapped global is caught --------------------------------------------------------------


def run(preset: str, swap: L.Callback, **kwargs: Any) -> tuple[Swapping, Any]:
    model = Swapping()
    cb = guard_without_lookup(preset, targets=[""], **kwargs)
    fit(model, [cb, swap], data={"n_train": 16 * 15}, max_epochs=2, limit_val_batches=0)
    return model, cb


@pytest.mark.parametrize("what", list(SWAPS))
@pytest.mark.parametrize("preset", MOVED)
def test_a_global_swapped_between_epochs_is_caught_at_the_boundary(preset: str, what: str) -> None:
    model, cb = run(preset, SwapAtEpoch(what, epoch=1), audit_every=None)
    assert cb.summary()["steady_steps"] > 10
    assert stale_steps(model) == [], stale_steps(model)
    name = SWAPS[what][0]
    assert any(
        f"test_global_guards.{name}" in r and "(a guard that was dropped or skipped)" in r
        for r in rearm_reasons(cb)
    ), rearm_reasons(cb)


@pytest.mark.parametrize("what", list(SWAPS))
@pytest.mark.parametrize("preset", MOVED)
def test_a_global_swapped_inside_an_epoch_is_caught_before_the_next_call(
    preset: str, what: str
) -> None:
    """Swapped at step 10 under the stance, no audit: the namespace's version moved, so the
    next call re-checks the global and rebuilds (H33). Every output equals eager."""
    model, cb = run(preset, SwapAtStep(what, CHANGE_AT), audit_every=None)
    assert stale_steps(model) == [], stale_steps(model)
    name = SWAPS[what][0]
    assert any(f"test_global_guards.{name}" in r for r in rearm_reasons(cb)), rearm_reasons(cb)
    assert cb.summary()["caught_changes"]["globals"]["count"] >= 1


@pytest.mark.parametrize("preset", MOVED)
def test_without_the_recheck_a_swapped_global_stays_stale(
    preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the re-check is for: with it switched off, nothing notices the swap."""
    monkeypatch.setattr(
        CompiledTarget, "check_assertions", lambda self, globals_too=True: (None, None)
    )
    model, _ = run(preset, SwapAtEpoch("function", epoch=1), audit_every=None)
    assert stale_steps(model) == list(range(15, 30)), stale_steps(model)


def test_a_global_scalar_still_recompiles_in_warm_up() -> None:
    """Its value guard stays per frame: changed during warm-up, the next call recompiles."""

    class SetGain(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            _set("GAIN", 2.0 if trainer.global_step >= 1 else 1.0)

    try:
        model, cb = run("aggressive", SetGain(), audit_every=None, warmup_steps=5)
    finally:
        _set("GAIN", 1.0)
    assert stale_steps(model) == []
    assert any("GAIN" in (e["reason"] or "") for e in cb.summary()["compile_events"])


# -- saved-tensor hooks: a per-call check ----------------------------------------------------

PACKED: list[int] = []


def pack(t: torch.Tensor) -> torch.Tensor:
    PACKED.append(t.numel())
    return t * 3.0  # with `unpack`, saved tensors come back 1.5x: observable in gradients


def unpack(t: torch.Tensor) -> torch.Tensor:
    return t / 2.0


class _Times3(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t * 3.0


class _Half(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t / 2.0


_GRAPH_PACK = torch.fx.symbolic_trace(_Times3())
_GRAPH_UNPACK = torch.fx.symbolic_trace(_Half())


def graph_hooks() -> Any:
    """A pack/unpack pair of ``fx.GraphModule``s: the kind Dynamo inlines into the graph
    (its guard compares their ids, so the pair is made once)."""
    return torch.autograd.graph.saved_tensors_hooks(_GRAPH_PACK, _GRAPH_UNPACK)


HOOKS = {
    "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(),
    "python": lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack),
    "graph": graph_hooks,
}


class Hooked(TinyModule):
    """Enters saved-tensor hooks inside ``training_step``, from step ``start`` on."""

    def __init__(self, hooks: str, start: int = 0, stop: int = 1 << 30) -> None:
        super().__init__()
        self.hooks, self.start, self.stop = hooks, start, stop

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.start <= self.trainer.global_step < self.stop:
            with HOOKS[self.hooks]():
                return super().training_step(batch, batch_idx)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("hooks", ["save_on_cpu", "python"])
@pytest.mark.parametrize("preset", MOVED)
def test_hooks_dynamo_runs_at_run_time_need_no_recompile(preset: str, hooks: str) -> None:
    """``save_on_cpu()`` or a Python pair entered inside every step, also under the stance:
    every entry serves them (Dynamo's guard reads them as no hooks), eager-equal."""
    PACKED.clear()
    cb, _ = compare(lambda: Hooked(hooks), lambda: guard(preset))
    s = cb.summary()
    assert s["steady_steps"] > 0
    # No compile and no re-arm for the hooks (only for modes and the short last batch).
    texts = [e["reason"] or "" for e in s["compile_events"]] + [r["reason"] for r in s["rearms"]]
    assert not any("hooks" in t.lower() for t in texts), texts
    assert not any(t.code.keep_hooks_guard for t in cb._engine.targets.kept)
    if hooks == "python":
        assert PACKED  # the hooks ran in the compiled steps


@pytest.mark.parametrize("preset", MOVED)
def test_hooks_dynamo_inlines_keep_their_guard_from_then_on(preset: str) -> None:
    """Graph hooks entered at step 16 (under the stance) and left at step 19: the call at
    16 leaves the stance, the target keeps the hooks guard from then on and is rebuilt;
    at 19 that guard, evaluated under the stance, fails (a miss, retried with full
    guards), and the call compiles without hooks. Every step is eager-equal."""
    cb, _ = compare(lambda: Hooked("graph", start=16, stop=19), lambda: guard(preset))
    s = cb.summary()
    rearms = {r["step"]: r["reason"] for r in s["rearms"]}
    assert "saved-tensor hooks that Dynamo inlines are active" in rearms[16], rearms
    if cb.settings.direct_dispatch:
        # Turbo evaluates the entries' guards before it runs one directly: the hooks
        # guard rejects the only entry, so the call leaves the stance without a miss.
        assert "direct dispatch: no compiled entry" in rearms[19], rearms
    else:
        assert "stance miss" in rearms[19], rearms
    events = {e["step"]: e["reason"] or "" for e in s["compile_events"]}
    assert events[16] == "first compile" and "top_saved_tensors_hooks" in events[19], events
    assert all(t.code.keep_hooks_guard for t in cb._engine.targets.kept)
    assert s["steady_steps"] > 0


def test_hooks_check_per_call_on_a_target() -> None:
    """Both directions on one target: compiled without hooks and called under graph hooks
    (rebuilt, keeps the guard), then called without them (the guard picks the entry)."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref.load_state_dict(net.state_dict())
    misses: list[str] = []
    flt = filters.with_floor(filters.resolve("skip_all_nn_modules"))
    target = CompiledTarget(
        "",
        net,
        EAGER,
        flt,
        True,
        on_compile=lambda *a: None,
        on_miss=lambda t, why: bool(misses.append(why)) or True,
    )
    x = torch.randn(3, 4)

    def grads(m: nn.Module, ctx: Any) -> list[torch.Tensor]:
        m.zero_grad()
        with ctx():
            out = m(x).sum()
        out.backward()
        return [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]

    for ctx in (contextlib.nullcontext, graph_hooks, contextlib.nullcontext, graph_hooks):
        assert all(torch.equal(a, b) for a, b in zip(grads(net, ctx), grads(ref, ctx)))
    assert target.code.keep_hooks_guard
    assert target.code.compiles == 3  # without hooks, rebuilt under hooks, without hooks again


def _replace(name: str, scope: dict[str, Any]) -> Any:
    """Replace what the global guard source ``name`` reads with another object; return
    an undo function. A function's ``__code__`` is changed by replacing the function."""
    if name.endswith(".__code__"):
        name = name[: -len(".__code__")]
    current = eval(name, {}, scope)
    if isinstance(current, dict):
        other: Any = dict(current)  # another type for a TYPE_MATCH on an OrderedDict
    else:
        other = types.ModuleType("other") if isinstance(current, types.ModuleType) else object()
    if name.endswith("']"):
        parent_expr, key = name[: name.rindex("['")], name[name.rindex("['") + 2 : -2]
        parent = eval(parent_expr, {}, scope)
        parent[key] = other
        return lambda: parent.__setitem__(key, current)
    parent_expr, attr = name.rsplit(".", 1)
    parent = eval(parent_expr, {}, scope)
    setattr(parent, attr, other)
    return lambda: setattr(parent, attr, current)


def test_every_moved_global_guard_catches_its_change() -> None:
    """Each recorded global assertion, of every moved guard type, fails when what its
    source reads is replaced, and then the target is stale (rebuilt at the boundary)."""
    target, seen = _compiled_with_spy()
    types_of: dict[str, set[str]] = {}
    for e, k in seen:
        if not k and e.name.startswith("G["):
            types_of.setdefault(e.name, set()).add(e.guard_type)
    recorded = [a for entry in target.code.assertions for a in entry if a.glob and not a.kept]
    assert len(recorded) >= 10, recorded
    # Kept guards on globals (a global scalar) are recorded too (H33): a change there
    # leaves the stance (Dynamo recompiles with full guards), so it is unmatched, not stale.
    for a in [a for entry in target.code.assertions for a in entry if a.glob and a.kept]:
        if a.kind != "value":
            continue
        undo = _replace(a.name, target.scope())
        try:
            stale, unmatched = target.check_assertions()
        finally:
            undo()
        assert stale is None and unmatched is not None, (a.name, stale, unmatched)
    covered: set[str] = set()
    scope = target.scope()
    for a in recorded:
        undo = _replace(a.name, scope)
        try:
            stale, _ = target.check_assertions()
        finally:
            undo()
        assert stale is not None and a.label in stale, (a.name, stale)
        covered |= types_of.get(a.name.removesuffix(".__code__"), set())
    assert target.check_assertions() == (None, None)
    assert {"MODULE_MATCH", "CLOSURE_MATCH", "TYPE_MATCH", "DUPLICATE_INPUT"} <= covered, covered
    assert covered & {"BUILTIN_MATCH", "FUNCTION_MATCH", "ID_MATCH"}, covered
