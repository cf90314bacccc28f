"""What the per-call path costs under the stance (H32, H33, H41, H42), part by part, in ns.

Brings a target to the steady state with ``aggressive`` (eager backend) and times, on
the call's own arguments, each check a steady call makes before its compiled call:

* ``changed``: the event flag that module assignments, hooks and a parameter's
  ``requires_grad`` set, and the batch's first-call flag (two reads);
* ``polled``: the dictionaries (global namespaces, plain objects, classes) and lists
  that the target's guards read (:class:`guardtrain.compile.polled.Polled`), with how
  many of each;
* ``key``: the argument key (the target's key function: a repeated key's own one,
  :mod:`guardtrain.compile.repeat`, else :func:`guardtrain.compile.call_key`) and its
  comparison with the previous call's, mode included;
* ``stance``: setting the stance around the compiled call and putting it back, as the
  steady path does (H41);
* ``whole``: one whole steady call through the installed ``forward`` with the compiled
  call stubbed (it returns a fixed output), minus the same call of a plain module that
  returns that output: everything guardtrain adds to a call;
* ``turbo whole``: the same with ``turbo``, whose steady call runs the harvested entry
  directly (H30): every entry of its dispatch table stubbed, so the figure is turbo's
  per-call checks (the flags, polled dictionaries and key above, the outside-state check,
  the entry's key, global-state and tensor checks) and its Python around them.

Two targets: one ``Linear`` called with one tensor and three plain arguments (an int,
a float, a str) that also reads a class attribute and a list attribute, and a
49-module stack (24 ``Linear`` and 24 ``ReLU``) called with one tensor: no per-call
part may grow with the number of modules. Medians of 7 repeats, minus an empty loop.
``--opcodes`` also counts the Python opcodes that one steady call executes in
guardtrain's frames (``aggressive`` and ``turbo``, compiled call stubbed for
``aggressive``), which does not depend on the machine's load.

``--flip`` times a flip back to a known state (H46) on DPO's adapter switch: a tiny peft
LoRA Llama whose adapters are disabled and enabled between calls (8 ``requires_grad``
flips and 4 attribute writes each way), steady with ``aggressive``, the compiled call
stubbed. Two ways: in a loop of the flip's writes alone and a call, minus the writes
alone, against a steady call (what the flip adds to the call that follows it; the budget:
2 µs); and each call timed on its own after peft's own ``disable_adapter_layers()`` /
``enable_adapter_layers()`` (whose hundreds of µs of Python leave the caches cold for
the call after it, with or without guardtrain). Usage::

    .venv/bin/python scripts/change_check_cost.py [--opcodes] [--flip]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from direct_check_cost import per_call  # scripts/ is on sys.path when run as a script
from torch import nn

import guardtrain
from guardtrain import GuardTuner

SCALE = 1.0
_eval_frame = torch._dynamo.eval_frame


class Small(nn.Module):
    GAIN = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scales = [1.0]

    def forward(self, x: torch.Tensor, k: int, t: float, flag: str) -> torch.Tensor:
        out = self.lin(x) * k * t * SCALE * self.GAIN * self.scales[0]
        return out + 1 if flag == "b" else out


class Stack(nn.Module):
    def __init__(self, depth: int = 24) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(8, 8), nn.ReLU()]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * SCALE


def steady_tuner(model: nn.Module, args: tuple[Any, ...], preset: str) -> GuardTuner:
    tuner = GuardTuner(
        model,
        preset=preset,
        compile_kwargs={"backend": "eager"},
        warmup_steps=2,
        stable_steps=2,
        audit_every=None,
        measure_lookup=False,
    )
    tuner.__enter__()
    x = args[0]
    with torch.no_grad():
        for _ in range(8):
            with tuner.step((x,)):
                model(*args)
    assert tuner.phase == "steady", tuner.summary()
    return tuner


def measure(model: nn.Module, args: tuple[Any, ...]) -> dict[str, float]:
    tuner = steady_tuner(model, args, "aggressive")
    try:
        with torch.no_grad():
            x = args[0]
            target = model.forward._guardtrain_target  # type: ignore[union-attr]
            with tuner.step((x,)):
                out = model(*args)  # the last key is this call's
            mode = (model.training, torch.is_grad_enabled(), False, False)
            kwargs: dict[str, Any] = {}
            versions = target.versions
            plain, unsafe = target.plain_stance, target.unsafe_stance
            is_compiling = torch.compiler.is_compiling

            def empty() -> None:
                pass

            def changed() -> None:
                if target.dirty:  # one flag that every trigger sets
                    pass

            def polled() -> None:
                versions.moved()

            key_of = target.key_of  # call_key, or the repeated key's own function

            def key() -> None:
                found = key_of(args, kwargs)
                assert found is not None
                if found[0] != target.last_key or mode != target.last_mode:
                    raise AssertionError("the key should match the last call's")

            def stance() -> None:
                previous = _eval_frame._stance
                if previous is not plain or is_compiling():
                    raise AssertionError("the stance should be the run's plain one")
                _eval_frame._stance = unsafe
                try:
                    pass
                finally:
                    _eval_frame._stance = previous

            class Plain(nn.Module):
                def forward(self, *a: Any) -> torch.Tensor:
                    return out

            stub = Plain()
            compiled = target.compiled
            target.compiled = lambda *a, **k: out
            try:

                def whole() -> None:
                    model(*args)

                def plain_call() -> None:
                    stub(*args)

                whole_ns = per_call(whole) - per_call(plain_call)
            finally:
                target.compiled = compiled
            base = per_call(empty)
            classes = sum(1 for d in versions.dicts if "__module__" in d)  # a class's namespace
            return {
                "changed": per_call(changed) - base,
                "polled": per_call(polled) - base,
                "dicts": float(len(versions.dicts) - classes),
                "classes": float(classes),
                "lists": float(len(versions.lists)),
                "key": per_call(key) - base,
                "stance": per_call(stance) - base,
                "whole": whole_ns,
            }
    finally:
        tuner.__exit__(None, None, None)


def turbo_whole(model: nn.Module, args: tuple[Any, ...]) -> float:
    """ns per steady ``turbo`` call with every harvested entry stubbed, minus a plain call."""
    tuner = steady_tuner(model, args, "turbo")
    try:
        with torch.no_grad():
            target = model.forward._guardtrain_target  # type: ignore[union-attr]
            with tuner.step((args[0],)):
                out = model(*args)
            entries = [e for table in target.learnt.dispatch_table.values() for e in table]
            assert entries, "turbo harvested no entry: not steady"
            for entry in entries:
                entry.fn = lambda *a, **k: out
            calls = target.counts.direct_calls

            class Plain(nn.Module):
                def forward(self, *a: Any) -> torch.Tensor:
                    return out

            stub = Plain()
            whole_ns = per_call(lambda: model(*args)) - per_call(lambda: stub(*args))
            assert target.counts.direct_calls > calls, "the calls did not run directly"
            return whole_ns
    finally:
        tuner.__exit__(None, None, None)


def opcodes(model: nn.Module, args: tuple[Any, ...], preset: str) -> tuple[int, int, Counter]:
    """``(frames, opcodes, by opcode name)`` executed in guardtrain's frames by one steady
    call (the compiled call stubbed for ``aggressive``, turbo's direct entry run as is)."""
    import dis

    root = str(Path(guardtrain.__file__).parent)
    tuner = steady_tuner(model, args, preset)
    counts: Counter = Counter()
    frames = [0]
    try:
        with torch.no_grad():
            target = model.forward._guardtrain_target  # type: ignore[union-attr,attr-defined]
            with tuner.step((args[0],)):
                out = model(*args)
                if preset != "turbo":
                    target.compiled = lambda *a, **k: out

                def trace(frame: Any, event: str, arg: Any) -> Any:
                    if not frame.f_code.co_filename.startswith(root):
                        return None
                    if event == "call":
                        frames[0] += 1
                        frame.f_trace_opcodes = True
                    elif event == "opcode":
                        counts[dis.opname[frame.f_code.co_code[frame.f_lasti]]] += 1
                    return trace

                sys.settrace(trace)
                try:
                    model(*args)
                finally:
                    sys.settrace(None)
    finally:
        tuner.__exit__(None, None, None)
    return frames[0], sum(counts.values()), counts


def _stub_every_code(target: Any, out: Any) -> None:
    """Make every code variant of ``target``, and each state it keeps, return ``out``."""

    def stub(*args: Any, **kwargs: Any) -> Any:
        return out

    for code in target.code.variants.values():
        code.compiled = stub
    for known in target.kept.known.values():
        known.compiled = stub
    target.compiled = stub


def flip_cost() -> dict[str, float]:
    """ns per call: a call after a flip back to a known state, against a steady call."""
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout: benchmarks/
    from benchmarks.dpo import tiny_lora_llama

    model = tiny_lora_llama()  # the DPO workload's peft LoRA Llama
    ids = torch.randint(1, 64, (4, 12))
    inner = model.base_model
    tuner = steady_tuner_of(model, ids, inner)
    try:
        target = model.forward._guardtrain_target  # type: ignore[union-attr]
        with torch.no_grad():
            out = model(input_ids=ids)
            _stub_every_code(target, out)
            state = [True]

            def flip() -> None:
                if state[0]:
                    inner.disable_adapter_layers()
                else:
                    inner.enable_adapter_layers()
                state[0] = not state[0]

            adapters = [p for n, p in model.named_parameters() if "lora_" in n]
            layers = [m for m in model.modules() if "_disable_adapters" in m.__dict__]

            def bare_flip() -> None:
                # What peft's switch changes, without its own Python around it.
                on = not state[0]
                for p in adapters:
                    p.requires_grad_(on)
                for m in layers:
                    m._disable_adapters = not on
                state[0] = on

            def call() -> None:
                model(input_ids=ids)

            def bare_flip_and_call() -> None:
                bare_flip()
                call()

            n = 2000
            swaps_before = target.counts.swaps
            after_flip = timed_calls(call, n, before=flip)
            swapped = target.counts.swaps - swaps_before
            if not state[0]:
                flip()  # adapters on again for the steady calls
            steady = timed_calls(call, n)
            alone = per_call(flip, 200)
            hot = per_call(bare_flip_and_call, 20_000) - per_call(bare_flip, 20_000)
            hot_steady = per_call(call, 20_000)
            if not state[0]:
                flip()
        if swapped < 7 * n:
            raise AssertionError(f"only {swapped} of {7 * n} calls swapped: {tuner.summary()}")
        return {
            "after_flip": after_flip,
            "flip": alone,
            "call": steady,
            "added": after_flip - steady,
            "hot_after_flip": hot,
            "hot_call": hot_steady,
            "hot_added": hot - hot_steady,
        }
    finally:
        tuner.__exit__(None, None, None)


def timed_calls(call: Callable[[], Any], n: int, before: Callable[[], Any] | None = None) -> float:
    """ns per ``call()``, each timed alone (``before()`` runs untimed ahead of each); the
    median of 7 rounds of ``n``."""
    clock = time.perf_counter_ns
    rounds = []
    gc.collect()
    for _ in range(7):
        total = 0
        for _ in range(n):
            if before is not None:
                before()
            t0 = clock()
            call()
            total += clock() - t0
        rounds.append(total / n)
    return statistics.median(rounds)


def steady_tuner_of(model: nn.Module, ids: torch.Tensor, inner: Any) -> GuardTuner:
    """``model`` steady under ``aggressive`` with both adapter states known."""
    tuner = GuardTuner(
        model,
        preset="aggressive",
        compile_kwargs={"backend": "eager"},
        warmup_steps=2,
        stable_steps=2,
        audit_every=None,
        measure_lookup=False,
    )
    tuner.__enter__()
    with torch.no_grad():
        for _ in range(10):
            with tuner.step((ids,)):
                model(input_ids=ids)
                inner.disable_adapter_layers()
                model(input_ids=ids)
                inner.enable_adapter_layers()
    assert tuner.phase == "steady", tuner.summary()
    return tuner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--opcodes", action="store_true", help="count opcodes per steady call")
    ap.add_argument("--flip", action="store_true", help="time a flip back to a known state")
    options = ap.parse_args()
    if options.flip:
        torch.set_num_threads(1)
        f = flip_cost()
        print(f"torch {torch.__version__}; ns per call (median of 7), peft LoRA Llama")
        print("| measured | call after a flip | steady call | added by the flip |")
        print("|---|---|---|---|")
        print(
            f"| in a loop, the flip's writes alone | {f['hot_after_flip']:.0f} | "
            f"{f['hot_call']:.0f} | {f['hot_added']:.0f} |"
        )
        print(
            f"| each call timed after peft's own switch ({f['flip'] / 1e3:.0f} µs) | "
            f"{f['after_flip']:.0f} | {f['call']:.0f} | {f['added']:.0f} |"
        )
        return
    torch.manual_seed(0)
    rows = [
        ("Linear, 1 tensor + int, float, str", Small, (torch.randn(4, 8), 3, 0.5, "a")),
        ("49 modules, 1 tensor", Stack, (torch.randn(4, 8),)),
    ]
    print(f"torch {torch.__version__}; ns per call (median of 7, minus an empty loop)")
    print(
        "| target | flags | polled (dicts, classes, lists) | argument key | stance | "
        "sum | whole call | turbo whole call |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, make, args in rows:
        r = measure(make(), args)
        turbo = turbo_whole(make(), args)
        total = r["changed"] + r["polled"] + r["key"] + r["stance"]
        print(
            f"| {label} | {r['changed']:.0f} | {r['polled']:.0f} ({r['dicts']:.0f}, "
            f"{r['classes']:.0f}, {r['lists']:.0f}) | {r['key']:.0f} | {r['stance']:.0f} | "
            f"{total:.0f} | {r['whole']:.0f} | {turbo:.0f} |"
        )
    if options.opcodes:
        print("\n| target | preset | frames | opcodes | LOAD_ATTR | CALL |")
        print("|---|---|---|---|---|---|")
        for label, make, args in rows:
            for preset in ("aggressive", "turbo"):
                n_frames, n, by = opcodes(make(), args, preset)
                print(
                    f"| {label} | {preset} | {n_frames} | {n} | {by['LOAD_ATTR']} | {by['CALL']} |"
                )


if __name__ == "__main__":
    main()
