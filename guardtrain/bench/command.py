"""The command line: ``guardtrain bench [options]`` and ``python -m guardtrain.bench``.

The speed suite of real workloads (``--workload``) is the project's own benchmark: it is
not installed with the package and runs from a checkout of the repository, as
``python -m benchmarks --workload NAME``, whose command line is this one's
(:func:`build_parser`, :func:`run`) plus the suite's options. Here ``--workload`` and
the suite's other options are refused with that command (:func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from guardtrain.bench import cost, goals, measure, report, timing
from guardtrain.bench.models import CONFIGS, MODELS, QUICK_MODELS, check_model_specs, parse_configs
from guardtrain.errors import GuardTrainValueError
from guardtrain.presets import PRESETS

__all__ = ["DESCRIPTION", "SUITE_COMMAND", "build_parser", "cli", "main", "run"]

DESCRIPTION = (
    "Measure guard, pre-graph, whole-call and training-step time of eager, "
    "torch.compile, the guardtrain presets, PyTorch's guard-free "
    "aot_compile().disable_guard_check() (aot) and the unsound floor, interleaved "
    "in one process."
)
SUITE_COMMAND = "python -m benchmarks"
"""The speed suite's command, run from a checkout of the repository."""
SUITE_OPTIONS = (
    ("workload", "--workload"),
    ("compile_optimizer", "--compile-optimizer"),
    ("no_fallback", "--no-fallback"),
)
"""The speed suite's options: ``guardtrain bench`` refuses them, naming :data:`SUITE_COMMAND`."""


def build_parser(prog: str, description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The options of the models bench, ``--callback-cost`` and ``--optimizer-step``."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add = p.add_argument
    add(
        "--model",
        action="append",
        metavar="NAME",
        help=f"{', '.join(MODELS)} or package.module:factory (repeatable; "
        "default: all built-in models; --quick: transformer)",
    )
    configs = f"comma-separated, from {', '.join(CONFIGS)} (default: all)"
    add("--configs", action="append", metavar="LIST", help=configs)
    add("--repeats", type=int, help="interleaved repeats (default 5)")
    add("--backend", default="inductor", help="torch.compile backend (default inductor)")
    add("--calls", type=int, help="no_grad calls per window (default: calibrated)")
    add("--steps", type=int, help="training steps per window (default: calibrated)")
    add(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1; 0 keeps torch's)"
    )
    quick = "transformer only, no training step, shorter windows (see docs/bench.md)"
    add("--quick", action="store_true", help=quick)
    add("--no-step", action="store_true", help="leave out the training step (no backward compile)")
    add("--tiny", action="store_true", help="shrink the built-in models (smoke tests)")
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    add("--no-progress", action="store_true", help="no progress bar")
    cost = "measure the callback's per-step hook cost in the steady state instead"
    add("--callback-cost", action="store_true", help=cost)
    add("--preset", default="aggressive", help="preset for --callback-cost")
    add(
        "--optimizer-step",
        action="store_true",
        help="time the optimizer step instead: eager foreach Adam, plain compile and "
        "compile_optimizer=True, interleaved, at 146 and 1,010 parameters, and the direct "
        "path's check against plain compile's lookup (--steps timed steps, default 200; --tiny; "
        "--no-schedule: a constant lr); see docs/bench.md",
    )
    add("--no-schedule", action="store_true", help="with --optimizer-step: a constant lr")
    check = "also check guardtrain's performance targets; exit 1 when one is missed"
    add("--check", action="store_true", help=check)
    return p


def _callback_cost(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    if args.preset not in PRESETS:
        raise GuardTrainValueError(
            f"--preset {args.preset!r}: unknown preset; allowed: {', '.join(PRESETS)}."
        )
    with timing.threads(args.threads):
        data = cost.callback_cost(preset=args.preset)
    print(cost.format_callback_cost(data))
    if not args.check:
        return data, 0
    met, line = goals.check_callback_cost(data)
    data.update(target_us=goals.CALLBACK_COST_TARGET_US, target_met=met)
    print(f"\n{line}")
    return data, 0 if met else 1


def _optimizer_step(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """``--optimizer-step``: the table; with ``--check``, guardtrain's step at or below plain
    compile's (exit 1 otherwise)."""
    from guardtrain.bench.optimizer import CHECK_SHARE, format_optimizer_step, optimizer_step

    if args.steps is not None and args.steps < 1:
        raise GuardTrainValueError(f"--steps must be at least 1, got {args.steps}.")
    with timing.threads(args.threads):
        data = optimizer_step(
            args.backend,
            args.steps or 200,
            schedule=not args.no_schedule,
            tiny=args.tiny,
            threads=args.threads or None,
        )
    print(format_optimizer_step(data))
    if not args.check:
        return data, 0
    checks = [_optimizer_verdict(s, CHECK_SHARE, not args.no_schedule) for s in data["sizes"]]
    print("\n" + "\n".join(line for _, line in checks))
    return data, 0 if all(met for met, _ in checks) else 1


def _optimizer_verdict(size: dict[str, Any], limit: float, scheduled: bool) -> tuple[bool, str]:
    """``--optimizer-step --check`` at one size: guardtrain's step at or below plain
    compile's, and its direct path's check at most ``limit`` of plain compile's lookup;
    with the schedule (every step moves the lr: full guards) only where a step ran
    directly after all."""
    ratio, share = size["rows"]["guardtrain"]["ratio"], size["check_share"]
    held = size["check_us"] is not None or not scheduled
    met = ratio <= 1.0 and (not held or (share is not None and share <= limit))
    if not held:
        check = "not run (every step moves the lr: full guards)"
    elif share is None:
        check = "not measured"
    else:
        check = f"{share:.3f} of plain compile's lookup (limit {limit:.2f})"
    return met, (
        f"optimizer step at {size['parameters']} parameters: guardtrain / plain compile "
        f"{ratio:.3f} (limit 1.00); the direct path's check {check}: "
        + ("met" if met else "NOT met")
    )


def _options(args: argparse.Namespace) -> measure.BenchOptions:
    configs = parse_configs(args.configs)
    models = args.model or list(QUICK_MODELS if args.quick else MODELS)
    models = [m.strip() for value in models for m in value.split(",") if m.strip()]
    check_model_specs(models)  # fail on a bad name before anything is compiled
    return measure.BenchOptions(
        models=models,
        configs=configs,
        repeats=args.repeats if args.repeats is not None else 5,
        backend=args.backend,
        calls=args.calls,
        steps=args.steps,
        window_s=0.1 if args.quick else 0.2,
        train_step=not (args.quick or args.no_step),
        threads=args.threads or None,
        tiny=args.tiny,
        quick=args.quick,
        progress=not args.no_progress,
    )


def _bench(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], int]:
    options = _options(args)
    t0 = time.perf_counter()
    data: dict[str, Any] = measure.run_bench(options)
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    data["command"] = command
    print(report.format_table(data))
    print(f"\nwall time {data['wall_s']} s")
    if not args.check:
        return data, 0
    data["targets"] = goals.check_targets(data["results"])
    print("\n" + goals.format_checks(data["targets"]))
    return data, 0 if data["targets"] and all(t["met"] for t in data["targets"]) else 1


def run(args: argparse.Namespace, command: str) -> int:
    """The models bench, or ``--callback-cost``, or ``--optimizer-step``; the exit status.

    Raises:
        GuardTrainValueError: a bad value (the caller turns it into a usage error).
    """
    if args.plot:
        report.require_matplotlib()
    if args.callback_cost:
        data, status = _callback_cost(args)
    elif args.optimizer_step:
        data, status = _optimizer_step(args)
    else:
        data, status = _bench(args, command)
    if args.json:
        report.write_json(args.json, data)
    if args.plot and "results" in data:  # the models bench's
        report.plot(data, args.plot)
    return status


def _add_suite_options(parser: argparse.ArgumentParser) -> None:
    """The speed suite's options, hidden: parsed only to be refused (:func:`_refuse_suite`)."""
    for attr, flag in SUITE_OPTIONS:
        action = "append" if attr == "workload" else "store_true"
        parser.add_argument(flag, action=action, help=argparse.SUPPRESS)


def _refuse_suite(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Raise on a speed-suite option, naming the command that runs it from a checkout."""
    for attr, flag in SUITE_OPTIONS:
        if getattr(args, attr):
            raise GuardTrainValueError(
                f"{flag}: the speed suite of real workloads is the project's own benchmark, "
                "not installed with guardtrain; run it from a checkout of the guardtrain "
                f"repository: {shlex.join([*SUITE_COMMAND.split(), *argv])}"
                + ("" if args.workload else " --workload NAME")
                + " (the same options)."
            )


def main(argv: Sequence[str] | None = None, prog: str = "python -m guardtrain.bench") -> int:
    """Run the command; returns the exit status (1: ``--check`` found a target missed)."""
    parser = build_parser(prog)
    parser.epilog = (
        "The speed suite of real workloads runs from a checkout of the guardtrain "
        f"repository: {SUITE_COMMAND} --workload NAME (see docs/bench.md)."
    )
    _add_suite_options(parser)
    given = list(argv if argv is not None else sys.argv[1:])
    args = parser.parse_args(given)
    command = " ".join([prog, *given])
    try:
        _refuse_suite(args, given)
        with _quiet_profiler():
            return run(args, command)
    except GuardTrainValueError as err:
        parser.error(str(err))


KINETO_LEVEL = "KINETO_LOG_LEVEL"
"""The environment variable the torch profiler's C++ side (kineto) reads its log level from,
once, at its first use in the process."""


@contextlib.contextmanager
def _quiet_profiler() -> Iterator[None]:
    """The profiler's own ``USDT ... profiler_start`` and ``profiler_stop`` lines (kineto's
    highest level, 5) kept out of the terminal: level 6 while the command runs, unless the
    caller set a level; the variable is put back after (kineto keeps the level it read)."""
    before = os.environ.get(KINETO_LEVEL)
    if before is None:
        os.environ[KINETO_LEVEL] = "6"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(KINETO_LEVEL, None)


def cli(argv: Sequence[str] | None = None) -> int:
    """The ``guardtrain`` console script: ``guardtrain bench [options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: guardtrain bench [options]   (guardtrain bench --help for the options)")
        return 0 if argv else 2
    if argv[0] != "bench":
        print(f"guardtrain: unknown command {argv[0]!r}; allowed: bench", file=sys.stderr)
        return 2
    return main(argv[1:], prog="guardtrain bench")
