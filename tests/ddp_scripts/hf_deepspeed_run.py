"""A Hugging Face ``Trainer`` run on 2 CPU processes under DeepSpeed ZeRO-2 (gloo).

Started by ``tests/test_hf.py`` with ``python -m torch.distributed.run --nproc_per_node 2``
and ``DS_ACCELERATOR=cpu``, when ``deepspeed`` can be imported.
``TrainingArguments(deepspeed={...}, use_cpu=True)``: accelerate makes its
``DeepSpeedPlugin`` and the Trainer trains through ``deepspeed.initialize``. Every rank
writes ``OUT.rank{r}.json``: the accelerate state's kind, the wrapped model's class, the
logged losses, the callback's ``switched_off`` and summary, the forward hooks on the model,
and the guardtrain warnings it got. Nothing here imports pytest or the test suite.
"""

from __future__ import annotations

import tempfile
import warnings

import hf_common as common
from _leave import leave

ZERO2 = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
}


def main() -> None:
    opts = common.options(steps=6)
    model = common.model()
    callbacks = common.callbacks(opts.guard, warmup_steps=2, stable_steps=None)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = common.training_args(out, opts.steps, deepspeed=ZERO2)
        trainer = common.trainer(model, args, 64, callbacks)
        trainer.train()
    state = trainer.accelerator.state
    cb = callbacks[0] if callbacks else None
    result = {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "distributed_type": str(state.distributed_type.value),
        "zero_stage": getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", None),
        "model_class": type(trainer.model_wrapped).__name__,
        "losses": common.losses(trainer),
        "switched_off": cb.switched_off if cb else None,
        "summary": cb.summary() if cb else None,
        "hooks": [
            f"{getattr(h, '__module__', '?')}.{getattr(h, '__qualname__', type(h).__qualname__)}"
            for h in [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
        ],
        "warnings": [str(w.message) for w in caught if "guardtrain" in str(w.message)],
    }
    common.write(opts.out, result)


if __name__ == "__main__":
    main()
    leave()
