#!/usr/bin/env bash
# Test guardtrain on every torch version it declares (2.11 to 2.15).
#
#   scripts/matrix.sh              every version: install (once), test, print the table
#   scripts/matrix.sh 2.15 2.11    only these versions (the table still lists every result)
#   scripts/matrix.sh --install 2.15   install only, no tests
#   scripts/matrix.sh --fast 2.15      the fast tests only (what .ci/run does)
#   scripts/matrix.sh --table      print the table from the last results
#
# One venv per version under .venvs/torch-X.Y (git-ignored), reused when its torch
# is the one asked for and its constraints are unchanged. Each gets guardtrain[dev],
# editable, with everything but torch at the releases in scripts/constraints.txt (as
# scripts/setup.sh). A pip constraint file per venv pins torch and those releases; it
# replaces any constraint file the machine sets (PIP_CONSTRAINT). The registry's default
# torch builds are CUDA wheels (about 5 GB a venv) that also run on the CPU; torch 2.13
# comes from a local CPU wheel when pip's find-links has one, as in scripts/setup.sh.
#
# Each version runs the fast tests (-m "not slow"), the inductor tests in INDUCTOR_TESTS
# and the FSDP2 tests in EXTRA_TESTS below. Logs and counts: .venvs/torch-X.Y/matrix-*.log and result.
# A version passes with zero failures and errors; every skip names its reason in the log
# (pytest -ra). Exit status: 1 if any version tested in this run failed.
#   PYTHON   interpreter for new venvs (python3)
#   GUARDTRAIN_CONSTRAINTS  the constraints file (scripts/constraints.txt); empty: none
#   MATRIX_PYTEST_ARGS  extra pytest arguments (e.g. "-x")
set -euo pipefail
cd "$(dirname "$0")/.."

ALL_VERSIONS=(2.11 2.12 2.13 2.14 2.15)
# Everything but torch at the releases the tests last passed with (as scripts/setup.sh).
constraints="${GUARDTRAIN_CONSTRAINTS-scripts/constraints.txt}"
# The release tested for each minor version.
declare -A RELEASE=([2.11]=2.11.0 [2.12]=2.12.1 [2.13]=2.13.0 [2.14]=2.14.1 [2.15]=2.15.0)
# Inductor tests (marked slow) that run on every version: compile with inductor, the
# warm-start cache, the regional-compile bench path and turbo under inductor.
INDUCTOR_TESTS=(
    tests/test_callback.py::test_inductor_end_to_end
    tests/test_template.py::test_aggressive_inductor_checkpoints_every_epoch
    tests/test_warm_start.py::test_inductor_second_process_compiles_from_the_file
)
# FSDP2 on the CPU (2 processes, gloo; marked slow): private FSDP2 APIs change between releases.
EXTRA_TESTS=(tests/test_fsdp2.py)

quiet() { grep -v -e '^WARNING: Location' -e '^$' || true; }

venv_of() { echo ".venvs/torch-$1"; }

install() {
    local minor=$1 release=${RELEASE[$1]} venv py constraint pins
    venv=$(venv_of "$minor")
    py="$venv/bin/python"
    constraint="$venv/constraints.txt"
    pins=$(echo "torch==$release"; cat ${constraints:+"$constraints"} </dev/null)
    if [ -x "$py" ] && [ "$(cat "$constraint" 2>/dev/null)" = "$pins" ] && \
        "$py" -c "import torch, lightning, pytest, guardtrain, sys; \
sys.exit(torch.__version__.split('+')[0] != '$release')" 2>/dev/null; then
        echo "matrix: $venv: keeping torch $release"
        return 0
    fi
    echo "matrix: $venv: installing torch $release"
    "${PYTHON:-python3}" -m venv "$venv"
    echo "$pins" >"$constraint"
    # The local CPU wheel first (no download), as scripts/setup.sh does.
    if [ "$minor" = 2.13 ]; then
        PIP_CONSTRAINT="$constraint" "$py" -m pip install -q --no-index --no-deps "torch==$release" \
            2>&1 | quiet || true
    fi
    PIP_CONSTRAINT="$constraint" "$py" -m pip install -q "torch==$release" lightning 2>&1 | quiet
    PIP_CONSTRAINT="$constraint" "$py" -m pip install -q -e ".[dev]" 2>&1 | quiet
    "$py" -c "import torch, lightning; print('matrix: installed torch', torch.__version__, \
'| lightning', lightning.__version__)"
}

# The counts on pytest's closing line: passed failed skipped errors.
counts() {
    local line=$1 n
    for word in passed failed skipped error; do
        n=$(grep -oE "[0-9]+ ${word}" <<<"$line" | grep -oE '^[0-9]+' || true)
        printf '%s ' "${n:-0}"
    done
}

test_version() {
    local minor=$1 venv py start status=0 line fast slow
    venv=$(venv_of "$minor")
    py="$venv/bin/python"
    start=$(date +%s)
    # One thread per process: the suite starts several processes on small machines.
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$py" -m pytest -q -ra -m "not slow" -p no:cacheprovider \
        ${MATRIX_PYTEST_ARGS:-} >"$venv/matrix-fast.log" 2>&1 || status=1
    fast=$(counts "$(tail -n 1 "$venv/matrix-fast.log")")
    if [ "$mode" = fast ]; then
        read -r fp ff fs fe <<<"$fast"
        grep -E '^(FAILED|ERROR|SKIPPED)' "$venv/matrix-fast.log" || true
        tail -n 1 "$venv/matrix-fast.log"
        echo "matrix: torch $minor: fast $fp passed, $((ff + fe)) failed, $fs skipped" \
            "in $(($(date +%s) - start)) s ($venv/matrix-fast.log)"
        return $status
    fi
    # -m: the named tests whatever their marks (pyproject's addopts leave `slow` out)
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$py" -m pytest -q -ra -m "slow or not slow" \
        -p no:cacheprovider ${MATRIX_PYTEST_ARGS:-} "${INDUCTOR_TESTS[@]}" "${EXTRA_TESTS[@]}" \
        >"$venv/matrix-slow.log" 2>&1 || status=1
    slow=$(counts "$(tail -n 1 "$venv/matrix-slow.log")")
    read -r fp ff fs fe <<<"$fast"
    read -r sp sf ss se <<<"$slow"
    local torch_v lightning_v
    torch_v=$("$py" -c "import torch; print(torch.__version__)")
    lightning_v=$("$py" -c "import lightning; print(lightning.__version__)")
    printf '%s %s %s %s %s %s %s %s %s %s %s %s\n' "$minor" "$torch_v" "$lightning_v" \
        "$fp" "$((ff + fe))" "$fs" "$sp" "$((sf + se))" "$ss" "$(($(date +%s) - start))" \
        "$(date -u +%Y-%m-%d)" "$status" >"$venv/result"
    echo "matrix: torch $minor: fast $fp passed, $((ff + fe)) failed, $fs skipped;" \
        "inductor+FSDP2 $sp passed, $((sf + se)) failed, $ss skipped ($venv/matrix-*.log)"
    return $status
}

table() {
    echo "| torch | lightning | fast: passed / failed / skipped | inductor + FSDP2: passed / failed / skipped | seconds | date |"
    echo "|---|---|---|---|---|---|"
    local minor r
    for minor in "${ALL_VERSIONS[@]}"; do
        r="$(venv_of "$minor")/result"
        if [ -f "$r" ]; then
            read -r _ tv lv fp ff fs sp sf ss secs day _ <"$r"
            echo "| $tv | $lv | $fp / $ff / $fs | $sp / $sf / $ss | $secs | $day |"
        else
            echo "| $minor | - | not run | not run | - | - |"
        fi
    done
}

mode=test
versions=()
for arg in "$@"; do
    case "$arg" in
        --install) mode=install ;;
        --table) mode=table ;;
        --fast) mode=fast ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *)
            if [ -z "${RELEASE[$arg]:-}" ]; then
                echo "matrix: unknown torch version '$arg' (expected one of ${ALL_VERSIONS[*]})" >&2
                exit 2
            fi
            versions+=("$arg") ;;
    esac
done
[ ${#versions[@]} -gt 0 ] || versions=("${ALL_VERSIONS[@]}")
if [ "$mode" = table ]; then table; exit 0; fi
failed=0
for minor in "${versions[@]}"; do
    install "$minor"
    if [ "$mode" != install ]; then test_version "$minor" || failed=1; fi
done
if [ "$mode" = test ]; then table; fi
exit $failed
