"""``guardtrain bench``: guard overhead of each preset, side by side, in one process.

Run ``python -m guardtrain.bench --help`` (or the ``guardtrain bench`` console script).
Every configuration of every model is built once, warmed up, and then measured in
*interleaved* rounds: in each repeat, each metric is measured for every configuration in
turn (the order rotates from repeat to repeat), so slow drifts of a shared machine hit all
configurations alike. The table reports the median over repeats and the spread (``±``: half
the range, as a % of the median); ratios are medians of the per-repeat ratios (paired
samples).

Configurations:

* ``eager``: no compile.
* ``compile``: ``torch.compile`` with its defaults (``torch.compile(model)``;
  for ``regional``, ``block.compile()`` on every block: the blocks share one
  code object and one cache).
* ``off``, ``safe``, ``balanced``, ``aggressive``, ``turbo``, ``auto``: the presets, each
  run by a whole :class:`~guardtrain.engine.engine.GuardEngine`
  (:class:`~guardtrain.bench.runner.EngineRunner`) as in training: each turn of the
  configuration is one training batch of the engine (``batch_start``/``batch_end``, the
  model's input as the batch), so the engine warms up, enters the steady state and
  re-arms as in training, and what a preset adds on entry (the stance; direct dispatch
  for ``turbo``) is what is measured. Audits are off; the engine's Dynamo config is set
  only during its turns, the stance only inside its targets' own steady calls (H41). The
  engine's targets follow its own rules: for ``regional`` the 12 blocks share one code
  object (H24).
* ``aot``: PyTorch's ``aot_compile().disable_guard_check()``, unsound: the anchor for
  ``turbo``, no guard and no Dynamo entry path (vLLM's dispatch), one function per kind
  of call; where it cannot serve (a graph break, a backend it cannot serialize, a torch
  without the API) ``-`` and the reason (:mod:`~guardtrain.bench.anchor`).
* ``floor``: ``torch.compiler.skip_all_guards_unsafe`` + ``install_free_tensors``, the
  unsound lower limit. It keeps Dynamo's global-state guard (grad mode, autocast), so the
  training step and the ``no_grad`` call get graphs of their own.

Metrics per configuration: ``guard_us`` and ``pregraph_us`` (profiler events
``TorchDynamo Cache Lookup`` and ``Pregraph bytecode`` in a short profiled window of
``no_grad`` calls in training mode; per model call, i.e. summed over its compiled frames, 12
for ``regional``; each frame's median over the window, see :mod:`guardtrain.profiling`),
``call_us`` (a whole ``no_grad`` call, without the profiler), ``step_us`` (forward,
backward, ``SGD.step``), ``compiles`` (Dynamo frame compiles during warm-up and
measurement), ``call-floor µs/frame`` (per repeat, the call minus ``floor``'s call, divided
by the compiled frames per call: 12 for ``regional``, 1 for a whole model; median and
range), the paired ratios ``/compile``, ``/floor`` and ``/aot`` (call and step; each
repeat's value over the other configuration's in the same repeat, median and range) and
``matches_eager``: after the measurements (training mode), the model is switched to
``eval()`` and called under ``no_grad``; the output must equal the uncompiled model's with
the same weights. ``floor`` and ``aot`` fail this on models with dropout: they reuse the
training-mode graph. Under ``aot`` the profiler sees no guard evaluation (``guard_us`` 0)
but the pre-graph bytecode that reads the parameters off the module.

``call_us`` and ``step_us`` time every call on its own and take the median of the window;
within a repeat the configurations take turns every :data:`CALL_CHUNK` calls
(:data:`STEP_CHUNK` steps), so each sees the same load.

The models run with one intra-op thread by default (``--threads``): on a machine with 2
shared cores, two OpenMP threads spin against other processes (a small matmul is then many
times slower with 2 threads than with 1).

The output shows results only; ``--check`` also checks the project's performance targets
(:mod:`guardtrain.bench.goals`; among them ``turbo``'s ``no_grad`` call at or below
``aot``'s on ``transformer`` and ``regional``) and exits with status 1 when one is missed.

The speed suite of real workloads runs from a checkout of the repository
(:mod:`~guardtrain.bench.command`).

Modules: :mod:`~guardtrain.bench.models` (configurations and models),
:mod:`~guardtrain.bench.runner` (one configuration), :mod:`~guardtrain.bench.measure` (the
interleaved run), :mod:`~guardtrain.bench.report` (table, JSON, plot),
:mod:`~guardtrain.bench.anchor` (the ``aot`` anchor), :mod:`~guardtrain.bench.goals`
(targets), :mod:`~guardtrain.bench.cost` (``--callback-cost``),
:mod:`~guardtrain.bench.optimizer` (``--optimizer-step``), :mod:`~guardtrain.bench.timing`
(the clocks), :mod:`~guardtrain.bench.command` (the command line).
"""

from __future__ import annotations

from guardtrain.bench.anchor import ANCHOR, AotRunner
from guardtrain.bench.command import cli, main
from guardtrain.bench.cost import callback_cost, format_callback_cost
from guardtrain.bench.goals import (
    MODEL_TARGETS,
    TARGETS,
    check_callback_cost,
    check_targets,
    format_checks,
)
from guardtrain.bench.measure import (
    CALL_CHUNK,
    METRICS,
    STEP_CHUNK,
    BenchOptions,
    Progress,
    make_runner,
    run_bench,
)
from guardtrain.bench.models import (
    CONFIGS,
    ENGINE_CONFIGS,
    MODELS,
    QUICK_MODELS,
    BenchModel,
    build_model,
    parse_configs,
)
from guardtrain.bench.report import format_table, plot
from guardtrain.bench.runner import EngineRunner, Runner

__all__ = [
    "ANCHOR",
    "CALL_CHUNK",
    "CONFIGS",
    "ENGINE_CONFIGS",
    "METRICS",
    "MODELS",
    "QUICK_MODELS",
    "STEP_CHUNK",
    "MODEL_TARGETS",
    "TARGETS",
    "AotRunner",
    "BenchModel",
    "BenchOptions",
    "Progress",
    "EngineRunner",
    "Runner",
    "build_model",
    "callback_cost",
    "check_callback_cost",
    "check_targets",
    "cli",
    "format_callback_cost",
    "make_runner",
    "format_checks",
    "format_table",
    "main",
    "parse_configs",
    "plot",
    "run_bench",
]
