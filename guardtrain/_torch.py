"""The one door to PyTorch's private internals.

Every private PyTorch name guardtrain reads or writes is reached here, and only here: the
rest of the package imports what it needs from this module, by the names below. A torch
release that moves one of them breaks this file, in one place, and ``scripts/matrix.sh``
(torch 2.11 to 2.15, docs/versions.md) runs the suite on each. Each entry names the
private source, what guardtrain uses it for, and the releases it was checked on; where a
release lacks it, the entry is ``None`` (or a stand-in that says so) and the feature that
needs it is switched off with a reason, never an error.

Module handles (``eval_frame``, ``dynamo_config``, ``guards``) are handed out as objects,
so that the per-call path reads ``handle.attribute`` as it did before: one attribute
lookup on a module-level name, no added call.

| entry | private source | what for | checked on |
|---|---|---|---|
| ``eval_frame`` | ``torch._dynamo.eval_frame`` | the stance (``eval_frame._stance``: read by a steady call and written around its own compiled call, H41), ``OptimizedModule`` | 2.11-2.15 |
| ``dynamo_config`` | ``torch._dynamo.config`` | the run's config values saved, set and put back (``install_free_tensors``, ``skip_nnmodule_hook_guards``, ``use_recursive_dict_tags_for_guards``, ``recompile_limit``) | 2.11-2.15 |
| ``guards`` | ``torch._C._dynamo.guards`` | ``dict_version`` (H33), ``TensorGuards``, ``GlobalStateGuard`` (H30), the guard-manager classes of the polled versions | 2.11-2.15 |
| ``GuardManagerType`` | ``torch._dynamo.guards.GuardManagerType`` | the polled versions' guard tree | 2.11-2.15 |
| ``GuardFilterEntry``, ``guard_builder_names`` | ``torch._dynamo.types``, ``torch._dynamo.guards.GuardBuilder`` | the guard filters' entries and guard kinds | 2.11-2.15 (``code_parts``: 2.15) |
| ``cache_entry_list`` | ``torch._dynamo.eval_frame._debug_get_cache_entry_list`` | a code object's cache entries: their code and guard managers (H26, H30, H32) | 2.11-2.15 |
| ``live_codes`` | ``torch._dynamo.utils.orig_code_map`` | whether Dynamo still knows a harvested entry (``torch._dynamo.reset()`` empties it, H30) | 2.11-2.15 |
| ``reset_code`` | ``torch._dynamo.reset_code`` | forget the entries of the frames after a graph break on a rebuild | 2.11-2.15 |
| ``callback_handler`` | ``torch._dynamo.callback_handler`` | the compile-start callback that keeps ``install_free_tensors`` to the trampoline's own frame (H12) | 2.11-2.15 (callbacks take an argument from 2.8) |
| ``compiling_frame`` | the locals ``code`` and ``recompile_reason`` of Dynamo's ``_compile`` frame | which frame a guard filter call compiles, and why | 2.11-2.15 |
| ``graph_break_records``, ``skipped_by_dynamo`` | ``torch._dynamo.utils.graph_break_reasons``, ``torch._dynamo.trace_rules.check`` | where the graph breaks are (H20) | 2.11-2.15 |
| ``frame_compiles``, ``graph_compiles``, ``compile_seconds`` | ``torch._dynamo.utils.counters["frames"]``, ``counters["stats"]["unique_graphs"]``, ``calculate_time_spent()`` | compile counts (frames, and Dynamo's own count of graphs) and torch's own compile seconds | 2.11-2.15 |
| ``dynamo_counters``, ``fx_graph_cache_on``, ``cache_artifacts`` | ``torch._dynamo.utils.counters``, ``torch._inductor.config.fx_graph_cache``, ``torch.compiler._cache.CacheArtifactManager`` | what a warm start loaded, and a bad artifact refused at load | 2.11-2.15 |
| ``inductor_mode_options`` | ``torch._inductor.list_mode_options`` | a ``mode`` expanded beside the guard filter (H10) | 2.11-2.15 |
| ``profiler_enabled`` | ``torch._C._autograd._profiler_enabled`` | a user's profiler is left alone | 2.11-2.15 |
| ``requires_grad_getter``, ``requires_grad_descriptor``, ``DisableTorchFunction`` | ``torch._C.TensorBase.__dict__["requires_grad"]``, ``torch._C.DisableTorchFunction`` | ``requires_grad`` read and watched below ``__torch_function__`` (H42) | 2.11-2.15 |
| ``torch_function_state``, ``set_torch_function_state`` | ``torch._C._get_torch_function_state``, ``_set_torch_function_state`` | a guard check that raised leaves the state as it found it (2.11-2.14, H36) | 2.11-2.15 |
| ``any_autocast``, ``frame_callback``, ``torch_function_modes``, ``top_saved_hooks``, ``hooks_inlineable`` | ``torch._C._is_any_autocast_enabled``, ``torch._C._dynamo.eval_frame.get_eval_frame_callback``, ``torch._C._len_torch_function_stack``, ``torch._C._autograd._top_saved_tensors_default_hooks``, ``torch._functorch._aot_autograd.utils.saved_tensors_hooks_are_inlineable`` | the per-call mode and outside-state checks of direct dispatch (H30, H31) | 2.11-2.15 |
| ``dispatch_mode_on_stack``, ``any_dispatch_mode`` | ``torch.utils._python_dispatch`` | a dispatch mode makes Dynamo skip a frame (H18) | 2.11-2.15 |
| ``unspecialized_module_variable`` | ``torch._dynamo.variables.nn_module.UnspecializedNNModuleVariable`` | a module Dynamo traces as a plain object (its attribute reads are guarded by value) | 2.11-2.15 |
| ``skip_frame`` | ``torch._dynamo.eval_frame.skip_code`` | a hook of guardtrain's called in eager code (a registration hook, a conversion's wrapper) is never compiled as a frame of its own; inlined where Dynamo traces its caller, as before | 2.11-2.15 |
| ``MODULE_CONVERSION`` | ``torch.nn.Module._apply`` | the method every conversion (``to``, ``half``, ``double``, ``float``, ``type``, ``to_empty``) runs, which writes module tensors past ``__setattr__``: watched (H55) | 2.11-2.15 |
| ``STANCE``, ``eval_frame_state`` | ``torch._dynamo.eval_frame._stance`` | the stance read and written by a steady call (H41) | 2.11-2.15 |
| ``PARAMETERS``, ``BUFFERS``, ``MODULES``, ``MODULE_HOOK_DICTS``, ``STATE_DICT_HOOKS``, ``module_store`` | ``nn.Module._parameters``, ``_buffers``, ``_modules``, its hook dictionaries | fingerprints, events and registrations (H33, H34, H55) | 2.11-2.15 |
| ``GLOBAL_HOOK_DICTS``, ``module_globals`` | ``torch.nn.modules.module._global_*_hooks`` | global module hooks, fingerprinted and watched (H34) | 2.11-2.15 |
| ``COMPILED_CALL``, ``DYNAMO_ORIGINAL``, ``OPTIMIZED_ORIGINAL`` | ``nn.Module._compiled_call_impl``, ``_torchdynamo_orig_callable``, ``OptimizedModule._orig_mod`` | the user's own compiles, found and taken over | 2.11-2.15 |
| ``LIGHTNING_COMPILED`` | Lightning's ``LightningModule._compiler_ctx`` | a module compiled with ``from_compiled`` (H9) | Lightning 2.6 |
| ``DYNAMO_METHOD_IDS`` | ``UnspecializedNNModuleVariable._nn_module_method_ids`` | the methods Dynamo traced on a module it treats as a plain object | 2.11-2.15 |
| ``optimizer_pre_hooks``, ``optimizer_post_hooks``, ``STEP_PRE_HOOKS``, ``STEP_POST_HOOKS``, ``STEP_PROFILE``, ``STEP_CALLED``, ``LR_SCHEDULER_WRAPPED`` | ``torch.optim.optimizer._global_optimizer_*_hooks``, ``Optimizer._optimizer_step_*_hooks``, ``_optimizer_step_code``, ``_opt_called``, ``_wrapped_by_lr_sched`` | the compiled optimizer step runs the hooks and marks the optimizer as ``Optimizer.step`` does (H49) | 2.11-2.15 |
| ``accelerate_state_empty`` | accelerate's ``AcceleratorState._shared_state`` | whether accelerate's state was made in this process | accelerate 1.x |
| ``DynamoException``, ``RecompileLimitHit`` | ``torch._dynamo.exc.TorchDynamoException``, ``FailOnRecompileLimitHit`` | the compiled optimizer step's fallback (H49) | 2.11-2.15 |
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import torch
import torch._dynamo
import torch._dynamo.config
import torch._dynamo.eval_frame
import torch._dynamo.utils
from torch.nn.modules import module as _module_module
from torch.optim import optimizer as _optimizer_module
from torch.utils import _python_dispatch

__all__ = [
    "BUFFERS",
    "COMPILED_CALL",
    "DYNAMO_METHOD_IDS",
    "DYNAMO_ORIGINAL",
    "GLOBAL_HOOK_DICTS",
    "LIGHTNING_COMPILED",
    "LR_SCHEDULER_WRAPPED",
    "MODULES",
    "MODULE_CONVERSION",
    "MODULE_HOOK_DICTS",
    "MODULE_STORES",
    "OPTIMIZED_ORIGINAL",
    "PARAMETERS",
    "STANCE",
    "STATE_DICT_HOOKS",
    "STEP_CALLED",
    "STEP_POST_HOOKS",
    "STEP_PRE_HOOKS",
    "STEP_PROFILE",
    "accelerate_state_empty",
    "eval_frame_state",
    "module_globals",
    "module_store",
    "optimizer_post_hooks",
    "optimizer_pre_hooks",
    "DisableTorchFunction",
    "DynamoException",
    "GuardFilterEntry",
    "GuardManagerType",
    "OptimizedModule",
    "RecompileLimitHit",
    "any_autocast",
    "any_dispatch_mode",
    "cache_entry_list",
    "callback_handler",
    "compile_seconds",
    "compiling_frame",
    "dispatch_mode_on_stack",
    "dynamo_config",
    "eval_frame",
    "frame_callback",
    "frame_compiles",
    "graph_compiles",
    "skip_frame",
    "fx_graph_cache_on",
    "graph_break_records",
    "guard_builder_names",
    "guards",
    "has_saved_hooks_check",
    "hooks_inlineable",
    "cache_artifacts",
    "dynamo_counters",
    "inductor_mode_options",
    "live_codes",
    "profiler_enabled",
    "requires_grad_descriptor",
    "requires_grad_getter",
    "reset_code",
    "set_torch_function_state",
    "skipped_by_dynamo",
    "stance_is_unsafe",
    "top_saved_hooks",
    "torch_function_modes",
    "torch_function_state",
    "unspecialized_module_variable",
]

# -- module handles ------------------------------------------------------------------------

eval_frame: Any = torch._dynamo.eval_frame
"""Dynamo's eval-frame module: the stance is its ``_stance`` (one value for the process,
H11), read and written by a steady call around its own compiled call (H41)."""
dynamo_config: Any = torch._dynamo.config
"""Dynamo's config module: the values a run saves, sets and puts back."""
guards: Any = torch._C._dynamo.guards
"""Dynamo's C++ guards: ``dict_version``, ``TensorGuards``, ``GlobalStateGuard``, guard
managers."""
OptimizedModule = torch._dynamo.eval_frame.OptimizedModule
"""What ``torch.compile(module)`` returns."""


def stance_is_unsafe() -> bool:
    """Whether ``skip_guard_eval_unsafe`` is set in this process now."""
    return bool(eval_frame._stance.skip_guard_eval_unsafe)


# -- guards and cache entries --------------------------------------------------------------

from torch._dynamo.guards import GuardManagerType  # noqa: E402
from torch._dynamo.types import GuardFilterEntry  # noqa: E402


def guard_builder_names() -> frozenset[str]:
    """The names of Dynamo's guard kinds (``GuardBuilder``'s methods): what a filter entry's
    ``guard_type`` may be."""
    from torch._dynamo.guards import GuardBuilder

    return frozenset(n for n in dir(GuardBuilder) if callable(getattr(GuardBuilder, n, None)))


cache_entry_list: Callable[[types.CodeType], list[Any]] | None = getattr(
    eval_frame, "_debug_get_cache_entry_list", None
)
"""Dynamo's cache entries of a code object, newest first (None on a torch without it)."""

live_codes: dict[int, Any] | None = getattr(
    getattr(torch._dynamo.utils, "orig_code_map", None), "values", None
)
"""Dynamo's map from each compiled entry's code to its original code, keyed by ``id``:
``torch._dynamo.reset()`` empties it in place, so ``id(code) in live_codes`` tells
whether Dynamo still knows an entry (H30)."""

reset_code: Callable[[types.CodeType], None] | None = getattr(torch._dynamo, "reset_code", None)
"""Forget a code object's cache entries (None on a torch without it)."""


def callback_handler() -> Any:
    """Dynamo's compile callbacks (``register_start_callback``), or None."""
    return getattr(torch._dynamo, "callback_handler", None)


def compiling_frame() -> tuple[types.CodeType | None, str | None]:
    """The code object Dynamo is compiling and its recompile reason.

    Read from Dynamo's ``_compile`` frame on the stack (a guard filter is called from
    inside it); ``(None, None)`` if this torch lays it out otherwise.
    """
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            break
        if frame.f_code.co_name == "_compile":
            found = frame.f_locals
            code = found.get("code")
            if isinstance(code, types.CodeType):
                reason = found.get("recompile_reason")
                return code, reason if isinstance(reason, str) else None
        frame = frame.f_back
    return None, None


# -- graph breaks, compiles, counters -------------------------------------------------------


def graph_break_records() -> list[Any]:
    """Dynamo's record of every graph break (reason and traced user stack)."""
    return torch._dynamo.utils.graph_break_reasons  # type: ignore[no-any-return]


def skipped_by_dynamo(code: types.CodeType) -> bool | None:
    """Whether Dynamo skips ``code``'s frame as a top-level frame (torch's own modules), or
    None when this torch cannot tell."""
    try:
        from torch._dynamo import trace_rules

        return bool(trace_rules.check(code))
    except Exception:
        return None


def frame_compiles() -> int:
    """Dynamo's frame compiles in this process so far."""
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def graph_compiles() -> int:
    """Dynamo's count of the graphs it compiled in this process so far (``unique_graphs``):
    a frame compile makes one cache entry and as many graphs as its breaks leave, none for
    a frame without tensor work."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compile_seconds() -> float:
    """Torch's own count of the seconds this process spent compiling: Dynamo's frame
    compiles and the backward graphs compiled on their first use (``total_wall_time``)."""
    spent = torch._dynamo.utils.calculate_time_spent()
    return float(spent.get("total_wall_time", 0.0))


def dynamo_counters() -> Any:
    """Dynamo's counters (``counters[group][name]``): inductor's and AOTAutograd's cache
    hits among them."""
    return torch._dynamo.utils.counters


def cache_artifacts(payload: bytes) -> Any:
    """The compile-cache artifacts in a ``save_cache_artifacts`` payload, by cache."""
    from torch.compiler._cache import CacheArtifactManager

    return CacheArtifactManager.deserialize(payload)


def fx_graph_cache_on() -> bool:
    """Whether inductor's FX graph cache is on (a warm start needs it)."""
    import torch._inductor.config

    return bool(torch._inductor.config.fx_graph_cache)


def inductor_mode_options(mode: str, dynamic: bool | None) -> dict[str, Any]:
    """The inductor options of a ``torch.compile`` mode."""
    import torch._inductor

    return dict(torch._inductor.list_mode_options(mode, dynamic))


def profiler_enabled() -> bool:
    """Whether a PyTorch profiler (autograd or kineto) is recording in this process."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return True
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else False


# -- below __torch_function__ ----------------------------------------------------------------

requires_grad_descriptor: Any = torch._C.TensorBase.__dict__["requires_grad"]
"""``Tensor.requires_grad``'s descriptor on the C base class (watched, H42)."""
requires_grad_getter: Callable[[torch.Tensor], bool] = requires_grad_descriptor.__get__
"""Reads ``requires_grad`` without ``__torch_function__`` (H42)."""
DisableTorchFunction: Any = torch._C.DisableTorchFunction
"""A context without ``__torch_function__`` dispatch."""
torch_function_state: Callable[[], Any] = torch._C._get_torch_function_state  # type: ignore[attr-defined]
set_torch_function_state: Callable[[Any], None] = torch._C._set_torch_function_state  # type: ignore[attr-defined]

any_autocast: Callable[[], bool] = getattr(
    torch._C, "_is_any_autocast_enabled", lambda: torch.is_autocast_enabled()
)
"""Whether autocast is on for any device."""
frame_callback: Callable[[], Any] = torch._C._dynamo.eval_frame.get_eval_frame_callback
"""The eval-frame callback now (None outside compiled code)."""
torch_function_modes: Callable[[], int] = torch._C._len_torch_function_stack
"""How many torch-function modes are active."""
top_saved_hooks: Callable[[bool], Any] = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None
)
"""The innermost saved-tensor hooks pair, or None (H31)."""
has_saved_hooks_check: bool = hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")


dispatch_mode_on_stack: Callable[[], bool] = getattr(
    _python_dispatch, "any_torch_dispatch_mode_on_stack", lambda: False
)
"""Whether a TorchDispatchMode is on the stack (Dynamo's test when it inlines them)."""
any_dispatch_mode: Callable[[], bool] = getattr(
    _python_dispatch, "is_in_any_mode_without_ignore_compile_internals", lambda: False
)
"""Whether a TorchDispatchMode that makes Dynamo skip a frame is active (H18)."""


def hooks_inlineable(pair: Any) -> bool | None:
    """Whether Dynamo inlines the saved-tensor hooks ``pair`` (H31), or None when this
    torch cannot tell."""
    try:
        from torch._functorch._aot_autograd.utils import saved_tensors_hooks_are_inlineable
    except ImportError:
        return None
    return bool(saved_tensors_hooks_are_inlineable(pair))


# -- classes guardtrain recognises ------------------------------------------------------------


def unspecialized_module_variable() -> type | None:
    """Dynamo's variable class for a module it traces as a plain object, or None."""
    try:
        from torch._dynamo.variables.nn_module import UnspecializedNNModuleVariable
    except ImportError:
        return None
    return UnspecializedNNModuleVariable


DynamoException: type[BaseException] = torch._dynamo.exc.TorchDynamoException
"""The base of Dynamo's own errors."""
RecompileLimitHit: type[BaseException] = getattr(
    torch._dynamo.exc, "FailOnRecompileLimitHit", torch._dynamo.exc.TorchDynamoException
)
"""Dynamo's error at the recompile limit under ``fail_on_recompile_limit_hit``."""


MODULE_CONVERSION = "_apply"
"""The name of ``nn.Module``'s method that every conversion runs (``to``, ``half``,
``double``, ``float``, ``type``, ``to_empty``): it writes ``.data`` and the tensor
dictionaries directly, past the registration hooks (H55)."""


def skip_frame(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, whose code Dynamo never compiles as a frame of its own: called in eager
    code while Dynamo's frame callback is on (after a graph break), it would be compiled
    as a frame with no graph and counted as one of the run's compiles. Where Dynamo traces
    a caller, it is inlined as before. Returns ``function``."""
    skip = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip is not None:
        skip(function.__code__)
    return function


# -- private attributes of torch, Lightning and accelerate objects ---------------------------
# Read and written through these names alone (tests/test_contract.py walks the package for
# any other use of such a name).

STANCE = "_stance"
"""``eval_frame``'s global that holds torch's stance (H11). The per-call path reads and
writes it as ``eval_frame_state[STANCE]``: one item of the module's dictionary, as cheap as
the attribute."""
eval_frame_state: dict[str, Any] = vars(torch._dynamo.eval_frame)
"""``eval_frame``'s globals, where :data:`STANCE` lives."""

PARAMETERS, BUFFERS, MODULES = "_parameters", "_buffers", "_modules"
"""An ``nn.Module``'s tensor and submodule dictionaries, in its ``__dict__``."""
MODULE_STORES = (PARAMETERS, BUFFERS, MODULES)
MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
"""An ``nn.Module``'s hook dictionaries that a compiled call runs."""
STATE_DICT_HOOKS = "_state_dict_hooks"
"""An ``nn.Module``'s ``state_dict`` hooks."""
GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
"""``torch.nn.modules.module``'s global module-hook dictionaries (H34, H55)."""
module_globals: dict[str, Any] = vars(_module_module)
"""``torch.nn.modules.module``'s globals, where :data:`GLOBAL_HOOK_DICTS` live."""


def module_store(module: Any, store: str) -> dict[str, Any]:
    """``module``'s dictionary ``store`` (one of :data:`MODULE_STORES`), ``{}`` if it has none."""
    found: dict[str, Any] = vars(module).get(store, {})
    return found


COMPILED_CALL = "_compiled_call_impl"
"""What ``nn.Module.compile()`` sets on the module (None when not compiled)."""
DYNAMO_ORIGINAL = "_torchdynamo_orig_callable"
"""What ``torch.compile``'s wrapper of a function or method calls."""
OPTIMIZED_ORIGINAL = "_orig_mod"
"""The module an ``OptimizedModule`` wraps (``torch.compile(module)``)."""
LIGHTNING_COMPILED = "_compiler_ctx"
"""What Lightning's ``from_compiled`` leaves on a ``LightningModule`` (H9)."""
DYNAMO_METHOD_IDS = "_nn_module_method_ids"
"""A Dynamo module variable's ids of the methods it traced (:func:`unspecialized_module_variable`)."""

optimizer_pre_hooks: dict[int, Any] = _optimizer_module._global_optimizer_pre_hooks
"""The global optimizer-step pre-hooks (``register_optimizer_step_pre_hook``)."""
optimizer_post_hooks: dict[int, Any] = _optimizer_module._global_optimizer_post_hooks
"""The global optimizer-step post-hooks."""
STEP_PRE_HOOKS, STEP_POST_HOOKS = "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"
"""An optimizer's own step hooks."""
STEP_PROFILE = "_optimizer_step_code"
"""The empty method ``Optimizer.step``'s wrapper calls for the profiler."""
STEP_CALLED = "_opt_called"
"""Set on an optimizer once its step ran; an LR scheduler warns when it is missing."""
LR_SCHEDULER_WRAPPED = "_wrapped_by_lr_sched"
"""Marks a step an LR scheduler need not wrap (it then reads :data:`STEP_CALLED`)."""


def accelerate_state_empty(state_class: Any) -> bool:
    """Whether accelerate's ``AcceleratorState`` was never made in this process (its shared
    state is empty)."""
    return not state_class._shared_state
