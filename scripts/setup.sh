#!/usr/bin/env bash
# Create .venv with guardtrain (editable) and what the examples need (Hydra):
#
#   bash scripts/setup.sh          the run: torch, Lightning, Hydra, guardtrain
#   bash scripts/setup.sh --dev    and the test tools (transformers, accelerate, peft,
#                                  optuna, ruff, mypy, ...) and DeepSpeed for its test
#
# A torch that is already importable in .venv is kept as it is. Without one,
# the CPU build is installed: from a local wheel when pip's find-links has one
# (no download), else from PyTorch's CPU index. A bare `pip install torch`
# would pull a multi-GB CUDA build on Linux.
# Everything else comes at the releases the tests last passed with (scripts/constraints.txt).
#   GUARDTRAIN_TORCH_VERSION  torch version to install when none is present (2.13.0)
#   GUARDTRAIN_CONSTRAINTS    the constraints file (scripts/constraints.txt); empty: none,
#                             to try the registry's newest releases
#   PYTHON                    interpreter for the new venv (python3)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    "") extra=hydra ;;
    --dev) extra=dev ;;
    *) echo "setup: unknown argument '$1' (allowed: none, or --dev)" >&2; exit 2 ;;
esac
version="${GUARDTRAIN_TORCH_VERSION:-2.13.0}"
constraints="${GUARDTRAIN_CONSTRAINTS-scripts/constraints.txt}"
pin=()
[ -z "$constraints" ] || pin=(-c "$constraints")
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
py=.venv/bin/python
quiet() { grep -v -e '^WARNING: Location' -e '^$' || true; }
if "$py" -c "import torch" 2>/dev/null; then
    echo "setup: keeping torch $("$py" -c 'import torch; print(torch.__version__)')"
elif "$py" -m pip install -q --no-index --no-deps "torch==${version}" 2>&1 | quiet; \
     "$py" -m pip show -q torch >/dev/null 2>&1; then
    # The local wheel is in; now its dependencies (the installed torch satisfies the pin).
    "$py" -m pip install -q "torch==${version}" 2>&1 | quiet
    echo "setup: installed torch ${version} from a local wheel"
else
    # The +cpu build is only on PyTorch's CPU index, added beside pip's own index.
    echo "setup: installing the CPU build of torch ${version} from download.pytorch.org"
    "$py" -m pip install -q "torch==${version}+cpu" \
        --extra-index-url https://download.pytorch.org/whl/cpu 2>&1 | quiet
fi
"$py" -m pip install -q "${pin[@]}" -e ".[${extra}]" 2>&1 | quiet
if [ "$extra" = dev ]; then
# DeepSpeed for the Trainer's DeepSpeed test only, in its own folder that the test puts on
# its processes' PYTHONPATH: installed into the venv, accelerate and transformers would
# import it in every run. Its other dependencies come with the dev extra's packages.
"$py" -m pip install -q "${pin[@]}" --no-deps --upgrade --target .venv/deepspeed \
    "deepspeed>=0.19" \
    hjson msgpack ninja py-cpuinfo einops 2>&1 | quiet
fi
"$py" -c "import torch, lightning, guardtrain; print('setup: torch', torch.__version__, \
'| lightning', lightning.__version__, '| guardtrain', guardtrain.__version__)"
