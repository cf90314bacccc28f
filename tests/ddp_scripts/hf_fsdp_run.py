"""A Hugging Face ``Trainer`` run on 2 CPU processes under accelerate's FSDP2 (gloo).

Started by ``tests/test_hf.py`` with ``python -m torch.distributed.run --nproc_per_node 2``.
``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2, ...}, use_cpu=True)``:
the Trainer makes accelerate's ``FullyShardedDataParallelPlugin`` and accelerate applies
``fully_shard`` to each ``GPT2Block`` and to the root over gloo.

On the CPU accelerate 1.15 drops the FSDP plugin without a word: ``AcceleratorState``
switches to ``DistributedType.FSDP`` only when the process state's type is one of the
accelerator kinds (``MULTI_GPU``, ``MULTI_XPU``, ...), never ``MULTI_CPU``, and the Trainer
then wraps the model in DDP. So, after ``TrainingArguments`` made the process state (CPU
device, gloo) and before the ``Trainer`` makes its ``Accelerator``, this script sets that
state's type to ``MULTI_GPU``: what a GPU machine has at that point. Everything after is
accelerate's and the Trainer's own FSDP2 path (the device stays the CPU); the result says
whether the override was needed (``stock_type``) and which type the run had.

Every rank writes ``OUT.rank{r}.json``: its logged losses, the digest of the gathered final
weights, the callback's summary and engine levers, the stance at each training forward,
and the guardtrain warnings it got. Nothing here imports pytest or the test suite.
"""

from __future__ import annotations

import hashlib
import tempfile
import warnings
from typing import Any

import hf_common as common
import torch
from _leave import leave


def stance_on() -> bool:
    """Whether guardtrain's targets are steady (their calls set the stance for themselves)."""
    from guardtrain.compile import steady_now

    return steady_now()


def force_fsdp_on_the_cpu() -> str:
    """Give accelerate's process state the type it has on a GPU machine (see the module
    docstring); returns the type it had."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    stock = PartialState().distributed_type
    if stock == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    return str(stock.value)


def weights_digest(model: torch.nn.Module) -> str:
    """The digest of the full (gathered) state dict: a collective on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        digest.update(key.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    opts = common.options(steps=24)
    model = common.model()
    callbacks = common.callbacks(opts.guard)
    stance: list[bool] = []

    def probe(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if module.training:
            stance.append(stance_on())

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp = {
            "version": 2,
            "reshard_after_forward": True,
            "transformer_layer_cls_to_wrap": ["GPT2Block"],
        }
        args = common.training_args(out, opts.steps, fsdp=True, fsdp_config=fsdp)
        stock = force_fsdp_on_the_cpu()
        trainer = common.trainer(model, args, 128, callbacks)
        # After the callback's hooks (put on in the Trainer's on_init_end): sees its stance.
        model.register_forward_pre_hook(probe, with_kwargs=True)
        trainer.train()
    state = trainer.accelerator.state
    cb = callbacks[0] if callbacks else None
    result = {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "stock_type": stock,
        "distributed_type": str(state.distributed_type.value),
        "fsdp_version": getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None),
        "model_class": type(trainer.model_wrapped).__name__,
        "losses": common.losses(trainer),
        "weights": weights_digest(trainer.model),
        "stance": "".join("1" if s else "0" for s in stance),
        "warnings": [str(w.message) for w in caught if "guardtrain" in str(w.message)],
        "summary": cb.summary() if cb else None,
        "install_free_tensors": cb.engine.levers.install_free_tensors if cb else None,
    }
    common.write(opts.out, result)
    # Neither rank leaves while the other is still in a collective.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
    leave()
