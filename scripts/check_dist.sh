#!/usr/bin/env bash
# Check what a user installs: build the sdist and the wheel from a copy of the working
# tree (`python -m build`: the sdist, then the wheel from the sdist, with
# pyproject.toml's backend), check the wheel's contents (py.typed, the Hydra group and
# its search-path plugin, the console script; no tests, scripts, examples, docs or the
# speed suite's benchmarks/), then install each artifact into a fresh
# venv of its own and run the README's examples there:
#
#   wheel: `examples/train.py +guard=auto` (the README's Quickstart, `guardtrain[hydra]`),
#          `examples/plain_loop.py` (the README's plain loop), a GuardTuner smoke test
#   sdist: `examples/plain_loop.py`, the GuardTuner smoke test
#
# Each venv gets the CPU torch first (`pip install torch==$GUARDTRAIN_TORCH_VERSION`,
# a local wheel on the CI machine), then the artifact with scripts/constraints.txt (the
# releases the suite last passed with, as setup.sh installs them). pip's own settings
# (PIP_*, pip.conf) are used as they are. Exits non-zero on the first failure; the temp
# folder is removed on every exit.
#
#   PYTHON                    interpreter for the fresh venvs (python3.11)
#   GUARDTRAIN_TORCH_VERSION  torch to install into them (2.13.0)
#   GUARDTRAIN_CONSTRAINTS    the constraints file (scripts/constraints.txt); empty: none
#   GUARDTRAIN_DIST_TMP       where the temp folder goes (/dev/shm when it has 4 GiB
#                             free, else $TMPDIR or /tmp)
#   GUARDTRAIN_KEEP_DIST=1    keep the temp folder (its path is printed)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
t0=$(date +%s)
python=${PYTHON:-python3.11}
torch_version=${GUARDTRAIN_TORCH_VERSION:-2.13.0}
constraints=${GUARDTRAIN_CONSTRAINTS-scripts/constraints.txt}
pin=()
[ -z "$constraints" ] || pin=(-c "$root/$constraints")

# The two venvs are about 55,000 files (2 GB): on a slow disk writing and removing them
# takes minutes, in memory seconds. /dev/shm is used where it has 4 GiB free.
tmp=${GUARDTRAIN_DIST_TMP:-}
if [ -z "$tmp" ]; then
    tmp=${TMPDIR:-/tmp}
    if [ -d /dev/shm ] && [ -w /dev/shm ] \
        && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -ge $((4 * 1024 * 1024)) ]; then
        tmp=/dev/shm
    fi
fi
work=$(mktemp -d "$tmp/guardtrain-dist.XXXXXX")
pids=()
cleanup() {
    local pid
    for pid in "${pids[@]}"; do  # the installs this script started, if still running
        if kill -0 "$pid" 2>/dev/null; then
            pkill -P "$pid" 2>/dev/null || true  # its pip
            kill "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
        fi
    done
    if [ "${GUARDTRAIN_KEEP_DIST:-}" = 1 ]; then
        echo "check_dist: kept $work"
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT

step() { echo "check_dist: $*"; }
fail() {
    echo "check_dist: FAILED: $*" >&2
    exit 1
}
since() { echo "$(($(date +%s) - t0)) s"; }
quiet() { grep -v -e '^WARNING: Location' -e '^$' || true; }

# 1. Sources: the working tree's tracked and untracked, not ignored, files (no .venv,
#    build/, *.egg-info or caches can reach the artifacts).
src="$work/src"
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
    | tar -c --null -T - | tar -x -C "$src"
step "copied $(find "$src" -type f | wc -l) source files into $work"

# 2. Build, with `build` from .venv or else from a temp venv.
if [ -x .venv/bin/python ] && .venv/bin/python -c "import build" 2>/dev/null; then
    builder=.venv/bin/python
else
    step "build is not in .venv: installing it into a temp venv"
    "$python" -m venv "$work/build-venv"
    "$work/build-venv/bin/python" -m pip install -q "${pin[@]}" build 2>&1 | quiet \
        || fail "pip install build"
    builder="$work/build-venv/bin/python"
fi
dist="$work/dist"
"$builder" -m build --sdist --wheel --outdir "$dist" "$src" >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log" >&2; fail "python -m build"; }
shopt -s nullglob
wheels=("$dist"/guardtrain-*.whl)
sdists=("$dist"/guardtrain-*.tar.gz)
shopt -u nullglob
[ "${#wheels[@]}" = 1 ] || fail "expected one wheel in dist/, found ${#wheels[@]}"
[ "${#sdists[@]}" = 1 ] || fail "expected one sdist in dist/, found ${#sdists[@]}"
wheel=${wheels[0]}
sdist=${sdists[0]}
version=$("$builder" -c "import re, sys; print(re.search(r'__version__ = \"([^\"]+)\"', open(sys.argv[1]).read())[1])" guardtrain/_version.py)
case "$(basename "$wheel")" in
    "guardtrain-${version}-py3-none-any.whl") ;;
    *) fail "wheel $(basename "$wheel") is not guardtrain-${version}-py3-none-any.whl" ;;
esac
[ "$(basename "$sdist")" = "guardtrain-${version}.tar.gz" ] \
    || fail "sdist $(basename "$sdist") is not guardtrain-${version}.tar.gz"
step "built $(basename "$sdist") and $(basename "$wheel") ($(since))"

# 3. The wheel's contents; the sdist's sources.
"$builder" - "$wheel" "$sdist" <<'EOF' || fail "artifact contents"
import sys, tarfile, zipfile

wheel, sdist = sys.argv[1], sys.argv[2]
names = set(zipfile.ZipFile(wheel).namelist())
need = [
    "guardtrain/__init__.py",
    "guardtrain/py.typed",
    "guardtrain/conf/__init__.py",
    "hydra_plugins/guardtrain_searchpath/searchpath.py",
]
need += [f"guardtrain/conf/guard/{p}.yaml" for p in ("auto", "off", "safe", "balanced", "aggressive", "turbo")]
missing = [n for n in need if n not in names]
assert not missing, f"missing from the wheel: {missing}"
# benchmarks/ is the speed suite, run from a checkout: never installed
stray = sorted(n for n in names if n.split("/")[0] in ("tests", "scripts", "examples", "docs", "benchmarks") or "__pycache__" in n)
assert not stray, f"not part of the package, in the wheel: {stray[:10]}"
(entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
text = zipfile.ZipFile(wheel).read(entry).decode()
assert "guardtrain = guardtrain.bench:cli" in text, text
with tarfile.open(sdist) as tar:
    snames = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
for n in ("pyproject.toml", "README.md", "guardtrain/py.typed", "guardtrain/conf/guard/auto.yaml"):
    assert n in snames, f"missing from the sdist: {n}"
print(f"check_dist: wheel has py.typed, the guard group ({len(need) - 4} presets), the "
      f"search-path plugin and the `guardtrain` console script ({len(names)} files); "
      f"sdist has {len(snames)} entries")
EOF

# The smoke test: a tiny model trained by GuardTuner, its summary, and the same losses as
# an eager twin (backend eager: no compiler needed, seconds on a CPU).
cat >"$work/smoke.py" <<'EOF'
import copy, pathlib, sys

import torch
from torch import nn

import guardtrain
from guardtrain import GuardTuner

prefix = pathlib.Path(sys.prefix).resolve()
where = pathlib.Path(guardtrain.__file__).resolve()
assert prefix in where.parents, f"guardtrain imported from {where}, not from {prefix}"
assert guardtrain.__version__ == sys.argv[1], (guardtrain.__version__, sys.argv[1])
assert (where.parent / "py.typed").is_file(), "py.typed is not installed"
assert set(guardtrain.PRESET_NAMES) >= {"off", "safe", "balanced", "aggressive", "turbo", "auto"}

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
twin = copy.deepcopy(model)
opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(4)]
losses = {"guard": [], "eager": []}
with GuardTuner(
    model, preset="auto", warmup_steps=3, stable_steps=2, compile_kwargs={"backend": "eager"}
) as tuner:
    for i in range(40):
        x, y = batches[i % len(batches)]
        with tuner.step((x, y)):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opts[0].step()
            opts[0].zero_grad()
        losses["guard"].append(loss.item())
        loss = nn.functional.mse_loss(twin(x), y)
        loss.backward()
        opts[1].step()
        opts[1].zero_grad()
        losses["eager"].append(loss.item())
    summary = tuner.summary()
    table = tuner.format_summary()
assert summary["preset"] == "auto", summary["preset"]
assert summary["compiles"] >= 1, summary["compiles"]
assert summary["steady_steps"] > 0, summary["steady_steps"]
assert losses["guard"] == losses["eager"], "losses differ from the eager twin"
assert "guardtrain summary" in table, table
print(
    f"check_dist: GuardTuner smoke test: guardtrain {guardtrain.__version__} from {where.parent}, "
    f"{summary['compiles']} compile(s), {summary['steady_steps']} of 40 steps steady, "
    f"losses equal to eager"
)
EOF

# 4. One fresh venv per artifact: install, then run the examples outside the checkout.
install() {  # install NAME ARTIFACT EXTRA: a fresh venv, torch, then the artifact
    local name=$1 artifact=$2 extra=$3
    local py="$work/venv-$name/bin/python"
    "$python" -m venv "$work/venv-$name" || { echo "$python -m venv failed"; return 1; }
    "$py" -m pip install -q "torch==${torch_version}" || { echo "pip install torch failed"; return 1; }
    "$py" -m pip install -q "${pin[@]}" "guardtrain${extra} @ file://${artifact}" \
        || { echo "pip install $(basename "$artifact")${extra} failed"; return 1; }
    "$py" -m pip show -q guardtrain || { echo "guardtrain is not installed"; return 1; }
}
check() {  # check NAME ARTIFACT EXTRA PID EXAMPLES...: wait for PID's install, then run
    local name=$1 artifact=$2 extra=$3 pid=$4
    shift 4
    local venv="$work/venv-$name"
    local py="$venv/bin/python"
    wait "$pid" || { quiet <"$work/install-$name.log" | tail -30 >&2; fail "$name: install"; }
    step "$name: installed $(basename "$artifact")${extra} with torch" \
        "$("$py" -c 'import torch; print(torch.__version__)') into a fresh venv ($(since))"
    local run="$work/run-$name"
    mkdir -p "$run"
    (cd "$run" && "$py" "$work/smoke.py" "$version") || fail "$name: GuardTuner smoke test"
    (cd "$run" && "$venv/bin/guardtrain" --help >/dev/null) || fail "$name: guardtrain --help"
    step "$name: \`guardtrain --help\` runs"
    local example
    for example in "$@"; do
        # shellcheck disable=SC2086  # an example's arguments are words
        (cd "$run" && "$py" "$root"/examples/$example >"$run/example.log" 2>&1) \
            || { tail -30 "$run/example.log" >&2; fail "$name: examples/$example"; }
        grep -q "guardtrain summary" "$run/example.log" \
            || { tail -30 "$run/example.log" >&2; fail "$name: examples/$example printed no summary"; }
        step "$name: examples/$example ran: $(grep -m1 -o 'final val/loss=[0-9.]*' "$run/example.log")," \
            "phase $(grep -m1 -o '^  phase  *[a-z]*' "$run/example.log" | awk '{print $2}') ($(since))"
    done
}
# Both venvs are made at once (mostly waiting on the disk), then checked one after the other.
install wheel "$wheel" "[hydra]" >"$work/install-wheel.log" 2>&1 &
wheel_pid=$!
pids+=("$wheel_pid")
install sdist "$sdist" "" >"$work/install-sdist.log" 2>&1 &
sdist_pid=$!
pids+=("$sdist_pid")
check wheel "$wheel" "[hydra]" "$wheel_pid" "train.py +guard=auto" "plain_loop.py"
check sdist "$sdist" "" "$sdist_pid" "plain_loop.py"

step "OK: sdist and wheel of guardtrain ${version} build, install and run ($(since))"
