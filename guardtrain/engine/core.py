"""GuardEngine: one run's phases, checks, stance and report, for every adapter.

An adapter (the Lightning callback, ``GuardTuner``, the bench) tells the engine
where the run is, and nothing else:

* :meth:`GuardEngine.setup` once per run, :meth:`GuardEngine.activate` when the
  model is placed (targets are compiled in place), :meth:`GuardEngine.finish`
  at the end (everything restored, the summary logged once);
* :meth:`GuardEngine.loop_start` / :meth:`GuardEngine.loop_end` around each
  pass of a loop, :meth:`GuardEngine.batch_start` / :meth:`GuardEngine.batch_end`
  around each batch.

The engine imports no Lightning. It talks to the outside through a
:class:`Host`: messages, metrics, and a :class:`~guardtrain.engine.agreement.RankAgreement`.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from guardtrain import filters as _filters
from guardtrain import versions as _versions
from guardtrain.compile import (
    UNACCEPTED,
    UNSEEN_ARGUMENTS,
    CompiledTarget,
    TakeOver,
    direct_supported,
    resolve_targets,
    share_groups,
    take_over_compiled,
)
from guardtrain.engine import breaks as _breaks
from guardtrain.engine import decisions, report, warmstart
from guardtrain.engine.agreement import RankAgreement, SingleProcess
from guardtrain.engine.changes import Action, Change, ChangeLog, decide
from guardtrain.engine.config import DISABLE_ENV, GuardConfig
from guardtrain.engine.phases import Loop, Phase, PhaseMachine
from guardtrain.engine.session import StanceSession
from guardtrain.filters import GuardFilter
from guardtrain.monitor import (
    CompileMonitor,
    SameSignature,
    batch_signature,
    describe_signature,
    fingerprint_change,
    module_fingerprint,
)

__all__ = ["GuardEngine", "Host"]

# Plain strings on the per-batch path: an Enum member lookup costs more than the check.
TRAIN: str = Loop.TRAIN.value
STEADY: str = Phase.STEADY.value


def _parameters(fn: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


@dataclass(slots=True)
class Host:
    """How the engine reaches the outside world. Adapters fill it in."""

    info: Callable[[str], None] = print
    """One informational line (rank zero only)."""
    warn: Callable[[str], None] = _warn
    """One warning (rank zero only)."""
    log_metrics: Callable[[dict[str, float], int], None] | None = None
    """``(metrics, step)`` to the run's loggers, called on rank zero only; None: none."""
    agreement: RankAgreement = field(default_factory=SingleProcess)
    """Collective decisions (H7)."""
    sanity_checking: Callable[[], bool] = lambda: False
    """Whether the current evaluation pass is Lightning's sanity check."""
    owner: str = "guardtrain"
    """Named in messages: ``"GuardTuneCallback"``, ``"GuardTuner"``."""
    root_label: str = "<LightningModule>"
    """How the summary names a target that is the root module itself."""


@dataclass(slots=True)
class Levers:
    """The levers in force for this run (a lever the installed torch lacks is off)."""

    install_free_tensors: bool = False
    recursive_dict_tags: bool | None = None
    use_stance: bool = False
    guard_filter: GuardFilter | None = None
    direct_dispatch: bool = False
    """Turbo: run harvested entries directly in the steady state (not refused)."""


@dataclass(slots=True)
class RunState:
    """Everything one run counts and remembers; a new run starts with a fresh one."""

    targets: list[CompiledTarget] = field(default_factory=list)
    target_names: list[str] = field(default_factory=list)
    takeover: TakeOver | None = None
    took_over: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Targets rebuilt once because Dynamo skipped their code (H18)."""
    pending: set[str] = field(default_factory=set)
    """Loops whose next batch starts with the boundary re-check."""
    loop: str | None = None
    switched_off: list[dict[str, str]] = field(default_factory=list)
    stance_blocked: str | None = None
    uncompiled: list[str] = field(default_factory=list)
    compiles_at_batch: int = 0
    same_signature: dict[str, SameSignature | None] = field(default_factory=dict)
    """Per loop: recognises a batch with the previous batch's signature (the steady path)."""
    rank: int | None = None
    all_rearms: list[dict[str, Any]] | None = None
    entered_together: bool = False
    measure: str | None = None
    """The lookup window being measured: ``"full"``, ``"steady"`` or None."""
    measure_left: int = 0
    window: Any = None
    lookup: dict[str, float] = field(default_factory=dict)
    lookup_calls: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per window: training steps measured and compiled calls (cache lookups) seen."""
    lookup_logged: bool = False
    next_check: int = 0
    changes: int = 0
    """Counts compiles, re-arms and entries: the logger is called only when it moved."""
    logged_changes: int = -1
    logged: tuple[int, int, int] | None = None
    graph_breaks: list[dict[str, Any]] = field(default_factory=list)
    """Default targets split into their parts because they broke the graph (H20)."""
    break_log: _breaks.BreakLog = field(default_factory=_breaks.BreakLog)
    """Dynamo's graph-break records read so far (reasons with file and line)."""
    probe: str | None = None
    """The loop whose current batch probes an unseen signature with full guards."""
    checking: str | None = None
    """The unseen signature (described) whose batch checks each call's inputs (H26)."""
    checked_batches: int = 0
    """Batches with an unseen signature that stayed under the stance."""
    checked_calls: int = 0
    """Calls in those batches that an entry's guards accepted."""
    direct_refused: str | None = None
    """Why direct dispatch (turbo) is off for the whole run, if it was asked for."""
    direct_refused_targets: list[dict[str, str]] = field(default_factory=list)
    """Targets refused direct dispatch, and why."""
    direct_calls: int = 0
    """Calls run directly by targets that are no longer in the run (split, replaced)."""
    caught: ChangeLog = field(default_factory=ChangeLog)
    """Changes caught before a call (H32-H35), by kind."""
    full_guard_calls: int = 0
    """Calls with full guards under the stance by targets no longer in the run."""
    swaps_parameters: str | None = None
    """The strategy (or ``fully_shard``) that swaps parameter objects around every forward."""
    stance_at_start: bool = False
    """The stance was on when the current training batch started."""
    audit_batch: bool = False
    verify_batch: bool = False
    active: bool = False
    summary_logged: bool = False


class GuardEngine:
    """One adapter's runs: compiled targets, phases, checks, the stance and the report.

    Args:
        config: the validated arguments (:func:`~guardtrain.engine.config.make_config`).
        host: messages, metrics and rank agreement; an adapter may replace it
            per run (:meth:`activate`).
    """

    def __init__(self, config: GuardConfig, host: Host | None = None) -> None:
        self.config = config
        self.host = host or Host()
        self.restored: dict[str, Any] = {}
        """Counters of earlier runs (a checkpoint, or earlier trainer calls)."""
        self.kept: list[CompiledTarget] = []
        """Targets of the last run: the next run on the same modules reinstalls them (H28)."""
        self._took_over_told: list[str] = []
        self._dict_tags_warned = False
        self._dict_tags_told = False
        self._dict_tags_overridden = False
        self._ran = False
        self.compile_cache: dict[str, Any] | None = None
        """The warm start's state (``compile_cache=``), loaded once per engine."""
        self._new_run()

    def _new_run(self) -> None:
        lv = self.config.levers
        self.machine = PhaseMachine(lv.warmup_steps, lv.stable_steps, lv.use_stance)
        self.monitor = CompileMonitor()
        self.session = StanceSession(self.host.owner)
        self.levers = Levers(
            lv.install_free_tensors,
            lv.recursive_dict_tags,
            lv.use_stance,
            direct_dispatch=lv.direct_dispatch,
        )
        self.run = RunState()

    # -- what the adapters read -------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.run.active

    @property
    def phase(self) -> str:
        """The training loop's phase: ``"warmup"``, ``"steady"``, or ``"off"`` (no stance)."""
        if self.config.disabled or not self.config.levers.use_stance or self.run.stance_blocked:
            return Phase.OFF.value
        return str(self.machine.phase(TRAIN))

    def train_batches(self) -> int:
        return self.machine.loops[TRAIN].batches + self.restored.get("train_batches", 0)

    def summary(self) -> dict[str, Any]:
        """Counters and history of the runs so far, as a plain dict."""
        r, m, run = self.restored, self.machine, self.run
        lookup = run.lookup or r.get("lookup_us", {})
        return {
            "preset": self.config.preset,
            "phase": self.phase,
            "phases": {str(loop): str(m.phase(loop)) for loop in m.loops},
            "compiles": self.monitor.compiles + r.get("compiles", 0),
            "rearms": list(r.get("rearms", []))
            + list(m.rearms if run.all_rearms is None else run.all_rearms),
            "warmup_steps_taken": m.warmup_steps_taken + r.get("warmup_steps_taken", 0),
            "steady_steps": m.steady_steps + r.get("steady_steps", 0),
            "targets": list(run.target_names),
            "compile_events": (list(r.get("compile_events", [])) + self.monitor.events)[:100],
            "levers": {
                "recursive_dict_tags": self.levers.recursive_dict_tags,
                "install_free_tensors": self.levers.install_free_tensors,
                "guard_filter": self.config.filter_name,
                "soundness_floor": not self.config.unsafe_drop_floor,
                "use_stance": self.levers.use_stance,
            },
            "switched_off": list(run.switched_off),
            "stance_blocked": run.stance_blocked,
            "uncompiled_targets": list(run.uncompiled),
            "lookup_us": dict(lookup),
            "lookup_calls": dict(run.lookup_calls or r.get("lookup_calls", {})),
            "took_over": list(run.took_over),
            "shared_code": self._shared_code(),
            "own_code": [
                {"target": self._label(t), "why": t.own_code} for t in self.kept if t.own_code
            ],
            "direct_dispatch": self._direct_summary(),
            "caught_changes": run.caught.summary(),
            "full_guard_calls": run.full_guard_calls + sum(t.full_guard_calls for t in self.kept),
            "checked_batches": run.checked_batches + r.get("checked_batches", 0),
            "checked_calls": run.checked_calls + r.get("checked_calls", 0),
            "graph_breaks": [dict(b) for b in run.graph_breaks],
            "disabled": self.config.disabled,
            "compile_cache": warmstart.summary(self.compile_cache),
        }

    def _direct_summary(self) -> dict[str, Any]:
        """Direct dispatch (turbo): whether it is on, why not, and how many calls used it."""
        run = self.run
        refusals = self._direct_refusals() if self.levers.direct_dispatch else []
        return {
            "requested": self.config.levers.direct_dispatch,
            "on": self.levers.direct_dispatch
            and not _every_target_refused([self._label(t) for t in self.kept], refusals),
            "refused": run.direct_refused,
            "refused_targets": refusals,
            "calls": run.direct_calls
            + sum(t.direct_calls for t in self.kept)
            + self.restored.get("direct_calls", 0),
        }

    def _direct_refusals(self) -> list[dict[str, str]]:
        """Targets that may not run directly: refused at activation (FSDP's
        ``fully_shard``), or with graph breaks (their resume frames would run eagerly;
        they keep every guard and never use the stance)."""
        found = list(self.run.direct_refused_targets)
        named = {t["target"] for t in found}
        for t in self.kept:
            if t.graph_breaks and self._label(t) not in named:
                found.append(
                    {
                        "target": self._label(t),
                        "why": "graph breaks: the frames after a break would run eagerly",
                    }
                )
        return found

    def _shared_code(self) -> list[dict[str, Any]]:
        """Groups of targets that share one compiled code object (H24)."""
        groups: dict[int, list[CompiledTarget]] = {}
        for t in self.kept:
            if t.shared:
                groups.setdefault(id(t.c), []).append(t)
        return [
            {"class": type(g[0].module).__name__, "targets": [self._label(t) for t in g]}
            for g in groups.values()
            if len(g) > 1
        ]

    def format_summary(self) -> str:
        return report.format_summary(self.summary())

    def state_dict(self) -> dict[str, Any]:
        s = self.summary()
        return {
            "preset": self.config.preset,
            "compiles": s["compiles"],
            "rearms": s["rearms"],
            "warmup_steps_taken": s["warmup_steps_taken"],
            "steady_steps": s["steady_steps"],
            "train_batches": self.train_batches(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = {
            "compiles": int(state_dict.get("compiles", 0)),
            "rearms": list(state_dict.get("rearms", [])),
            "warmup_steps_taken": int(state_dict.get("warmup_steps_taken", 0)),
            "steady_steps": int(state_dict.get("steady_steps", 0)),
            "train_batches": int(state_dict.get("train_batches", 0)),
        }

    # -- a run -------------------------------------------------------------------------------

    def setup(
        self,
        *,
        world_size: int = 1,
        rank: int = 0,
        swaps_parameters: str | None = None,
        sharded_by_hand: str | None = None,
    ) -> None:
        """Start a run: a fresh phase machine and the levers this torch and strategy allow.

        Args:
            world_size: processes in the run; with more than one, entry is collective.
            rank: this process's global rank.
            swaps_parameters: the name of a strategy that swaps parameters around
                every forward (FSDP): ``install_free_tensors`` is switched off.
            sharded_by_hand: FSDP2's ``fully_shard`` found on the model without such a
                strategy (H37): ``install_free_tensors`` is switched off, and direct
                dispatch is refused per sharded target.
        """
        if self._ran:  # a later run: the summary goes on from the earlier ones
            s = self.summary()
            self.restored = {
                key: s[key] for key in ("compiles", "rearms", "warmup_steps_taken", "steady_steps")
            }
            self.restored.update(
                train_batches=self.train_batches(),
                lookup_us=s["lookup_us"],
                lookup_calls=s["lookup_calls"],
                compile_events=s["compile_events"],
                checked_batches=s["checked_batches"],
                checked_calls=s["checked_calls"],
                direct_calls=s["direct_dispatch"]["calls"],
            )
            self._ran = False
        self._new_run()
        if self.config.disabled:
            self.host.info(
                f"guardtrain: {DISABLE_ENV} is set; {self.host.owner} does nothing "
                "(the model is not compiled)."
            )
            return
        _versions.warn_if_untested(self.host.warn)
        path = self.config.compile_cache
        if path is not None and self.compile_cache is None:  # before anything compiles
            self.compile_cache = warmstart.load(path, self.host, self.config.compile_kwargs)
        self.machine.collective = world_size > 1
        self.run.rank = rank if self.machine.collective else None
        lv = self.levers
        swapper = swaps_parameters or sharded_by_hand
        self.run.swaps_parameters = swapper
        if lv.install_free_tensors and swapper is not None:
            # FSDP gathers and frees the full parameters around every forward, and
            # install_free_tensors bakes the parameter objects into the graph (H3).
            lv.install_free_tensors = False
            self._switch_off(
                "install_free_tensors",
                f"{swapper} swaps parameters around every forward, "
                "and install_free_tensors freezes parameter identity in the graph",
            )
        self._resolve_dict_tags()
        dynamo_cfg = torch._dynamo.config
        if lv.install_free_tensors and not hasattr(dynamo_cfg, "install_free_tensors"):
            lv.install_free_tensors = False
            self._switch_off(
                "install_free_tensors", f"needs torch>=2.8 (installed {torch.__version__})"
            )
        if lv.use_stance and "skip_guard_eval_unsafe" not in _parameters(torch.compiler.set_stance):
            lv.use_stance = False
            self._switch_off("use_stance", f"needs torch>=2.6 (installed {torch.__version__})")
        self.machine.use_stance = lv.use_stance
        if lv.direct_dispatch:
            why = None
            if not lv.use_stance:
                why = "the stance is off"
            elif self.config.guard_collectives and world_size > 1:
                why = (
                    "guard_collectives=True: a rank whose call took the normal path would "
                    "issue a guard collective that ranks running directly never match"
                )
            elif swaps_parameters is not None:
                why = (
                    f"{swaps_parameters} gathers and frees parameters around every forward "
                    "(FSDP): a directly run entry would bypass its hooks' expectations"
                )
            elif not direct_supported():
                why = f"torch {torch.__version__} lacks Dynamo's cache-entry and guard APIs"
            if why is not None:
                lv.direct_dispatch = False
                self.run.direct_refused = why
                self.host.warn(f"guardtrain: direct dispatch (turbo) is refused: {why}.")
        spec = self.config.filter_spec
        resolved = _filters.resolve(spec)
        if resolved is None and spec not in (None, "keep_all"):
            self.run.switched_off.append(
                {"lever": "guard_filter", "why": f"{spec!r} is not in this torch"}
            )
        if resolved is not None and not self.config.unsafe_drop_floor:
            resolved = _filters.with_floor(resolved)
        lv.guard_filter = resolved

    def _resolve_dict_tags(self) -> None:
        """Recursive dict tags (H22): None leaves torch's default; a bool from the user sets it."""
        cfg = torch._dynamo.config
        explicit = self.config.levers.recursive_dict_tags
        has_lever = hasattr(cfg, "use_recursive_dict_tags_for_guards")
        default = bool(getattr(cfg, "use_recursive_dict_tags_for_guards", False))
        release = torch.__version__.split("+")[0]
        if explicit and not has_lever:
            self.levers.recursive_dict_tags = False
            self._switch_off(
                "recursive_dict_tags", f"needs torch>=2.9 (installed {torch.__version__})"
            )
        else:
            # torch 2.10 and 2.11 default to True without the segfault fixes (H36).
            risky = _versions.risky_dict_tags_default()
            self._dict_tags_overridden = explicit is None and risky
            on = (default and not risky) if explicit is None else explicit
            self.levers.recursive_dict_tags = on
            if on and (not default or risky) and not self._dict_tags_warned:
                self._dict_tags_warned = True
                self.host.warn(_versions.dict_tags_warning(release, default))
        if not self.levers.recursive_dict_tags and not self._dict_tags_told:
            self._dict_tags_told = True
            if self._dict_tags_overridden:
                why = _versions.dict_tags_override_reason(release)
            elif explicit is None:
                why = (
                    f"torch {release}'s default; PyTorch switched them off after "
                    "segfaults, pytorch/pytorch#181873"
                )
            elif explicit:
                why = f"not in torch {release}"
            else:
                why = "recursive_dict_tags=False"
            self.host.info(f"guardtrain: recursive dict tags are off ({why}).")

    def config_values(self) -> dict[str, Any]:
        """The ``torch._dynamo.config`` values a run sets (after :meth:`setup`).

        Only an explicit ``recursive_dict_tags`` that this torch has (H22); every
        other lever is applied per target or per call.
        """
        explicit = self.config.levers.recursive_dict_tags
        if explicit is not None and self.levers.recursive_dict_tags == explicit:
            return {"use_recursive_dict_tags_for_guards": explicit}
        if self._dict_tags_overridden:
            return {"use_recursive_dict_tags_for_guards": False}
        return {}

    def activate(
        self,
        root: nn.Module,
        host: Host | None = None,
        root_by_default: bool = False,
        default_targets: list[str] | None = None,
    ) -> None:
        """Compile the targets in ``root`` in place (once per run; a no-op when active).

        ``root_by_default``: with ``targets=None`` compile ``root`` itself, not the
        one child with parameters (the LightningModule rule, H15).
        ``default_targets``: with ``targets=None`` compile these names instead (the
        adapter's own default, e.g. a Hugging Face model's base model and head); a
        default target that breaks the graph is still split into its parts (H20).

        Raises:
            GuardTrainRuntimeError: the unsafe stance is already set.
        """
        if self.run.active or self.config.disabled:
            return
        if host is not None:
            self.host = host
            self.session.owner = host.owner
        self.session.begin()
        cfg = torch._dynamo.config
        for key, value in self.config_values().items():
            if getattr(cfg, key, value) != value:
                self.session.set_config(key, value)
        run = self.run
        run.active = True
        self._ran = True
        try:
            names = self.config.targets
            if names is None and default_targets is not None:
                names = list(default_targets)
            elif names is None and root_by_default:
                names = [""]
            resolved = resolve_targets(root, names)
            run.takeover = take_over_compiled(root, resolved)
            self._tell_take_over(run.takeover.names)
            ift = self.levers.install_free_tensors
            kept = {(t.name, id(t.module)): t for t in self.kept if t.requested_free_tensors == ift}
            if all((name, id(module)) in kept for name, module in resolved):
                # A later run on the same modules: same code, same Dynamo cache (H28).
                for name, module in resolved:
                    target = kept[(name, id(module))]
                    target.install()
                    target.retry_eagerly = self._paired()
                    target.direct_calls = 0  # counted in `restored`
                    self._allow_direct(target)
                    run.targets.append(target)
            else:
                run.targets = self._make_targets(resolved)
            run.target_names = [self._label(t) for t in run.targets]
            self.kept = list(run.targets)
        except BaseException:
            self.restore()
            raise

    def _make_targets(self, parts: list[tuple[str, nn.Module]]) -> list[CompiledTarget]:
        """Compile ``parts`` in place; instances of one class and structure share code (H24)."""
        made: list[CompiledTarget] = []
        groups = share_groups([module for _, module in parts])
        for i, (name, module) in enumerate(parts):
            leader = groups[i]
            made.append(
                CompiledTarget(
                    name,
                    module,
                    self.config.compile_kwargs,
                    self.levers.guard_filter,
                    self.levers.install_free_tensors,
                    on_compile=self._on_compile,
                    on_miss=self._on_miss,
                    on_switch_off=self._on_switch_off,
                    share_with=made[leader] if leader is not None and leader != i else None,
                    shared=leader == i,
                    on_change=self._on_change,
                )
            )
            made[-1].retry_eagerly = self._paired()
            self._allow_direct(made[-1])
        return made

    def _allow_direct(self, target: CompiledTarget) -> None:
        """Whether ``target`` may run harvested entries directly (turbo, H30)."""
        target.direct_allowed = False
        if not self.levers.direct_dispatch:
            return
        sharded = _fully_sharded(target.module)
        if sharded is not None:
            self.run.direct_refused_targets.append(
                {
                    "target": self._label(target),
                    "why": f"{sharded} is sharded with FSDP's fully_shard: its parameters "
                    "are gathered and freed around every forward",
                }
            )
            return
        target.direct_allowed = True

    def _tell_take_over(self, names: list[str]) -> None:
        """One warning when the user's own compiles are taken over (once per change)."""
        self.run.took_over = list(names)
        if names and names != self._took_over_told:
            self.host.warn(
                f"guardtrain: took over the compile of {', '.join(names)}: {self.host.owner} "
                "compiles the original module once itself (state_dict keys stay as they are); "
                "drop your own torch.compile call to silence this."
            )
        self._took_over_told = list(names)

    def restore(self) -> None:
        """Put back everything the run changed: stance, config, ``forward`` attributes."""
        run = self.run
        if not run.active:
            return
        run.active = False
        self._stop_window()
        self._stop_checking()
        self._set_stance(False)
        self.session.restore()
        for target in run.targets:
            target.uninstall()
        run.targets = []
        if run.takeover is not None:
            run.takeover.restore()
            run.takeover = None

    def gather_rearms(self) -> None:
        """With several processes, collect every rank's re-arms for rank zero's summary."""
        if not self.machine.collective or self.config.disabled:
            return
        gathered = self.host.agreement.gather(list(self.machine.rearms))
        merged = [r for rank_rearms in gathered for r in (rank_rearms or [])]
        self.run.all_rearms = sorted(merged, key=lambda r: (r["step"], r.get("rank", 0)))

    def finish(self) -> None:
        """End the run: name targets that ran uncompiled, restore, save the compile cache
        (rank zero, ``compile_cache=``), log the summary once."""
        idle = [
            self._label(t)
            for t in self.run.targets
            if t.compiles == 0 or (t.calls and t.cache_entries() == 0)
        ]
        if idle:
            self.run.uncompiled = idle
            self.host.warn(
                f"guardtrain: target(s) {idle} ran uncompiled all run: their `forward` was "
                "never called through the module (check `targets`), or Dynamo skipped it."
            )
        self.restore()
        if self.compile_cache is not None:
            warmstart.save(self.compile_cache, self.host, self.host.agreement.rank)
        if not self.run.summary_logged and not self.config.disabled:
            self.run.summary_logged = True
            self.host.info(self.format_summary())

    # -- the stance and re-arms --------------------------------------------------------------

    def _label(self, target: CompiledTarget) -> str:
        return target.name or self.host.root_label

    def _set_stance(self, on: bool) -> None:
        if self.session.set_stance(on):
            for target in self.run.targets:
                target.set_fast(on)

    def _switch_off(self, lever: str, why: str) -> None:
        self.run.switched_off.append({"lever": lever, "why": why})
        self.host.warn(f"guardtrain: {lever} is switched off: {why}")

    def _paired(self) -> bool:
        """Ranks must act together: guard collectives pair every compiled call across ranks."""
        return self.config.guard_collectives and self.machine.collective

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` on any rank (one collective when calls are paired), else this rank's."""
        if self._paired():
            return self.host.agreement.any(flag)
        return flag

    def _rearm(self, loop: str | None, reason: str) -> None:
        run = self.run
        run.changes += 1
        if run.measure is not None and loop in (None, TRAIN):
            self._stop_window()  # measured again at the next entry
        self._set_stance(False)
        self.machine.rearm(loop, step=self.train_batches(), reason=reason, rank=run.rank)

    def _rebuild(self, target: CompiledTarget, reason: str) -> None:
        """Forget every compiled entry of ``target`` and send every loop back to warm-up."""
        target.reference = None
        target.rebuild()
        self._rearm(None, f"{self._label(target)}: {reason}; recompiling")

    def _on_compile(self, target: CompiledTarget, reason: str | None) -> None:
        self.run.changes += 1
        self.monitor.record(self.train_batches(), target.name, reason)

    def _on_switch_off(self, target: CompiledTarget, why: str) -> None:
        self._switch_off(f"install_free_tensors for {self._label(target)!r}", why)

    def _start_checking(self, described: str) -> None:
        self.run.checking = described
        for target in self.run.targets:
            target.checking = True

    def _stop_checking(self) -> None:
        self.run.checking = None
        for target in self.run.targets:
            target.checking = False
            self.run.checked_calls += target.checks
            target.checks = 0

    def _caught(self, kind: Change, reason: str) -> None:
        """Count a change caught before a call; log the first of each kind."""
        if self.run.caught.add(kind, reason):
            self.host.info(f"guardtrain: caught a change of {kind.value} before a call: {reason}")

    def _on_change(self, target: CompiledTarget, note: str) -> None:
        """Before a call of ``target``: ``note`` says something it reads may have changed."""
        run = self.run
        if not run.active:
            return
        if self._paired():
            # A rebuild or a miss on one rank alone would break the pairing of guard
            # collectives, and so would a boundary check that only this rank runs: the
            # change waits for the next boundary or audit, which every rank runs together.
            return
        found = decide(target, target.fast)
        if found is None:
            return
        action, kind, reason = found
        if kind is Change.PARAMETERS and run.swaps_parameters and not target.install_free_tensors:
            # FSDP swaps the parameter objects around every forward by design; without
            # install_free_tensors they are graph inputs, read afresh by every call.
            target.reference = None  # taken again after the next compile
            return
        self._caught(kind, f"{self._label(target)}: {reason} ({note})")
        if action is Action.LEAVE:
            self._stop_checking()
            self._rearm(run.loop, f"{self._label(target)}: {reason}")
        else:
            self._rebuild_or_leave_shared(target, reason)

    def _on_miss(self, target: CompiledTarget, reason: str) -> bool:
        if reason is UNSEEN_ARGUMENTS:
            reason = f"{self._label(target)}: {reason}"
            self._caught(Change.ARGUMENTS, reason)
            self._stop_checking()
            self._rearm(self.run.loop, reason)
            return not target.graph_breaks
        if reason.endswith(f"; {UNACCEPTED}"):
            # A change seen before the call (H33): the stance's entry does not accept it.
            reason = f"{self._label(target)}: {reason.removesuffix(f'; {UNACCEPTED}')}"
            reason += ": no compiled entry that the stance would run accepts the call"
            written = "its guards read was written" in reason
            self._caught(Change.GLOBALS if written else Change.MODULE_STATE, reason)
            self._stop_checking()
            self._rearm(self.run.loop, reason)
            return not target.graph_breaks
        if reason is UNACCEPTED and self.run.checking is None:
            # Turbo checks every call it would run directly (H30), not only unseen batches.
            reason = (
                f"direct dispatch: no compiled entry of {self._label(target)!r} accepts a "
                "call with full guards"
            )
        elif reason is UNACCEPTED:
            reason = (
                f"unseen batch signature {self.run.checking}: no compiled entry of "
                f"{self._label(target)!r} accepts its inputs"
            )
        else:
            if self._paired():
                reason += " (here or on another rank: guard collectives share misses)"
            reason = f"stance miss in {self._label(target)!r}: {reason}"
        self._stop_checking()
        self._rearm(self.run.loop, reason)
        return not target.graph_breaks  # never in the stance with graph breaks (blocker)

    def _decide(self, loop: str) -> None:
        """Enter the stance for ``loop`` if this process (or, with several, every one) is ready.

        The only place entry is decided. With several processes it runs at the
        same batches on every rank and costs one collective.
        """
        m, run = self.machine, self.run
        ready = m.ready(loop)
        if not ready and not m.collective:
            return
        limit = getattr(torch._dynamo.config, "recompile_limit", 8)
        blocked = decisions.blocker(run.targets, limit, self.host.root_label) if ready else None
        vote = (ready and blocked is None) or m.steady(loop)
        if m.collective:
            vote = self.host.agreement.all(vote)
        if m.collective and vote and loop == TRAIN:
            run.entered_together = True
        if ready and blocked is None and vote:
            run.changes += 1
            m.enter(loop)
            measure = (
                self.config.measure_lookup
                if self.config.measure_lookup is not None
                else not m.collective
            )
            # Not with paired calls: the window's batches would shift this rank's audits.
            # Not under turbo: steady calls skip Dynamo's entry path, which the window profiles.
            if (
                loop == TRAIN
                and measure
                and not self._paired()
                and not self.levers.direct_dispatch
                and "steady" not in run.lookup
            ):
                run.measure, run.measure_left = "full", self.config.lookup_window
        elif blocked is not None and run.stance_blocked is None:
            run.changes += 1
            run.stance_blocked = blocked
            self.host.warn(f"guardtrain: the stance stays off: {blocked}.")

    # -- loops -------------------------------------------------------------------------------

    def loop_start(self, loop: str) -> None:
        """A pass of ``loop`` starts: leave the stance; the first batch re-checks the model."""
        run = self.run
        if not run.active:
            return
        self._set_stance(False)
        self._stop_checking()
        run.loop = loop
        run.pending.add(loop)
        self.machine.pass_started(loop)
        if loop != TRAIN and run.window is not None:
            # A window counts every compiled call: this loop's must not count as
            # training's (H27). Close it on the training batches it has measured.
            self._close_window(self.config.lookup_window - run.measure_left)

    def batch_start(
        self, loop: str, batch: Any, training: bool, warmed_training: bool | None = None
    ) -> None:
        """Checks before a batch; sets the stance for it.

        Args:
            loop: the loop the batch belongs to.
            batch: the batch (its signature is compared with those seen).
            training: the model's ``training`` flag now.
            warmed_training: the flag the loop warmed up with (None: the
                Trainer's rule, ``True`` in training only).
        """
        run = self.run
        if not run.active:
            return
        run.loop = loop
        if loop in run.pending:
            run.pending.discard(loop)
            self._boundary_check(loop)
        m = self.machine
        if m.use_stance:
            state = m.loops[loop]
            steady = state.phase == STEADY
            check = None
            same = run.same_signature.get(loop)
            if same is not None and same.signature is state.last_signature and same.matches(batch):
                unseen = False  # the previous batch's signature (most batches)
            else:
                signature = batch_signature(batch)
                last = state.last_signature
                unseen = m.new_signature(loop, signature)
                if state.last_signature is last:
                    # The previous batch's signature again: recognise the next one fast.
                    # Not after a change, so that shapes that vary from batch to batch
                    # (H26) pay nothing for a matcher they would never use.
                    run.same_signature[loop] = SameSignature.of(batch, last, same)
            if steady and (
                unseen
                or training is not ((loop == TRAIN) if warmed_training is None else warmed_training)
            ):
                reason = decisions.leave_reason(loop, None, training, warmed_training)
                if reason is None and unseen:
                    described = describe_signature(signature)
                    if self._paired():
                        # One batch with full guards (H26): if it compiles nothing, the
                        # loop's cache serves this signature and the stance resumes.
                        reason = f"unseen batch signature {described}"
                        run.probe = loop
                    else:
                        check = described
                if reason is not None:
                    self._rearm(loop, reason)
                    steady = False
            if loop == TRAIN:
                if run.measure is not None and steady:
                    steady = self._measure_batch()
                elif state.batches >= run.next_check:
                    steady = self._audit_or_verify(steady)
                if self.config.guard_collectives:
                    self.session.set_guard_collectives(self._paired() and run.entered_together)
            elif steady and self.host.sanity_checking():
                steady = False
            if steady is not self.session.stance_on:
                self._set_stance(steady)
            if check is not None and steady:
                # The stance stays; each call first shows that an entry's guards
                # accept its inputs, or leaves the stance before it runs (H26).
                self._start_checking(check)
        run.stance_at_start = self.session.stance_on
        run.compiles_at_batch = self.monitor.compiles

    def batch_end(self, loop: str) -> None:
        """Count the batch's compiles; decide entry at decision points."""
        run, m = self.run, self.machine
        if not run.active:
            return
        compiled = self.monitor.compiles != run.compiles_at_batch
        if run.checking is not None:
            if not compiled and m.loops[loop].phase == STEADY:
                run.checked_batches += 1
            self._stop_checking()
        if run.audit_batch or run.verify_batch:
            self._end_audit_or_verify(compiled)
        if run.window is not None and loop == TRAIN:
            self._end_measure_batch()
        state = m.loops[loop]
        if (
            not compiled
            and loop == TRAIN
            and state.phase == STEADY
            and state.warmed_once
            and m.use_stance
        ):
            # PhaseMachine.batch_done for a steady training batch that compiled nothing,
            # without the call (the per-step path). A steady step is one that ran under
            # the stance (not a lookup window's batch with full guards, nor one that
            # left the stance).
            state.batches += 1
            state.since_compile += 1
            if run.stance_at_start and self.session.stance_on:
                m.steady_steps += 1
        else:
            m.batch_done(loop, compiled, run.stance_at_start and self.session.stance_on)
        if compiled:
            self._after_compile()
        if run.probe is not None:
            if run.probe == loop and not compiled and m.loops[loop].phase != STEADY:
                # A rank may resume alone: its own cache served the batch.
                run.changes += 1
                m.enter(loop)
            run.probe = None
        if loop == TRAIN:
            if (
                m.use_stance
                and (m.collective or state.phase != STEADY)
                and m.is_decision_point(loop)
            ):
                self._decide(loop)
            if run.logged_changes != run.changes:
                self._log_changes()

    def loop_end(self, loop: str, complete: bool = True) -> None:
        """A pass of ``loop`` ended (``complete`` is False for a sanity check or a cut pass)."""
        run, m = self.run, self.machine
        if not run.active:
            return
        self._set_stance(False)
        self.session.set_guard_collectives(False)
        m.pass_done(loop, complete)
        if loop != TRAIN and m.use_stance:
            self._decide(loop)
        run.pending.add(TRAIN)
        run.loop = None

    # -- lookup windows ----------------------------------------------------------------------

    def _measure_batch(self) -> bool:
        """One batch of a lookup window; returns whether it runs under the stance."""
        run = self.run
        if run.window is None:
            from guardtrain.overhead import LookupWindow

            run.window = LookupWindow()
            if not run.window.start():  # another profiler is running: do not disturb it
                run.window = None
                run.measure = None
                return True
        if run.measure == "full":
            run.audit_batch = True  # a compile with full guards here re-arms, as in an audit
            return False
        return True

    def _end_measure_batch(self) -> None:
        run = self.run
        run.measure_left -= 1
        if run.measure_left > 0 or run.window is None:
            return
        self._close_window(self.config.lookup_window)

    def _close_window(self, steps: int) -> None:
        """Stop the window after ``steps`` training batches and record what it measured."""
        run = self.run
        stats = run.window.stop(calls=max(steps, 1))
        run.window = None
        if stats is None or steps < 1:
            run.measure = None
            return
        per_step = (stats.guard_us_per_call or 0.0) + (stats.pregraph_us_per_call or 0.0)
        which = "full_guards" if run.measure == "full" else "steady"
        run.lookup_calls[which] = {"steps": steps, "lookups": stats.lookups}
        if run.measure == "full":
            run.lookup["full_guards"] = per_step
            run.measure, run.measure_left = "steady", self.config.lookup_window
            return
        run.lookup["steady"] = per_step
        full = run.lookup.get("full_guards")
        if full:
            run.lookup["saving"] = 1.0 - per_step / full
        run.measure = None
        run.changes += 1  # log guard/lookup_us

    def _stop_window(self) -> None:
        run = self.run
        if run.window is not None:
            run.window.stop()
            run.window = None
        run.measure = None

    # -- audits and verify batches -----------------------------------------------------------

    def _audit_or_verify(self, steady: bool) -> bool:
        """Start an audit or a verify batch when one is due; return whether to use the stance."""
        run, cfg = self.run, self.config
        batches = self.machine.loops[TRAIN].batches
        run.next_check = decisions.next_check(batches, cfg.audit_every, cfg.verify_every)
        due = decisions.due_check(batches, cfg.audit_every, cfg.verify_every)
        if due == decisions.CHECK_AUDIT:
            self._boundary_check(TRAIN)
            if steady and self.machine.steady(TRAIN):
                run.audit_batch = True
            return False
        if due == decisions.CHECK_VERIFY:
            run.verify_batch = True
            if steady:
                for target in run.targets:
                    target.start_verify(cfg.verify_rtol, cfg.verify_atol)
        return steady

    def _end_audit_or_verify(self, compiled: bool) -> None:
        run = self.run
        if run.audit_batch:
            run.audit_batch = False
            if compiled:
                event = self.monitor.events[-1] if self.monitor.events else {}
                self._rearm(
                    TRAIN,
                    f"audit batch compiled with full guards ({event.get('reason', 'unknown')}): "
                    "the stance was running code whose guards no longer held",
                )
        if run.verify_batch:
            run.verify_batch = False
            found = [(t, t.stop_verify()) for t in run.targets]
            found = [(t, mismatch) for t, mismatch in found if mismatch is not None]
            for target, mismatch in found:
                self.host.warn(
                    f"guardtrain: verify: compiled {self._label(target)!r} differs from eager: "
                    f"{mismatch}. Rebuilding it; please report this with the re-arm history."
                )
            if self._any_rank(bool(found)) and not found:
                found = [(t, "on another rank") for t in run.targets]
            for target, mismatch in found:
                self._rebuild(target, f"verify found a difference from eager ({mismatch})")

    # -- state checks ------------------------------------------------------------------------

    def _after_compile(self) -> None:
        """Once per batch that compiled: fingerprints, and no free tensors across graph breaks.

        A default target (``targets=None``) that breaks the graph is replaced by its
        parts (H20), which may break again and be split further. Warnings and the
        summary name each break by Dynamo's reason, file and line.
        """
        found = self._new_break_reasons()
        for target in list(self.run.targets):
            forward = getattr(target, "_func", None)
            mine = _breaks.entered(found, forward)
            if mine and not target.graph_breaks and _breaks.skipped_at_top(forward):
                # The break was at the call into a `forward` that Dynamo never compiles
                # as a frame of its own (torch's modules, `nn.Transformer`): it ran
                # uncompiled, and no resume frame showed the break (H20).
                target.graph_breaks = True
            if not target.graph_breaks:
                if target.reference is None:
                    target.reference = module_fingerprint(target.module)
                continue
            mine = mine or found
            if self.config.targets is None and self._split(target, mine):
                continue
            if target.install_free_tensors or target.drops_guards:
                # The frames after a graph break run the module's own `forward`,
                # whose code other instances share (install_free_tensors there is
                # H12), and their guards name the frame's locals, which the
                # boundary re-check cannot evaluate: keep every guard there.
                target.install_free_tensors = False
                target.drops_guards = False
                parts = [name for name, _ in _regions(target.name, target.module)]
                hint = f"; to use the stance, compile its parts: targets={parts}" if parts else ""
                self._switch_off(
                    f"install_free_tensors and the guard filter for {self._label(target)!r}",
                    f"it has graph breaks ({_breaks.describe(mine) or 'reason unknown'}): "
                    "the frames after a break run code shared by every instance of its class, "
                    f"and their dropped guards cannot be re-checked{hint}",
                )
                self._rebuild(target, "graph breaks: full guards, no install_free_tensors")
            elif target.reference is None:
                target.reference = module_fingerprint(target.module)

    def _new_break_reasons(self) -> list[_breaks.GraphBreak]:
        """Dynamo's graph breaks since the last call: reason (first line), file and line."""
        return self.run.break_log.new()

    def _split(self, target: CompiledTarget, found: list[_breaks.GraphBreak]) -> bool:
        """Compile the parts of a breaking default target instead of it; False if it has none."""
        parts = _regions(target.name, target.module)
        if not parts:
            return False
        run = self.run
        text = _breaks.describe(found) or "reason unknown"
        label = self._label(target)
        if not target.detach():  # the last user of its code (the others split in this pass)
            target.rebuild()  # forget its entries, resume functions included
        target.uninstall()
        run.direct_calls += target.direct_calls
        target.direct_calls = 0
        run.full_guard_calls += target.full_guard_calls
        target.full_guard_calls = 0
        index = run.targets.index(target)
        made = self._make_targets(parts)
        run.targets[index : index + 1] = made
        run.target_names = [self._label(t) for t in run.targets]
        self.kept = list(run.targets)
        names = [name for name, _ in parts]
        run.graph_breaks.append(
            {
                "target": label,
                "reason": "; ".join(b.reason for b in found) or "unknown",
                "where": "; ".join(b.where for b in found if b.where),
                "regions": names,
            }
        )
        self.host.warn(
            f"guardtrain: {label!r} breaks the graph ({text}); compiling its parts instead: "
            f"{names}. Pass `targets=` to choose the regions yourself."
        )
        self._rearm(None, f"{label}: graph break ({text}); compiling {names}")
        return True

    def _boundary_check(self, loop: str) -> None:
        rebuild: list[tuple[CompiledTarget, str]] = []
        run = self.run
        for target in run.targets:
            label = self._label(target)
            if target.calls and target.cache_entries() == 0 and label not in run.skipped:
                # Dynamo marked the code skipped, e.g. after a call under a dispatch
                # mode that guardtrain did not see (H18): a fresh code object compiles.
                run.skipped.append(label)
                rebuild.append((target, "Dynamo skipped its code, it ran uncompiled"))
                continue
            change = None
            if target.reference is not None:
                change = fingerprint_change(target.reference, module_fingerprint(target.module))
            stale, unmatched = target.check_assertions()
            if change is None and stale is not None:
                change = f"{stale} (a guard that was dropped or skipped)"
            if change is not None:
                rebuild.append((target, change))
            elif unmatched is not None and self.machine.steady(loop):
                self._rearm(loop, f"{label}: {unmatched}")
        # A rebuilt target has no entries, so its first call issues no guard
        # collective: with paired calls every rank rebuilds together.
        if self._any_rank(bool(rebuild)) and not rebuild:
            rebuild = [(t, "another rank rebuilt its targets") for t in run.targets]
        rebuilt: set[int] = set()
        for target, change in rebuild:
            drifted = target.shared and len(target.c.members) > 1 and target.drifted()
            if drifted or id(target.c) not in rebuilt:  # shared code is rebuilt once
                if not drifted:
                    rebuilt.add(id(target.c))
                self._rebuild_or_leave_shared(target, change)

    def _rebuild_or_leave_shared(self, target: CompiledTarget, change: str) -> None:
        if target.shared and len(target.c.members) > 1 and target.drifted():
            # Only this member changed its structure: it leaves the shared code,
            # whose entries stay right for the others (H24).
            target.leave_shared_code(f"{change}: it no longer has its group's structure")
            self._rearm(None, f"{self._label(target)}: {change}; compiling it alone")
        else:
            self._rebuild(target, change)

    # -- metrics -----------------------------------------------------------------------------

    def _log_changes(self) -> None:
        run = self.run
        run.logged_changes = run.changes
        if not self.config.log_metrics or self.host.log_metrics is None:
            return
        current = (self.phase, self.monitor.compiles, len(self.machine.rearms))
        key = (report.PHASE_NUMBERS[current[0]], current[1], current[2])
        if key == run.logged and ("steady" not in run.lookup or run.lookup_logged):
            return
        run.logged = key
        if self.host.agreement.rank != 0:
            return
        values = report.metrics(*current)
        if "steady" in run.lookup and not run.lookup_logged:
            run.lookup_logged = True
            values["guard/lookup_us"] = run.lookup["steady"]
        self.host.log_metrics(values, self.train_batches())


def _every_target_refused(targets: list[str], refusals: list[dict[str, str]]) -> bool:
    """Whether direct dispatch refused each of ``targets`` (so no call can run directly)."""
    refused = {r["target"] for r in refusals}
    return bool(targets) and all(t in refused for t in targets)


def _fully_sharded(module: nn.Module) -> str | None:
    """The name of a module in ``module`` that FSDP2's ``fully_shard`` wrapped, or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without it
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            return type(sub).__name__ + (f" ({name})" if name else "")
    return None


def _regions(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The parts of ``module`` to compile instead of it: each child with parameters and a
    ``forward``; a container without one (``ModuleList``) gives its children."""
    parts: list[tuple[str, nn.Module]] = []
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if next(child.parameters(), None) is None:
            continue
        if type(child).forward is nn.Module.forward:
            parts.extend(_regions(full, child))
        else:
            parts.append((full, child))
    return parts
