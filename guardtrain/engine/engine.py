"""GuardEngine: one run's lifecycle, loops and batches, and its decisions, for every adapter.

An adapter (the Lightning callback, ``GuardTuner``, the bench) tells the engine
where the run is, and nothing else:

* :meth:`GuardEngine.setup` once per run, :meth:`GuardEngine.activate` when the
  model is placed (targets are compiled in place), :meth:`GuardEngine.finish`
  at the end (everything restored, the summary logged once);
* :meth:`GuardEngine.loop_start` / :meth:`GuardEngine.loop_end` around each
  pass of a loop, :meth:`GuardEngine.batch_start` / :meth:`GuardEngine.batch_end`
  around each batch.

The engine coordinates its rooms and is the only one that acts: it re-arms,
rebuilds, enters the stance and leaves it. The levers come from
:mod:`~guardtrain.engine.levers`, the targets live in a
:class:`~guardtrain.engine.targets.TargetSet`, the checks
(:mod:`~guardtrain.engine.checks`) return findings, and
:mod:`~guardtrain.engine.summary` reports. The engine imports no Lightning: it
talks to the outside through a :class:`~guardtrain.engine.host.Host`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from guardtrain import versions as _versions
from guardtrain.engine import levers as _levers
from guardtrain.engine import runs as _runs
from guardtrain.engine import summary, warmstart
from guardtrain.engine.checks import Checks
from guardtrain.engine.config import DISABLE_ENV, GuardConfig
from guardtrain.engine.host import Host
from guardtrain.engine.lookup import LookupWindows
from guardtrain.engine.phases import Phase, PhaseMachine
from guardtrain.engine.reactions import STEADY, TRAIN, Reactions, RunState
from guardtrain.engine.session import StanceSession
from guardtrain.engine.targets import Hooks, TargetSet
from guardtrain.profiling import CompileMonitor

__all__ = ["GuardEngine"]


class GuardEngine(Reactions):
    """One adapter's runs: compiled targets, phases, checks, the stance and the report.

    Args:
        config: the validated arguments (:func:`~guardtrain.engine.config.make_config`).
        host: messages, metrics and rank agreement; an adapter may replace it
            per run (:meth:`activate`).
    """

    def __init__(self, config: GuardConfig, host: Host | None = None) -> None:
        self.config = config
        """This run's arguments: the adapter's, with :meth:`setup`'s ``compile_kwargs``."""
        self._arguments = config
        self.host = host or Host()
        self.restored: dict[str, Any] = {}
        """Counters of earlier runs (a checkpoint, or earlier trainer calls)."""
        self.compile_cache: dict[str, Any] | None = None
        """The warm start's state (``compile_cache=``), loaded once per engine."""
        self._dict_tags = _levers.DictTagsNotes()
        self._ran = False
        self._held = _Held(self)
        hooks = Hooks(self._on_compile, self._on_miss, self._on_switch_off, self._on_change)
        self.levers = _levers.requested(config)
        self.targets = TargetSet(config, self.levers, hooks)
        self._new_run()

    def _new_run(self) -> None:
        lv = self.config.levers
        self.machine = PhaseMachine(lv.warmup_steps, lv.stable_steps, lv.use_stance)
        self.monitor = CompileMonitor()
        self.session = StanceSession(self.host.owner)
        self.levers = _levers.requested(self.config)
        self.targets = self.targets.next_run(self.config, self.levers)
        self.checks = Checks()
        self.lookup = LookupWindows()
        self.metrics = summary.MetricsLog()
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

    def summary(self) -> dict[str, Any]:
        """Counters and history of the runs so far, as a plain dict."""
        return summary.build(self)

    def format_summary(self) -> str:
        return summary.format_summary(self.summary())

    def state_dict(self) -> dict[str, Any]:
        return summary.state_dict(self.summary(), self.train_batches())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = summary.loaded(state_dict)

    def config_values(self) -> dict[str, Any]:
        """The ``torch._dynamo.config`` values a run sets (after :meth:`setup`)."""
        return _levers.config_values(self.config, self.levers, self._dict_tags)

    # -- a run -------------------------------------------------------------------------------

    def setup(
        self,
        *,
        world_size: int = 1,
        rank: int = 0,
        swaps_parameters: str | None = None,
        sharded_by_hand: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        took_over: list[str] | None = None,
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
            compile_kwargs: this run's compile options, if not the arguments' (H38).
            took_over: the compiles the adapter took over for this run (the summary's
                ``took_over`` lists them first).
        """
        self.restore()  # this engine's run that ended without its events (H45)
        _runs.release_dead_runs(self._held, self.host)  # dead runs put their config back
        self.config = self._arguments.for_run(compile_kwargs)
        if self._ran:  # a later run: the summary goes on from the earlier ones
            self.restored = summary.carried(self.summary(), self.train_batches())
            self._ran = False
        self._new_run()
        self.targets.adapter_took_over = list(took_over or ())
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
        self.run.swaps_parameters = swaps_parameters or sharded_by_hand
        _levers.resolve(
            self.levers,
            self.config,
            self.host,
            self._dict_tags,
            world_size=world_size,
            swaps_parameters=swaps_parameters,
            sharded_by_hand=sharded_by_hand,
        )
        self.machine.use_stance = self.levers.use_stance

    def activate(
        self,
        root: nn.Module,
        host: Host | None = None,
        root_by_default: bool = False,
        default_targets: list[str] | None = None,
    ) -> None:
        """Compile the targets in ``root`` in place (once per run; a no-op when active).

        With ``targets=None``: ``default_targets`` names the adapter's own default
        targets (split on graph breaks, H20); else ``root_by_default`` compiles
        ``root`` itself, not the one child with parameters (H15).

        Raises:
            GuardTrainRuntimeError: the unsafe stance is already set, or a live run
                holds a target (a run that is not live is released, H45).
        """
        if self.run.active or self.config.disabled:
            return
        if host is not None:
            self.host = host
            self.session.owner = host.owner
        resolved = self.targets.resolve(root, root_by_default, default_targets)
        _runs.claim(self._held, root, [n for n, _ in resolved], self.host)
        self._begin_session(self.config_values())
        self.run.active = True
        self._ran = True
        try:
            self.targets.activate(root, resolved, self.host, self._paired())
        except BaseException:
            self.restore()
            raise
        _runs.RUNS.hold(self._held)

    def restore(self) -> None:
        """Put back everything the run changed: config, the targets' ``forward``."""
        if not self.run.active:
            return
        self.run.active = False
        _runs.RUNS.drop(self._held)
        self.lookup.stop()
        self._stop_checking()
        self._set_stance(False)
        self.session.restore()
        self.targets.restore()

    def finish(self) -> None:
        """End the run: name targets that ran uncompiled, restore, save the compile cache
        (rank zero, ``compile_cache=``), log the summary once."""
        idle = self.targets.idle(self._label)
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

    # -- loops and batches -------------------------------------------------------------------

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
        if loop != TRAIN and self.lookup.window is not None:
            # A window counts every compiled call: this loop's must not count as
            # training's (H27). Close it on the training batches it has measured.
            size = self.config.lookup_window
            if self.lookup.close(size - self.lookup.measure_left, size):
                run.changes += 1  # log guard/lookup_us

    def batch_start(
        self, loop: str, batch: Any, training: bool, warmed_training: bool | None = None
    ) -> None:
        """Checks before a batch; decides whether its target calls run steady (H41).

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
        self.targets.batch_starts()  # the first call checks what events miss (H42)
        if self.machine.use_stance:
            state = self.machine.loops[loop]
            steady, check = self._signature_and_mode(loop, state, batch, training, warmed_training)
            if loop == TRAIN:
                if self.lookup.measure is not None and steady:
                    steady = self._lookup_batch(check is not None)
                elif state.batches >= self.checks.next_check:
                    steady = self._audit_or_verify(steady, check is not None)
                if self.config.guard_collectives:
                    self.session.set_guard_collectives(self._paired() and run.entered_together)
            elif steady and self.host.sanity_checking():
                steady = False
            if steady is not run.stance_on:
                self._set_stance(steady)
            if check is not None and steady:
                # The stance stays; each call first shows that an entry's guards
                # accept its inputs, or leaves the stance before it runs (H26).
                self._start_checking(check)
        run.stance_at_start = run.stance_on
        run.compiles_at_batch = self.monitor.compiles

    def batch_end(self, loop: str) -> None:
        """Count the batch's compiles; decide entry at decision points."""
        run, m = self.run, self.machine
        if not run.active:
            return
        compiled = self.monitor.compiles != run.compiles_at_batch
        self._end_checks(loop, compiled)
        state = m.loops[loop]
        if (
            not compiled
            and loop == TRAIN
            and state.phase == STEADY
            and state.warmed_once
            and m.use_stance
        ):
            # PhaseMachine.batch_done for a steady training batch that compiled nothing, inline
            # (the per-step path). A steady step ran under the stance throughout (not a
            # lookup window's batch with full guards, nor one that left the stance).
            state.batches += 1
            state.since_compile += 1
            m.steady_steps += run.stance_at_start and run.stance_on  # 1: a steady step
        else:
            m.batch_done(loop, compiled, run.stance_at_start and run.stance_on)
        if compiled:
            self._after_compile()
        if run.probe is not None:
            self._end_probe(loop, compiled)
        if loop == TRAIN:
            if m.collective or state.phase != STEADY:  # steady in one process: no decision
                self._decision_point()
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

    def _log_changes(self) -> None:
        self.run.logged_changes = self.run.changes
        if self.config.log_metrics and self.host.log_metrics is not None:
            current = (self.phase, self.monitor.compiles, len(self.machine.rearms))
            self.metrics.log(self.host, current, self.lookup.lookup, self.train_batches)


class _Held:
    """An engine as the registry of runs sees it (H45): its adapter, the modules it has
    compiled in place, whether its adapter says the run is live, and its release."""

    def __init__(self, engine: GuardEngine) -> None:
        self._engine = engine

    @property
    def owner(self) -> str:
        return self._engine.host.owner

    def held_modules(self) -> list[nn.Module]:
        return [target.module for target in self._engine.targets.installed]

    def live(self) -> bool:
        return self._engine.host.live()

    def described(self) -> str:
        known_as = self._engine.host.known_as
        return ", ".join(known_as(t.name) for t in self._engine.targets.installed)

    def release_dead(self) -> None:
        self._engine.restore()
        self._engine.host.on_release()
