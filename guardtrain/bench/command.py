"""The command line: ``guardtrain bench [options]`` and ``python -m guardtrain.bench``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from guardtrain.bench import cost, goals, measure, report
from guardtrain.bench.models import CONFIGS, MODELS, QUICK_MODELS, check_model_specs, parse_configs
from guardtrain.errors import GuardTrainValueError
from guardtrain.presets import PRESETS

if TYPE_CHECKING:
    from guardtrain.bench.workloads.suite import SuiteOptions

__all__ = ["cli", "main"]


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Measure guard, pre-graph, whole-call and training-step time of eager, "
            "torch.compile, the guardtrain presets, PyTorch's guard-free "
            "aot_compile().disable_guard_check() (aot) and the unsound floor, interleaved "
            "in one process; or, with --workload, the whole training step of real "
            "workloads under plain compile and the presets."
        ),
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help=f"{', '.join(MODELS)} or package.module:factory (repeatable; "
        "default: all built-in models; --quick: transformer)",
    )
    p.add_argument(
        "--configs",
        action="append",
        metavar="LIST",
        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved repeats (default 5; --workload: rounds, default 4, --tiny 2)",
    )
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument(
        "--calls", type=int, default=None, help="no_grad calls per window (default: calibrated)"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per window (default: calibrated)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1; 0 keeps torch's)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="transformer only, no training step, shorter windows (see docs/bench.md)",
    )
    p.add_argument(
        "--no-step", action="store_true", help="leave out the training step (no backward compile)"
    )
    p.add_argument("--tiny", action="store_true", help="shrink the built-in models (smoke tests)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--callback-cost",
        action="store_true",
        help="measure the callback's per-step hook cost in the steady state instead",
    )
    p.add_argument("--preset", default="aggressive", help="preset for --callback-cost")
    p.add_argument(
        "--optimizer-step",
        action="store_true",
        help="time the optimizer step instead: eager foreach Adam, plain compile and "
        "compile_optimizer=True, interleaved, at 146 and 1,010 parameters, and the direct "
        "path's check against plain compile's lookup (--steps timed steps, default 200; --tiny; "
        "--no-schedule: a constant lr); see docs/bench.md",
    )
    p.add_argument(
        "--no-schedule", action="store_true", help="with --optimizer-step: a constant lr"
    )
    p.add_argument(
        "--workload",
        action="append",
        metavar="NAME",
        help="run the speed suite of real workloads instead (repeatable or comma-separated; "
        "'all'); --configs from eager, compile, off, safe, balanced, aggressive, turbo, "
        "auto (default: compile, balanced, aggressive, turbo, auto), --repeats rounds "
        "(default 4), --steps timed steps per turn (default: the workload's); each step "
        "timed by the thread's CPU time (deciding at one thread) and the wall clock; see "
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
    p.add_argument(
        "--check",
        action="store_true",
        help="also check guardtrain's performance targets; exit 1 when one is missed",
    )
    return p


def _callback_cost(args: argparse.Namespace) -> int:
    if args.preset not in PRESETS:
        raise GuardTrainValueError(
            f"--preset {args.preset!r}: unknown preset; allowed: {', '.join(PRESETS)}."
        )
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        data = cost.callback_cost(preset=args.preset)
    finally:
        torch.set_num_threads(threads)
    print(cost.format_callback_cost(data))
    status = 0
    if args.check:
        met, line = goals.check_callback_cost(data)
        data.update(target_us=goals.CALLBACK_COST_TARGET_US, target_met=met)
        print(f"\n{line}")
        status = 0 if met else 1
    if args.json:
        report.write_json(args.json, data)
    return status


def _optimizer_step(args: argparse.Namespace) -> int:
    """``--optimizer-step``: the table; with ``--check``, guardtrain's step at or below plain
    compile's (exit 1 otherwise)."""
    from guardtrain.bench.optimizer import CHECK_SHARE, format_optimizer_step, optimizer_step

    if args.steps is not None and args.steps < 1:
        raise GuardTrainValueError(f"--steps must be at least 1, got {args.steps}.")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        data = optimizer_step(
            args.backend,
            args.steps or 200,
            schedule=not args.no_schedule,
            tiny=args.tiny,
            threads=args.threads or None,
        )
    finally:
        torch.set_num_threads(threads)
    print(format_optimizer_step(data))
    status = 0
    if args.check:
        print()
        for size in data["sizes"]:
            ratio = size["rows"]["guardtrain"]["ratio"]
            share = size["check_share"]
            met = ratio <= 1.0 and share is not None and share <= CHECK_SHARE
            print(
                f"optimizer step at {size['parameters']} parameters: guardtrain / plain "
                f"compile {ratio:.3f} (limit 1.00); the direct path's check "
                + ("not measured" if share is None else f"{share:.3f}")
                + f" of plain compile's lookup (limit {CHECK_SHARE:.2f}): "
                + ("met" if met else "NOT met")
            )
            status = status or (0 if met else 1)
    if args.json:
        report.write_json(args.json, data)
    return status


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


def _bench(args: argparse.Namespace, command: str) -> int:
    options = _options(args)
    t0 = time.perf_counter()
    data: dict[str, Any] = measure.run_bench(options)
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    data["command"] = command
    print(report.format_table(data))
    print(f"\nwall time {data['wall_s']} s")
    status = 0
    if args.check:
        data["targets"] = goals.check_targets(data["results"])
        print("\n" + goals.format_checks(data["targets"]))
        status = 0 if data["targets"] and all(t["met"] for t in data["targets"]) else 1
    if args.json:
        report.write_json(args.json, data)
    if args.plot:
        report.plot(data, args.plot)
    return status


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
    from guardtrain.bench import workloads

    _reject_workload_flags(args)
    configs = workloads.parse_suite_configs(args.configs)
    if args.check and "compile" not in configs:
        raise GuardTrainValueError("--check compares with plain compile: add it to --configs.")
    return workloads.SuiteOptions(
        workloads=workloads.parse_workloads(args.workload),
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
    from guardtrain.bench import workloads

    data["checks"] = workloads.check_suite(data)
    print("\n" + workloads.format_checks(data["checks"]))
    return 0 if data["checks"] and all(v["met"] for v in data["checks"]) else 1


def _workloads(args: argparse.Namespace, command: str) -> int:
    """``--workload``: the speed suite (:mod:`guardtrain.bench.workloads`)."""
    from guardtrain.bench import workloads

    options = _suite_options(args)
    data = workloads.run_suite(options)
    data["command"] = command
    print(workloads.format_suite(data))
    print(f"\nwall time {data['wall_s']} s")
    status = _check_workloads(data) if args.check else 0
    if args.json:
        report.write_json(args.json, data)
    return status


def main(argv: Sequence[str] | None = None, prog: str = "python -m guardtrain.bench") -> int:
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
        if args.plot:
            report.require_matplotlib()
        if args.callback_cost:
            return _callback_cost(args)
        if args.optimizer_step:
            return _optimizer_step(args)
        return _bench(args, command)
    except GuardTrainValueError as err:
        parser.error(str(err))


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
