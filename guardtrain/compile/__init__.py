"""Compiling targets in place, and undoing it: the compile package.

Rooms (each file's first docstring line says what it is for):

* ``options``: ``compile_kwargs`` checked, a mode expanded, the stance-miss test;
* ``trampoline``: the template code objects Dynamo compiles, the one globals dict
  (``TRAMPOLINE_GLOBALS``) that trampolines and direct dispatch share, frame tests
  (:mod:`guardtrain.engine.breaks` uses them);
* ``call_mode``: the per-call mode and argument keys (``call_key``), the
  dispatch-mode and outside-state checks;
* ``caches``: the transformers caches an argument key describes by their attributes (H53);
* ``repeat``: a repeated argument key recognised without making it again;
* ``stances``: the two stance values a steady call writes around its compiled call (H41);
* ``watch``: change tracking between calls (events for modules, parameters and hooks;
  each flip written into the target's ``known_states.Flips``);
* ``polled``: what a steady call compares (dictionary versions, list contents, H33);
* ``grads``: the parameters' ``requires_grad`` pattern, and code per pattern and
  autocast state (H42, H44);
* ``assertions``: what a compile's guards asserted, recorded and re-checked;
* ``fastcheck``: each entry's assertions checked together per group, in one walk of their
  sources (``EntryChecks``), the per-assertion check only when one fails;
* ``code``: compiled code for one target or a group of identical blocks
  (``TargetCode``, ``structure_key``, ``share_groups``);
* ``miss``: why a call leaves the stance (``Miss``, ``MissReason``);
* ``known_states``: what flips keep (``Flips``), and known states: a flip back to one is
  a swap, not a re-check (``Known``, ``Kept``, ``swap``; H46);
* ``target_state``: what the per-call path reads and writes on a target (``TargetState``);
* ``direct``: turbo's harvested entries (``DirectEntry``);
* ``symbolic``: what a harvested entry's guard tree says (symbolic input sizes, the guards
  beyond the arguments, H53);
* ``harvest``: harvesting and looking up direct entries;
* ``accept``: whether the entry the stance would run accepts a call (H26, H32);
* ``forward``: the installed ``forward``, a steady path and a warm path;
* ``verify``: verify batches (eager beside compiled);
* ``target``: ``CompiledTarget``, install and uninstall, what the engine asks of it,
  ``hand_over`` to full guards (H51);
* ``resolve``: target resolution, each target's ``forward``, nested compile regions;
* ``takeover``: taking over the user's own compiles;
* ``optimizer``: an optimizer's step compiled as one frame, run directly while what its
  guards read holds (``CompiledStep``, ``compile_optimizer=True``, H49).

Imports point one way, from ``target`` down to ``options``, ``trampoline`` and
``call_mode``: no module imports one that imports it.
"""

from __future__ import annotations

from guardtrain.compile.assertions import Assertion, guard_code, plain_attributes, user_path
from guardtrain.compile.call_mode import (
    CallMode,
    call_key,
    dispatch_mode_active,
    outside_state_clear,
)
from guardtrain.compile.code import TargetCode, share_groups, structure_key
from guardtrain.compile.direct import DIRECT_LIMIT, DirectEntry, direct_supported, live_codes
from guardtrain.compile.grads import describe as grad_change
from guardtrain.compile.grads import moved as grad_moved
from guardtrain.compile.grads import use_variant as use_grad_variant
from guardtrain.compile.miss import Miss, MissReason
from guardtrain.compile.options import (
    COMPILE_KWARGS,
    COMPILE_MODES,
    build_compile_kwargs,
    check_compile_kwargs,
    is_stance_miss,
)
from guardtrain.compile.resolve import resolve_targets
from guardtrain.compile.takeover import TakeOver, take_over_compiled
from guardtrain.compile.target import CompiledTarget, hand_over, steady_now
from guardtrain.compile.target_state import CallCounts

__all__ = [
    "CallCounts",
    "COMPILE_KWARGS",
    "COMPILE_MODES",
    "DIRECT_LIMIT",
    "Assertion",
    "CallMode",
    "CompiledTarget",
    "DirectEntry",
    "Miss",
    "MissReason",
    "TakeOver",
    "TargetCode",
    "build_compile_kwargs",
    "call_key",
    "check_compile_kwargs",
    "direct_supported",
    "dispatch_mode_active",
    "grad_change",
    "grad_moved",
    "guard_code",
    "hand_over",
    "is_stance_miss",
    "live_codes",
    "outside_state_clear",
    "plain_attributes",
    "resolve_targets",
    "share_groups",
    "steady_now",
    "structure_key",
    "take_over_compiled",
    "use_grad_variant",
    "user_path",
]
