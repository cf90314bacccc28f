"""The multi-process scripts' last step: end the process without interpreter finalization.

A gloo process group can abort a process that has finished its work, as it exits
(``terminate called without an active exception``, exit status -6). Its worker thread
frees a finished collective's tensors (``ProcessGroupGloo::runLoop`` →
``~AsyncWork`` → ``TensorImpl::decref_pyobject``), which takes the GIL; if the main
thread has begun finalizing, ``take_gil`` ends the worker thread with ``pthread_exit``
inside a destructor, and libstdc++ calls ``std::terminate``. Seen on torch 2.13's CPU
build with and without guardtrain, in 1 of 15 to 1 of 8 two-process runs on a 2-core
machine (the Hydra example's DDP run, ``tests/test_hydra.py``). ``destroy_process_group``
does not join gloo's threads while something still holds the group (a DDP reducer, an
FSDP2 mesh), so the scripts also skip finalization: their results are written before,
and an exception still ends them with its traceback and a non-zero status.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def leave() -> NoReturn:
    """Destroy the default process group, flush the output, end the process with status 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
