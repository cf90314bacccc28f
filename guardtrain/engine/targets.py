"""The run's compiled targets: activate (compile or reuse), split on graph breaks, restore.

A :class:`TargetSet` holds one run's targets and what happened to them: those
taken over from the user's own ``torch.compile``, those split into their parts
because they broke the graph (H20), and the counts of targets no longer in the
run. It changes targets only when the engine asks; the engine decides, re-arms
and rebuilds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from guardtrain.compile import (
    CallCounts,
    CompiledTarget,
    Miss,
    TakeOver,
    resolve_targets,
    share_groups,
    take_over_compiled,
)
from guardtrain.compile.resolve import forward_function
from guardtrain.engine import breaks as _breaks
from guardtrain.engine.config import GuardConfig
from guardtrain.engine.host import Host
from guardtrain.engine.levers import Levers

__all__ = [
    "Hooks",
    "TargetSet",
    "breaks_of",
    "fully_sharded",
    "label",
    "regions",
    "regions_toward",
]


def label(target: CompiledTarget, root_label: str) -> str:
    """How messages and the summary name ``target`` (the root module by ``root_label``)."""
    return target.name or root_label


@dataclass(frozen=True, slots=True)
class Hooks:
    """What every compiled target reports to the engine (the engine acts on each)."""

    on_compile: Callable[[CompiledTarget, str | None], None]
    on_miss: Callable[[CompiledTarget, Miss], bool]
    on_switch_off: Callable[[CompiledTarget, str], None]
    on_change: Callable[[CompiledTarget, str], None]


@dataclass(slots=True)
class TargetSet:
    """One run's compiled targets; :meth:`next_run` carries what later runs reuse."""

    config: GuardConfig
    levers: Levers
    """The run's levers in force (the engine's object: resolved in place at setup)."""
    hooks: Hooks
    kept: list[CompiledTarget] = field(default_factory=list)
    """Targets of the last run: the next run on the same modules reinstalls them (H28)."""
    took_over_told: list[str] = field(default_factory=list)
    """The names whose take-over was last warned about (warned again when they change)."""
    installed: list[CompiledTarget] = field(default_factory=list)
    """The targets compiled in place for this run (empty once restored)."""
    names: list[str] = field(default_factory=list)
    """Their labels, for the summary (kept after the run is restored)."""
    takeover: TakeOver | None = None
    took_over: list[str] = field(default_factory=list)
    """The user's own compiles of targets, switched off for the run (``"net (torch.compile)"``)."""
    adapter_took_over: list[str] = field(default_factory=list)
    """What the adapter took over (the Trainer's ``torch_compile``, with backend and mode)."""
    graph_breaks: list[dict[str, Any]] = field(default_factory=list)
    """Default targets split into their parts because they broke the graph (H20)."""
    mixed: list[dict[str, Any]] = field(default_factory=list)
    """Targets with graph breaks kept whole: ``target``, ``reason``, ``answer``, ``mixed``
    (whether some of its calls run as one graph, H4)."""
    break_log: _breaks.BreakLog = field(default_factory=_breaks.BreakLog)
    """Dynamo's graph-break records read so far (reasons with file and line)."""
    direct_refused_targets: list[dict[str, str]] = field(default_factory=list)
    """Targets refused direct dispatch, and why."""
    counts: CallCounts = field(default_factory=CallCounts)
    """The run's call counts: each of its targets counts into it, split ones too."""

    def batch_starts(self) -> None:
        """Before a batch: each target's next call is the batch's first, which checks the
        parameters' ``requires_grad`` that no event sees (H42)."""
        for target in self.installed:
            target.first_call = target.dirty = True

    def next_run(self, config: GuardConfig, levers: Levers) -> TargetSet:
        """A fresh set for the next run (with the run's ``config``, which an adapter may
        have replaced since), with the kept targets and the take-over note."""
        return TargetSet(config, levers, self.hooks, self.kept, self.took_over_told)

    def resolve(
        self, root: nn.Module, root_by_default: bool, default_targets: list[str] | None = None
    ) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs this run compiles in ``root``.

        With ``targets=None``: ``default_targets`` (the adapter's own default), else
        ``root`` itself when ``root_by_default``, else the default rule.
        """
        names = self.config.targets
        if names is None and default_targets is not None:
            names = list(default_targets)
        elif names is None and root_by_default:
            names = [""]
        return resolve_targets(root, names)

    def activate(
        self, root: nn.Module, resolved: list[tuple[str, nn.Module]], host: Host, paired: bool
    ) -> None:
        """Compile the ``resolved`` targets of ``root`` in place, or reinstall the kept
        ones (H28).

        ``paired``: compiled calls pair across ranks (guard collectives), so a
        target retries eagerly instead of skipping alone.

        Raises:
            GuardTrainValueError, GuardTrainRuntimeError: a target compiled already
                (named as ``host`` names it).
        """
        self.takeover = take_over_compiled(root, resolved, host.root_label)
        self._tell_take_over(self.takeover.names, host)
        for name, module in resolved:  # what the take-over left compiled is refused
            forward_function(name, module, host.owner, host.known_as(name))
        ift = self.levers.install_free_tensors
        kept = {(t.name, id(t.module)): t for t in self.kept if t.requested_free_tensors == ift}
        if all((name, id(module)) in kept for name, module in resolved):
            # A later run on the same modules: same code, same Dynamo cache (H28).
            for name, module in resolved:
                target = kept[(name, id(module))]
                target.install(host.known_as(name))
                target.pair_calls_across_ranks(paired)
                target.counts = self.counts  # this run's (the last run's are in `Run.earlier`)
                self._allow_direct(target, host.root_label)
                self.installed.append(target)
        else:
            self.installed = self._make(resolved, paired, host.root_label)
        self.names = [label(t, host.root_label) for t in self.installed]
        self.kept = list(self.installed)

    def _make(
        self, parts: list[tuple[str, nn.Module]], paired: bool, root_label: str
    ) -> list[CompiledTarget]:
        """Compile ``parts`` in place; instances of one class and structure share code (H24)."""
        made: list[CompiledTarget] = []
        groups = share_groups([module for _, module in parts])
        hooks = self.hooks
        for i, (name, module) in enumerate(parts):
            leader = groups[i]
            made.append(
                CompiledTarget(
                    name,
                    module,
                    self.config.compile_kwargs,
                    self.levers.guard_filter,
                    self.levers.install_free_tensors,
                    on_compile=hooks.on_compile,
                    on_miss=hooks.on_miss,
                    on_switch_off=hooks.on_switch_off,
                    share_with=made[leader] if leader is not None and leader != i else None,
                    shared=leader == i,
                    on_change=hooks.on_change,
                )
            )
            made[-1].counts = self.counts
            made[-1].pair_calls_across_ranks(paired)
            self._allow_direct(made[-1], root_label)
        return made

    def _allow_direct(self, target: CompiledTarget, root_label: str) -> None:
        """Whether ``target`` may run harvested entries directly (turbo, H30)."""
        target.allow_direct_dispatch(False)
        if not self.levers.direct_dispatch:
            return
        sharded = fully_sharded(target.module)
        if sharded is not None:
            self.direct_refused_targets.append(
                {
                    "target": label(target, root_label),
                    "why": f"{sharded} is sharded with FSDP's fully_shard: its parameters "
                    "are gathered and freed around every forward",
                }
            )
            return
        target.allow_direct_dispatch(True)

    def _tell_take_over(self, names: list[str], host: Host) -> None:
        """One warning when the user's own compiles are taken over (once per change)."""
        self.took_over = list(names)
        if names and names != self.took_over_told:
            host.warn(
                f"guardtrain: took over the compile of {', '.join(names)}: {host.owner} "
                "compiles the original module once itself (state_dict keys stay as they are); "
                "drop your own torch.compile call to silence this."
            )
        self.took_over_told = list(names)

    def idle(self, label: Callable[[CompiledTarget], str]) -> list[str]:
        """The targets (named by ``label``) that ran uncompiled: never compiled, or called
        with no entry left (Dynamo skipped their code)."""
        return [
            label(t)
            for t in self.installed
            if t.code.compiles == 0 or (t.calls and t.cache_entries() == 0)
        ]

    def restore(self) -> None:
        """Uninstall every target and give the user's own compiles back."""
        for target in self.installed:
            target.uninstall()
        self.installed = []
        if self.takeover is not None:
            self.takeover.restore()
            self.takeover = None

    def split(
        self,
        target: CompiledTarget,
        found: list[_breaks.GraphBreak],
        paired: bool,
        root_label: str,
        record: bool = True,
    ) -> list[str] | None:
        """Compile the parts of a breaking default target instead of it (H20), or of one
        rebuilt too often (H51; ``record=False``: not a graph break of the summary's).

        Returns the parts' names, or None when ``target`` has no parts (nothing changed).
        """
        parts = regions_toward(target.name, target.module, found)
        if not parts:
            return None
        if not target.detach():  # the last user of its code (the others split in this pass)
            target.rebuild()  # forget its entries, resume functions included
        target.uninstall()
        index = self.installed.index(target)
        made = self._make(parts, paired, root_label)
        self.installed[index : index + 1] = made
        self.names = [label(t, root_label) for t in self.installed]
        self.kept = list(self.installed)
        names = [name for name, _ in parts]
        if not record:
            return names
        self.graph_breaks.append(
            {
                "target": label(target, root_label),
                "reason": "; ".join(b.reason for b in found) or "unknown",
                "where": "; ".join(b.where for b in found if b.where),
                "regions": names,
            }
        )
        return names


def breaks_of(
    target: CompiledTarget, found: list[_breaks.GraphBreak]
) -> list[_breaks.GraphBreak] | None:
    """After a batch that compiled: the graph breaks to hold against ``target``, or None.

    None when it has no graph breaks (its fingerprint is then taken, if it has
    none yet). A break at the call into a ``forward`` that Dynamo never compiles
    as a frame of its own marks the target as breaking (H20).
    """
    forward = getattr(target, "_func", None)
    mine = _breaks.entered(found, forward)
    if mine and not target.graph_breaks and _breaks.skipped_at_top(forward):
        # The break was at the call into a `forward` that Dynamo never compiles
        # as a frame of its own (torch's modules, `nn.Transformer`): it ran
        # uncompiled, and no resume frame showed the break (H20).
        target.code.mark_graph_breaks()
    if not target.graph_breaks:
        if target.reference is None:
            target.take_reference()
        return None
    return mine or found


def fully_sharded(module: nn.Module) -> str | None:
    """The name of a module in ``module`` that FSDP2's ``fully_shard`` wrapped, or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without it
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            return type(sub).__name__ + (f" ({name})" if name else "")
    return None


def regions_toward(
    name: str, module: nn.Module, found: list[_breaks.GraphBreak]
) -> list[tuple[str, nn.Module]]:
    """The parts of a target ``module`` that broke the graph (``found``): down to the
    deepest submodule whose ``forward`` the break is in (:func:`~guardtrain.engine.breaks.
    innermost`), which becomes a part, and beside the path the other parts of each module
    on it; without such a submodule, :func:`regions`. One split, one re-arm, where
    splitting level by level re-armed once per level (a break inside a checkpointed layer
    of a Llama with ``kernels``: three)."""
    below = [(f"{name}.{n}" if name else n, m) for n, m in module.named_modules() if n]
    deepest = _breaks.innermost(found, below) if found else None
    if deepest is None:
        return regions(name, module)
    path = {id(m) for n, m in below if deepest == n or deepest.startswith(n + ".")}
    target = next(m for n, m in below if n == deepest)

    def toward(part_name: str, part: nn.Module) -> list[tuple[str, nn.Module]]:
        parts: list[tuple[str, nn.Module]] = []
        for child_name, child in regions(part_name, part):
            if child is not target and id(child) in path:
                parts.extend(toward(child_name, child))
            else:
                parts.append((child_name, child))
        return parts

    return toward(name, module) or regions(name, module)


def regions(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The parts of ``module`` to compile instead of it: each child with parameters and a
    ``forward``; a container without one (``ModuleList``) gives its children."""
    parts: list[tuple[str, nn.Module]] = []
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if next(child.parameters(), None) is None:
            continue
        if type(child).forward is nn.Module.forward:
            parts.extend(regions(full, child))
        else:
            parts.append((full, child))
    return parts
