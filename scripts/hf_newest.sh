#!/usr/bin/env bash
# Test guardtrain with the newest Hugging Face releases (scripts/constraints-newest-hf.txt:
# transformers 5.25 and kernels 0.19, what `pip install "guardtrain[hf]"` resolves today),
# beside the tested stack of scripts/constraints.txt (transformers 5.24):
#
#   scripts/hf_newest.sh            install (once) and run the Hugging Face tests below
#   scripts/hf_newest.sh --install  install only
#
# The venv is .venvs/hf-newest (git-ignored), reused while its constraints are unchanged:
# the CPU build of torch 2.13.0 (from a local wheel when pip's find-links has one, as
# scripts/setup.sh), then guardtrain[dev], editable, with scripts/constraints.txt's
# releases but for the lines that constraints-newest-hf.txt replaces. The tests run with
# -m "not slow"; the log is .venvs/hf-newest/tests.log. Exit status: pytest's.
#   PYTHON   interpreter for the venv (python3)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venvs/hf-newest
py=$venv/bin/python
newest=scripts/constraints-newest-hf.txt
# The tests of the Hugging Face Trainer, TRL's trainers and generate() in training.
HF_TESTS=(
    tests/test_trl.py
    tests/test_generate_in_validation.py
    tests/test_rollouts.py
    tests/test_hf.py
)
quiet() { grep -v -e '^WARNING: Location' -e '^$' || true; }

install() {
    local pins names
    # The package names the newest file pins, and constraints.txt without them.
    names=$(grep -oE '^[A-Za-z0-9_.-]+==' "$newest" | sed 's/==$//' | paste -sd'|')
    pins=$(grep -vE "^(${names})==" scripts/constraints.txt; grep -E '^[A-Za-z0-9_.-]+==' "$newest")
    if [ -x "$py" ] && [ "$(cat "$venv/constraints.txt" 2>/dev/null)" = "$pins" ] && \
        "$py" -c "import torch, transformers, guardtrain" 2>/dev/null; then
        echo "hf-newest: $venv: keeping it"
        return 0
    fi
    echo "hf-newest: $venv: installing"
    "${PYTHON:-python3}" -m venv "$venv"
    echo "$pins" >"$venv/constraints.txt"
    if ! "$py" -c "import torch" 2>/dev/null; then
        "$py" -m pip install -q --no-index --no-deps torch==2.13.0 2>&1 | quiet || true
        if "$py" -m pip show -q torch >/dev/null 2>&1; then
            "$py" -m pip install -q torch==2.13.0 2>&1 | quiet
        else
            "$py" -m pip install -q "torch==2.13.0+cpu" \
                --extra-index-url https://download.pytorch.org/whl/cpu 2>&1 | quiet
        fi
    fi
    # kernels is transformers 5.25's own dependency; named here so that its pin applies.
    "$py" -m pip install -q -c "$venv/constraints.txt" -e ".[dev]" kernels 2>&1 | quiet
    "$py" -c "import torch, transformers, kernels; print('hf-newest: torch', torch.__version__, \
'| transformers', transformers.__version__, '| kernels', kernels.__version__)"
}

install
[ "${1:-}" = --install ] && exit 0
start=$(date +%s)
status=0
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$py" -m pytest -q -ra -m "not slow" -p no:cacheprovider \
    "${HF_TESTS[@]}" >"$venv/tests.log" 2>&1 || status=$?
grep -E '^(FAILED|ERROR|SKIPPED)' "$venv/tests.log" || true
tail -n 1 "$venv/tests.log"
echo "hf-newest: the Hugging Face tests on $("$py" -c 'import transformers; print("transformers", transformers.__version__)')" \
    "in $(($(date +%s) - start)) s ($venv/tests.log)"
exit $status
