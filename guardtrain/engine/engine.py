"""GuardEngine: one run's lifecycle, loops and batches, for every adapter.

An adapter (the Lightning callback, ``GuardTuner``, the Trainer callback, the bench)
tells the engine where the run is, and reads what it shows:

* :meth:`GuardEngine.setup` once per run, :meth:`GuardEngine.activate` when the
  model is placed (targets are compiled in place), :meth:`GuardEngine.finish`
  at the end (everything restored, the summary logged once);
* :meth:`GuardEngine.loop_start` / :meth:`GuardEngine.loop_end` around each
  pass of a loop, :meth:`GuardEngine.batch_start` / :meth:`GuardEngine.batch_end`
  around each batch;
* what it shows: :attr:`~GuardEngine.active`, :attr:`~GuardEngine.phase`,
  :meth:`~GuardEngine.steady`, :meth:`~GuardEngine.warmed`,
  :attr:`~GuardEngine.rearms`, :attr:`~GuardEngine.stance_blocked`,
  :meth:`~GuardEngine.summary`.

No adapter reads the engine's parts (``run``, its phase machine, its Dynamo settings)
or torch's stance; ``tests/test_contract.py`` walks their code for it. The engine
holds its parts, each given the run's parts (:class:`~guardtrain.engine.run.Run`):
:class:`~guardtrain.engine.batch_checks.BatchChecks` (the checks around a batch, entry),
:class:`~guardtrain.engine.repairs.Repairs` (re-arms, rebuilds, the steady switch, the
answers to the targets' reports), and the run's
:class:`~guardtrain.engine.phases.PhaseMachine`, through which every phase change
goes. The engine imports no Lightning: it talks to the outside through a
:class:`~guardtrain.engine.host.Host`.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from guardtrain import versions as _versions
from guardtrain.engine import holders as _runs
from guardtrain.engine import levers as _levers
from guardtrain.engine import summary, table, warmstart
from guardtrain.engine.batch_checks import STEADY, BatchChecks
from guardtrain.engine.config import DISABLE_ENV, GuardConfig
from guardtrain.engine.counters import Counters
from guardtrain.engine.host import Host
from guardtrain.engine.levers import Levers
from guardtrain.engine.metrics import MetricsLog
from guardtrain.engine.phases import Phase
from guardtrain.engine.repairs import Repairs
from guardtrain.engine.run import TRAIN, Run
from guardtrain.engine.steps import bottom_line, cuda_events, step_metrics
from guardtrain.engine.targets import Hooks, TargetSet

__all__ = ["GuardEngine"]


# The engine's whole contract with its adapters (every entry point and all it shows
# them) stays in one class; the work is done by the parts it holds.
# Lines 401: the contract is its seam.
class GuardEngine:
    """One adapter's runs: compiled targets, phases, checks, the stance and the report.

    Args:
        config: the validated arguments (:func:`~guardtrain.engine.config.make_config`).
        host: messages, metrics and rank agreement; an adapter may replace it
            per run (:meth:`activate`).
    """

    def __init__(self, config: GuardConfig, host: Host | None = None) -> None:
        self._arguments = config
        self.compile_cache: dict[str, Any] | None = None
        """The warm start's state (``compile_cache=``), loaded once per engine."""
        self._dict_tags = _levers.DictTagsNotes()
        self._ran = False
        self._held = _Held(self)
        hooks = Hooks(
            lambda target, why: self._repairs.on_compile(target, why),
            lambda target, miss: self._repairs.on_miss(target, miss),
            lambda target, why: self._repairs.on_switch_off(target, why),
            lambda target, note: self._repairs.on_change(target, note),
        )
        self.run = Run.first(config, host or Host(), hooks)
        """The run's parts (the engine's own: adapters read what the engine shows)."""
        self._repairs = Repairs(self.run)
        self._batches = BatchChecks(self.run, self._repairs)
        self.metrics = MetricsLog()

    # -- what the adapters read -------------------------------------------------------------

    @property
    def config(self) -> GuardConfig:
        """This run's arguments: the adapter's, with :meth:`setup`'s ``compile_kwargs``."""
        return self.run.config

    @property
    def host(self) -> Host:
        """How the engine reaches the adapter (an adapter may set its own per run)."""
        return self.run.host

    @host.setter
    def host(self, host: Host) -> None:
        self.run.host = host
        self.run.dynamo.owner = host.owner

    @property
    def levers(self) -> Levers:
        """The levers this torch and strategy allow (after :meth:`setup`)."""
        return self.run.levers

    @property
    def targets(self) -> TargetSet:
        return self.run.targets

    @property
    def active(self) -> bool:
        """Between :meth:`activate` and :meth:`restore`: the targets are compiled in place."""
        return self.run.state.active

    @property
    def phase(self) -> str:
        """The training loop's phase: ``"warmup"``, ``"steady"``, or ``"off"`` (no stance)."""
        r = self.run
        if r.config.disabled or not r.config.levers.use_stance or r.machine.blocked:
            return Phase.OFF.value
        return str(r.machine.phase(TRAIN))

    def steady(self, loop: str) -> bool:
        """Whether ``loop`` is in its steady phase: its batches run under the stance (or
        directly), but for an audit's, a probe's or a lookup window's batch."""
        return self.run.machine.steady(loop)

    def warmed(self, loop: str) -> bool:
        """Whether ``loop`` has warmed up: steady, or ready to enter at its next decision."""
        m = self.run.machine
        return m.steady(loop) or m.ready(loop)

    @property
    def rearms(self) -> list[dict[str, Any]]:
        """This run's re-arms so far (``step``, ``reason``, ``loop``, ``rank``)."""
        return list(self.run.machine.rearms)

    @property
    def stance_blocked(self) -> str | None:
        """Why the stance stays off for the rest of the run, or None."""
        return self.run.machine.blocked

    def train_batches(self) -> int:
        """Training batches of this run and the earlier ones (a checkpoint's included)."""
        return self.run.train_batches()

    def summary(self) -> dict[str, Any]:
        """Counters and history of the runs so far, as a plain dict."""
        return summary.build(self.run, self.phase, self.compile_cache)

    def format_summary(self) -> str:
        return table.format_summary(self.summary())

    def state_dict(self) -> dict[str, Any]:
        return summary.totals(self.run).saved(self.run.config.preset)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run.earlier = Counters.load(state_dict)

    def config_values(self) -> dict[str, Any]:
        """The Dynamo config values a run sets (after :meth:`setup`)."""
        return _levers.config_values(self.run.config, self.run.levers, self._dict_tags)

    def gather_rearms(self) -> None:
        """With several processes, collect every rank's re-arms for rank zero's summary."""
        r = self.run
        if r.machine.collective and not r.config.disabled:
            gathered = r.host.agreement.gather(list(r.machine.rearms))
            merged = [x for rearms in gathered for x in (rearms or [])]
            r.state.all_rearms = sorted(merged, key=lambda x: (x["step"], x.get("rank", 0)))

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
        r = self.run
        _runs.release_dead_runs(self._held, r.host)  # dead runs put their config back
        r.config = self._arguments.for_run(compile_kwargs)
        if self._ran:  # a later run: the summary goes on from the earlier ones
            r.earlier = summary.totals(r)
            self._ran = False
        r.renew()
        self.metrics = MetricsLog()
        r.targets.adapter_took_over = list(took_over or ())
        if r.config.disabled:
            r.host.info(
                f"guardtrain: {DISABLE_ENV} is set; {r.host.owner} does nothing "
                "(the model is not compiled)."
            )
            return
        _versions.warn_if_untested(r.host.warn)
        path = r.config.compile_cache
        if path is not None and self.compile_cache is None:  # before anything compiles
            self.compile_cache = warmstart.load(path, r.host, r.config.compile_kwargs)
        r.machine.collective = world_size > 1
        r.machine.paired = r.config.guard_collectives and r.machine.collective
        r.state.rank = rank if r.machine.collective else None
        r.state.swaps_parameters = swaps_parameters or sharded_by_hand
        _levers.resolve(
            r.levers,
            r.config,
            r.host,
            self._dict_tags,
            world_size=world_size,
            swaps_parameters=swaps_parameters,
            sharded_by_hand=sharded_by_hand,
        )
        r.machine.use_stance = r.levers.use_stance
        dict_tags, self._dict_tags.off = self._dict_tags.off, None
        auto = table.auto_note(r.levers) if r.config.preset == "auto" else None
        line = table.setup_line([dict_tags, auto])
        if line is not None:
            r.host.info(line)

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
        r = self.run
        if r.state.active or r.config.disabled:
            return
        if host is not None:
            self.host = host
        resolved = r.targets.resolve(root, root_by_default, default_targets)
        _runs.claim(self._held, root, [n for n, _ in resolved], r.host)
        r.dynamo.begin(self.config_values())
        r.monitor.start()
        r.state.active = True
        self._ran = True
        try:
            r.targets.activate(root, resolved, r.host, r.paired())
            r.steps.events = cuda_events(m for _, m in resolved)  # CUDA: device time
        except BaseException:
            self.restore()
            raise
        _runs.RUNS.hold(self._held)

    def pause(self) -> None:
        """Put the run's Dynamo config back until :meth:`resume` (the bench runs several
        configurations in one process and sets each one's only while it runs)."""
        self.run.dynamo.pause()

    def resume(self) -> None:
        """Set the run's Dynamo config again after :meth:`pause`."""
        self.run.dynamo.resume()

    def restore(self) -> None:
        """Put back everything the run changed: config, the targets' ``forward``."""
        r = self.run
        if not r.state.active:
            return
        r.state.active = False
        r.monitor.stop()
        _runs.RUNS.drop(self._held)
        r.lookup.stop()
        self._repairs.stop_checking()
        self._repairs.set_steady(False)
        r.optimizers.restore()
        r.dynamo.restore()
        r.targets.restore()

    def compile_optimizers(self, optimizers: Iterable[Any]) -> None:
        """With ``compile_optimizer=True``, compile the steps of the run's ``optimizers``
        (after :meth:`activate`; :meth:`restore` puts them back, H49)."""
        r = self.run
        if r.state.active and r.config.compile_optimizer:
            r.optimizers.install(optimizers, r.config.compile_kwargs, self._repairs.on_step_compile)

    def finish(self) -> None:
        """End the run: name targets that ran uncompiled, restore, save the compile cache
        (rank zero, ``compile_cache=``), log the summary once."""
        r = self.run
        idle = r.targets.idle(self._repairs.label)
        if idle:
            r.state.uncompiled = idle
            r.host.warn(
                f"guardtrain: target(s) {idle} ran uncompiled all run: their `forward` was "
                "never called through the module (check `targets`), or Dynamo skipped it."
            )
        self.restore()
        if self.compile_cache is not None:
            warmstart.save(self.compile_cache, r.host, r.host.agreement.rank)
        if not r.state.summary_logged and not r.config.disabled:
            r.state.summary_logged = True
            r.host.info(self.format_summary())

    # -- loops and batches -------------------------------------------------------------------

    def loop_start(self, loop: str) -> None:
        """A pass of ``loop`` starts: leave the stance; the first batch re-checks the model."""
        r = self.run
        if not r.state.active:
            return
        self._repairs.set_steady(False, boundary=True)
        self._repairs.stop_checking()
        r.state.loop = loop
        r.state.pending.add(loop)
        r.machine.pass_started(loop)
        if loop != TRAIN:
            r.lookup.cut(r.config.lookup_window)  # not on this loop's calls (H27)

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
        r = self.run
        state = r.state
        if not state.active:
            return
        state.loop = loop
        if loop in state.pending:
            state.pending.discard(loop)
            self._batches.boundary(loop)
        r.targets.batch_starts()  # the first call checks what events miss (H42)
        m = r.machine
        if m.use_stance:
            steady, check, leave = m.steady_batch(loop, batch, training, warmed_training)
            if leave is not None:
                self._repairs.rearm(loop, leave)
            if loop == TRAIN:
                loop_state = m.loops[loop]
                if (
                    r.lookup.measure is not None
                    or loop_state.batches >= r.checks.next_check
                    or r.config.guard_collectives
                ):
                    steady = self._batches.training_turn(loop_state, steady, check)
                elif r.optimizers.with_full_guards:
                    r.optimizers.full_guards(False)  # an audit's or a window's batch is over
            elif steady and r.host.sanity_checking():
                steady = False
            if steady is not state.stance_on or check is not None:
                self._repairs.steady_for_batch(steady, check)
        state.stance_at_start = state.stance_on
        state.compiles_at_batch = r.monitor.compiles - state.unheard_compiles

    def batch_end(self, loop: str, backward_follows: bool = False) -> None:
        """Count the batch's compiles; decide entry at decision points.

        ``backward_follows``: the batch's backward runs after this (a batch is one model
        call); repairs after a compile then wait for :meth:`backward_done` (H52)."""
        r = self.run
        state = r.state
        if not state.active:
            return
        m, ch = r.machine, r.checks
        compiled = r.monitor.compiles - state.unheard_compiles != state.compiles_at_batch
        # What BatchChecks.end_checks ends: called only when one of them runs.
        if ch.checking is not None or ch.audit_batch or ch.verify_batch or r.lookup.window:
            self._batches.end_checks(loop, compiled)
        m.batch_done(loop, compiled, state.stance_at_start and state.stance_on)
        if compiled or state.splits_due:
            # A compile, or a target running uncompiled until it is split (H51).
            self._repairs.after_compile(wait=backward_follows)
        if loop == TRAIN:
            if state.repairs_due:
                pass  # no decision while the targets may still change (H52)
            elif m.collective or m.loops[loop].phase != STEADY:  # steady alone: no decision
                self._batches.decision_point()
            # Do the checks before calls outweigh the guards they save? (H51, counts) A
            # hand-over waits for the backward, as repairs do (H52).
            if backward_follows:
                state.weigh_due = m.loops[loop].phase == STEADY
            else:
                self._repairs.weigh_checks(m.loops[loop].phase == STEADY)
            if state.logged_changes != r.changes():
                self._log_changes()

    def step_start(self) -> None:
        """A training step starts (Lightning's and ``GuardTuner``'s batch, the HF
        ``Trainer``'s optimizer step): its wall time counts in ``summary()["step"]`` if
        the training loop is steady from here to :meth:`step_end` (no compile, no re-arm)."""
        if self.run.state.active:
            mark = self._step_mark()
            self.run.steps.start(mark)
            if not mark[0]:  # warm-up counts every call: the summary's estimate
                for t in self.run.targets.kept:
                    t.calls_at_step = t.calls

    def step_end(self) -> None:
        """The training step that :meth:`step_start` began has ended."""
        if self.run.state.active:
            mark = self._step_mark()
            self.run.steps.end(mark)
            if not mark[0]:
                for t in self.run.targets.kept:
                    t.step_calls = t.calls - t.calls_at_step

    def _step_mark(self) -> tuple[bool, int, int]:
        m = self.run.machine
        return m.steady(TRAIN), self.run.monitor.compiles, len(m.rearms)

    def backward_done(self) -> None:
        """The backward of the batches before now has run (the HF ``Trainer``: before the
        optimizer step, after each accumulation substep): repairs that waited for it
        (:meth:`batch_end`'s ``backward_follows``, H52) happen now."""
        state = self.run.state
        if state.active and state.repairs_due:
            state.repairs_due = False
            self._repairs.after_compile()
        if state.active and state.weigh_due is not None:
            steady, state.weigh_due = state.weigh_due, None
            self._repairs.weigh_checks(steady)

    def loop_end(self, loop: str, complete: bool = True) -> None:
        """A pass of ``loop`` ended (``complete`` is False for a sanity check or a cut pass)."""
        r = self.run
        if not r.state.active:
            return
        self.backward_done()
        if loop == TRAIN:
            self._log_step()
        self._repairs.set_steady(False, boundary=True)
        r.dynamo.set_guard_collectives(False)
        r.machine.pass_done(loop, complete)
        if loop != TRAIN and r.machine.use_stance:
            self._batches.decide(loop)
        r.state.pending.add(TRAIN)
        r.state.loop = None

    def _log_step(self) -> None:
        """Once per training pass: the steady step and what guardtrain saved in it."""
        r = self.run
        if not (r.config.log_metrics and r.host.log_metrics is not None):
            return
        values = step_metrics(bottom_line(r.steps, r.lookup.lookup, r.levers.direct_dispatch))
        if values:
            r.host.log_metrics(values, self.train_batches())

    def _log_changes(self) -> None:
        r = self.run
        r.state.logged_changes = r.changes()
        if r.config.log_metrics and r.host.log_metrics is not None:
            current = (self.phase, r.monitor.compiles, len(r.machine.rearms))
            self.metrics.log(r.host, current, r.lookup.lookup, self.train_batches)


class _Held:
    """An engine as the registry of runs sees it (H45): its adapter, the modules it has
    compiled in place, whether its adapter says the run is live, and its release."""

    def __init__(self, engine: GuardEngine) -> None:
        self._engine = engine

    @property
    def owner(self) -> str:
        return self._engine.run.host.owner

    def held_modules(self) -> list[nn.Module]:
        return [target.module for target in self._engine.run.targets.installed]

    def live(self) -> bool:
        return self._engine.run.host.live()

    def described(self) -> str:
        known_as = self._engine.run.host.known_as
        return ", ".join(known_as(t.name) for t in self._engine.run.targets.installed)

    def release_dead(self) -> None:
        self._engine.restore()
        self._engine.run.host.on_release()
