"""The speed suite of real workloads: ``python -m benchmarks --workload NAME``.

The project's own benchmark, run from a checkout of the repository (not installed with
the package, whose ``guardtrain bench`` measures the user's own model). Each workload is
a real training step, run under plain compile (the way that library's users compile)
and under the presets, interleaved in one process (:mod:`.suite`):

* ``dpo-peft``, ``dpo-peft-lightning``, ``dpo-peft-hf`` (:mod:`.dpo`): DPO with a peft
  LoRA adapter, the reference pass inside ``disable_adapter()``; a plain loop with
  ``GuardTuner``, Lightning with ``GuardTuneCallback``, the HF ``Trainer`` with
  ``GuardTrainerCallback``.
* ``dpo-trl`` (:mod:`.trl_dpo`): TRL's ``DPOTrainer`` with a peft adapter and a tokenizer
  built in code.
* ``gan-toggle`` (:mod:`.gan`): a Lightning GAN, manual optimization,
  ``toggle_optimizer``.
* ``autocast-alternate``, ``rl-alternate``, ``vit-checkpoint`` (:mod:`.loops`): bf16
  autocast every other step; eval-mode rollouts then a train-mode update; a ViT with
  gradient checkpointing (timm's, or a built-in one where timm does not import).
* ``rollout``, ``grpo`` (:mod:`.rollouts`): ``generate()`` inside training, a plain loop of
  rollouts and updates, and TRL's ``GRPOTrainer`` generating with the model itself.
* ``litgpt-fabric``, ``litgpt-fabric-regional`` (:mod:`.litgpt_fabric`): a litgpt GPT
  under Lightning Fabric, compiled whole or block by block.

The parts: :mod:`.core` (a workload, its configurations as runners, their turns),
:mod:`.suite` (:data:`WORKLOADS`, the interleaved run, the table, ``--check``),
:mod:`.command` (the command line: ``guardtrain bench``'s options and the suite's),
:mod:`.hf_data` (tiny Hugging Face model configs and token data, which the tests,
their multi-process scripts and the cost scripts build their runs from too).
"""

from __future__ import annotations

from benchmarks.core import Setting, Turn, Workload
from benchmarks.suite import (
    DEFAULT_CONFIGS,
    SUITE_CONFIGS,
    WORKLOADS,
    SuiteOptions,
    check_suite,
    format_checks,
    format_suite,
    parse_suite_configs,
    run_suite,
)
from guardtrain.errors import GuardTrainValueError

__all__ = [
    "DEFAULT_CONFIGS",
    "SUITE_CONFIGS",
    "WORKLOADS",
    "Setting",
    "SuiteOptions",
    "Turn",
    "Workload",
    "check_suite",
    "format_checks",
    "format_suite",
    "parse_suite_configs",
    "parse_workloads",
    "run_suite",
]


def parse_workloads(values: list[str]) -> list[str]:
    """``--workload`` values (repeated or comma-separated; ``all``) as names, in the
    suite's order.

    Raises:
        GuardTrainValueError: an unknown name.
    """
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if "all" in names:
        return list(WORKLOADS)
    for name in names:
        if name not in WORKLOADS:
            raise GuardTrainValueError(
                f"--workload: unknown workload {name!r}; allowed: all, {', '.join(WORKLOADS)}."
            )
    if not names:
        raise GuardTrainValueError(f"--workload is empty; allowed: all, {', '.join(WORKLOADS)}.")
    return [w for w in WORKLOADS if w in names]
