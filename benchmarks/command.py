"""The speed suite's command line: ``python -m benchmarks``, run from a checkout.

Its options are ``guardtrain bench``'s (:func:`guardtrain.bench.command.build_parser`)
plus the suite's: ``--workload NAME`` (repeatable or comma-separated; ``all``) runs the
workloads (:func:`~benchmarks.suite.run_suite`), ``--compile-optimizer`` and
``--no-fallback`` apply to it. Without ``--workload`` the command runs what
``guardtrain bench`` runs with the same options (:func:`guardtrain.bench.command.run`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import (
    SuiteOptions,
    check_suite,
    format_checks,
    format_suite,
    parse_suite_configs,
    parse_workloads,
    run_suite,
)
from guardtrain.bench import report
from guardtrain.bench.command import build_parser, run
from guardtrain.errors import GuardTrainValueError

__all__ = ["DESCRIPTION", "main"]

DESCRIPTION = (
    "Measure guard, pre-graph, whole-call and training-step time of eager, "
    "torch.compile, the guardtrain presets, PyTorch's guard-free "
    "aot_compile().disable_guard_check() (aot) and the unsound floor, interleaved "
    "in one process; or, with --workload, the whole training step of real "
    "workloads under plain compile and the presets."
)


def _parser(prog: str) -> argparse.ArgumentParser:
    """``guardtrain bench``'s options, then the suite's."""
    p = build_parser(prog, DESCRIPTION)
    p.add_argument(
        "--workload",
        action="append",
        metavar="NAME",
        help="run the speed suite of real workloads instead (repeatable or comma-separated; "
        "'all'); --configs from eager, compile, off, safe, balanced, aggressive, turbo, "
        "auto (default: compile, balanced, aggressive, turbo, auto), --repeats rounds "
        "(default 4, --tiny 2), --steps timed steps per turn (default: the workload's); each "
        "step timed by the thread's CPU time (deciding at one thread) and the wall clock; see "
        "docs/bench.md",
    )
    p.add_argument(
        "--compile-optimizer",
        action="store_true",
        help="with --workload: the presets with compile_optimizer=True, plain compile with "
        "PyTorch's recipe (torch.compile(opt.step), the learning rate a tensor); the "
        "workloads whose framework owns the optimizer step are skipped",
    )
    p.add_argument(
        "--no-fallback",
        action="store_true",
        help="with --workload: run --backend everywhere, also where a workload says that "
        "inductor does not fit and would run aot_eager",
    )
    return p


_NOT_WITH_WORKLOAD = (
    ("model", "--model"),
    ("quick", "--quick"),
    ("no_step", "--no-step"),
    ("calls", "--calls"),
    ("plot", "--plot"),
    ("callback_cost", "--callback-cost"),
    ("optimizer_step", "--optimizer-step"),
)


def _reject_workload_flags(args: argparse.Namespace) -> None:
    """Raise on a flag that does not apply to ``--workload``, or a bad count."""
    for attr, flag in _NOT_WITH_WORKLOAD:
        if getattr(args, attr):
            raise GuardTrainValueError(f"{flag} does not apply to --workload.")
    if args.repeats is not None and args.repeats < 1:
        raise GuardTrainValueError(f"--repeats must be at least 1, got {args.repeats}.")
    if args.steps is not None and args.steps < 1:
        raise GuardTrainValueError(f"--steps must be at least 1, got {args.steps}.")


def _suite_options(args: argparse.Namespace) -> SuiteOptions:
    """``--workload``'s arguments as the suite's options."""
    _reject_workload_flags(args)
    configs = parse_suite_configs(args.configs)
    if args.check and "compile" not in configs:
        raise GuardTrainValueError("--check compares with plain compile: add it to --configs.")
    return SuiteOptions(
        workloads=parse_workloads(args.workload),
        configs=configs,
        repeats=args.repeats if args.repeats is not None else (2 if args.tiny else 4),
        steps=args.steps,
        backend=args.backend,
        fallback=not args.no_fallback,
        tiny=args.tiny,
        threads=args.threads or None,
        progress=not args.no_progress,
        compile_optimizer=args.compile_optimizer,
    )


def _check_workloads(data: dict[str, Any]) -> int:
    """``--workload --check``: print the verdicts, keep them in ``data``; the exit status."""
    data["checks"] = check_suite(data)
    print("\n" + format_checks(data["checks"]))
    return 0 if data["checks"] and all(v["met"] for v in data["checks"]) else 1


def _workloads(args: argparse.Namespace, command: str) -> int:
    """``--workload``: the speed suite (:mod:`benchmarks.suite`)."""
    options = _suite_options(args)
    data = run_suite(options)
    data["command"] = command
    print(format_suite(data))
    print(f"\nwall time {data['wall_s']} s")
    status = _check_workloads(data) if args.check else 0
    if args.json:
        report.write_json(args.json, data)
    return status


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks") -> int:
    """Run the command; returns the exit status (1: ``--check`` found a target missed)."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    command = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
    try:
        if args.workload:
            return _workloads(args, command)
        if args.compile_optimizer:
            raise GuardTrainValueError(
                "--compile-optimizer applies to --workload only (--optimizer-step times the "
                "compiled step on its own)."
            )
        return run(args, command)
    except GuardTrainValueError as err:
        parser.error(str(err))
