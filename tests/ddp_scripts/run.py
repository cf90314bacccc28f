"""One multi-process fit of a tiny model, with or without GuardTuneCallback.

Usage (run as a script; Lightning's ``ddp`` strategy re-runs this command line
for the other ranks)::

    python tests/ddp_scripts/run.py OUT [--guard aggressive] [--strategy ddp]
        [--short-batch RANK:STEP] [--slice RANK:STEP] [--eval RANK:STEP]
        [--guard-collectives] [--max-steps 30]

Every rank writes into OUT:

* ``rank{r}.pt``: the full state dict at the end of training and this rank's
  losses (written in ``on_train_end`` on every rank);
* ``rank{r}.json``: after ``fit`` returns, this rank's phase, the callback's
  ``summary()`` and what the probe saw (first steady step, whether guard
  collectives were installed in warm-up / steady state);
* ``rank{r}.error.txt``: the traceback, if ``fit`` raised on this rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import lightning as L
from _common import (
    EvalForOneStep,
    Probe,
    SaveResults,
    TinyDDPModule,
    guard_collectives_hook_installed,
    set_collective_timeout,
    stance_on,
    write_json,
)
from _leave import leave
from helpers import turbo_everywhere

turbo_everywhere()  # `pytest --turbo-everywhere`: `aggressive` runs with turbo's levers
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")


def rank_step(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    rank, step = text.split(":")
    return int(rank), int(step)


def make_strategy(name: str, timeout: float) -> object:
    td = set_collective_timeout(timeout)
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(timeout=td)
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(timeout=td)
    if name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(timeout=td)
    raise SystemExit(f"unknown strategy {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "model_parallel"])
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--guard", default="none", help="'none' (uncompiled) or a preset name")
    ap.add_argument("--guard-collectives", action="store_true")
    ap.add_argument("--targets", help="comma-separated target names (default: the callback's)")
    ap.add_argument("--warmup-steps", type=int, default=6)
    ap.add_argument("--stable-steps", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--short-batch", help="RANK:STEP: that rank's dataloader has a short batch")
    ap.add_argument("--slice", help="RANK:STEP: that rank cuts its batch in training_step")
    ap.add_argument("--eval", help="RANK:STEP: that rank's module is in eval for one step")
    ap.add_argument("--timeout", type=float, default=90.0, help="collective timeout (s)")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    L.seed_everything(0, verbose=False)
    model = TinyDDPModule(
        short_batch=rank_step(args.short_batch),
        slice_at=rank_step(args.slice),
        shard=args.strategy == "model_parallel",
    )
    callbacks: list[L.Callback] = []
    perturb = rank_step(args.eval)
    evaler = EvalForOneStep(*perturb) if perturb else None
    if evaler is not None:
        callbacks.append(evaler)  # before the guard: its per-batch check sees the flag
    guard = None
    if args.guard != "none":
        from guardtrain import GuardTuneCallback

        kwargs: dict[str, object] = {
            "warmup_steps": args.warmup_steps,
            "stable_steps": args.stable_steps,
            "compile_kwargs": {"backend": "eager"},
        }
        if args.targets is not None:
            kwargs["targets"] = args.targets.split(",")
        if args.guard_collectives:
            kwargs["guard_collectives"] = True
        guard = GuardTuneCallback(args.guard, **kwargs)
        callbacks.append(guard)
    probe = Probe(guard)
    callbacks += [probe, SaveResults(out)]

    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=make_strategy(args.strategy, args.timeout),
        max_steps=args.max_steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        trainer.fit(model)
    except BaseException:
        (out / f"rank{rank}.error.txt").write_text(traceback.format_exc())
        raise
    rank = trainer.global_rank
    info: dict[str, object] = {
        "rank": rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "train_batches": len(model.train_losses),
        "eval_fired": bool(evaler and evaler.fired),
        "collectives_after_fit": guard_collectives_hook_installed(),
        "stance_after_fit": stance_on(),
        **probe.report(),
    }
    if guard is not None:
        info["phase"] = guard.phase
        info["summary"] = guard.summary()
    write_json(out / f"rank{rank}.json", info)


if __name__ == "__main__":
    main()
    leave()
