"""A Hugging Face ``Trainer`` run on 2 CPU processes (gloo, DDP through accelerate).

Started by ``tests/test_hf.py`` with ``python -m torch.distributed.run --nproc_per_node 2``.
Every rank writes ``OUT.rank{r}.json``: the logged losses, a digest of its final weights
and (guarded) the callback's summary. Nothing here imports pytest or the test suite.
"""

from __future__ import annotations

import hashlib
import tempfile

import hf_common as common
from _leave import leave


def main() -> None:
    opts = common.options(steps=24)
    model = common.model()
    callbacks = common.callbacks(opts.guard)
    with tempfile.TemporaryDirectory() as out:
        trainer = common.trainer(model, common.training_args(out, opts.steps), 128, callbacks)
        trainer.train()
    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        digest.update(key.encode())
        digest.update(value.detach().contiguous().numpy().tobytes())
    result = {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "losses": common.losses(trainer),
        "weights": digest.hexdigest(),
        "summary": callbacks[0].summary() if callbacks else None,
    }
    common.write(opts.out, result)


if __name__ == "__main__":
    main()
    leave()
