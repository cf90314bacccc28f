#!/usr/bin/env bash
# The multi-process checks that need a GPU machine (CI has none):
#
#  1. tests/test_distributed.py -k gpu: FSDPStrategy (CUDA only: Lightning and
#     torch's FSDP1 refuse the CPU) and ModelParallelStrategy on CUDA, each
#     guarded run compared with an uncompiled one, on min(2, GPUs) devices.
#     GUARDTRAIN_GPU=1 turns "no GPU" into a failure instead of a skip.
#  2. scripts/bench_guard_collectives.py: the per-call cost of guard
#     collectives, with gloo on that machine's CPU cores, and with NCCL when it
#     has two GPUs or more.
#  3. scripts/launch_bound_check.py: a launch-bound training step (32 blocks of
#     Linear(64) + LayerNorm + ReLU at batch 16: hundreds of tiny kernels per
#     step, so the host bounds it) on one GPU with inductor: median step time of
#     eager, plain torch.compile, GuardTuner "aggressive" and "turbo", each
#     checked against eager after eval(). Fails when a preset did not reach the
#     steady state or differs from eager. Its time is mostly the 3 inductor compiles.
#
# Usage, from anywhere:   bash scripts/gpu_check.sh
# Python: $PYTHON, else .venv/bin/python when it has CUDA, else python3. It needs
# a CUDA build of torch, lightning and pytest; guardtrain is imported from this
# checkout (PYTHONPATH), nothing is installed. Results: ${OUT:-/tmp/guardtrain_gpu_check}/.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c \
        'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        PY=.venv/bin/python
    else
        PY=python3
    fi
fi
DEST=${OUT:-/tmp/guardtrain_gpu_check}
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 GUARDTRAIN_GPU=1

"$PY" - <<'PY' | tee "$DEST/env.txt"
import lightning, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "lightning", lightning.__version__)
print("gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

status=0
"$PY" -m pytest tests/test_distributed.py -k gpu -m "slow or not slow" -v -p no:cacheprovider --durations=0 \
    --junitxml="$DEST/gpu_tests.xml" 2>&1 | tee "$DEST/gpu_tests.log" || status=$?

"$PY" scripts/bench_guard_collectives.py --device cpu --repeats 15 --calls 200 \
    --out "$DEST/bench_cpu.json" 2>&1 | tee "$DEST/bench_cpu.log" || status=$?
if [ "$NGPU" -ge 2 ]; then
    "$PY" scripts/bench_guard_collectives.py --device cuda --repeats 15 --calls 200 \
        --out "$DEST/bench_cuda.json" 2>&1 | tee "$DEST/bench_cuda.log" || status=$?
else
    echo "fewer than two GPUs: NCCL needs one GPU per rank, so no CUDA benchmark" | tee "$DEST/bench_cuda.log"
fi

"$PY" scripts/launch_bound_check.py --device cuda --backend inductor \
    --out "$DEST/launch_bound.json" 2>&1 | tee "$DEST/launch_bound.log" || status=$?
exit $status
