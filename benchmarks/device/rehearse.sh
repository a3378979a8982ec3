#!/usr/bin/env bash
# The GPU machine's stack rehearsed on this CPU (make device-rehearsal): run it before any GPU call.
#   1. a venv of the GPU machine's Python with its packages ([installed] in benchmarks/device/stack.txt, from the
#      registry; torch 2.11 is the CUDA build, which runs on a CPU), and without what it lacks;
#   2. .whl/ built (benchmarks/device/wheels.sh) and installed as the GPU call installs it: offline, no
#      dependencies, into a --target folder on PYTHONPATH;
#   3. under it: tests/unit/test_compat.py, a 2-rank ZeRO-3 run of train.py, and benchmarks/gpu_check.sh end to end in
#      its smoke mode, whose output folder is held to what comes back from the GPU machine.
# Writes benchmarks/results/gpu-check/rehearsal.md: when it last passed, at which commit, with which versions.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device/common.sh
DEVICE_PY=$(device_python)
VENV=.venv-device
STACK=benchmarks/device/stack.txt
# DeepSpeed's JIT-built ops of this stack in its own folder: built against its torch, they must not replace the
# .venv's (the Makefile exports the .venv's folder to every target, this one too)
export TORCH_EXTENSIONS_DIR="$PWD/$VENV/torch_extensions"
started=$(date +%s)
step() { echo "== rehearsal: $*"; }

step "the GPU machine's packages in $VENV"
stamp="$VENV/.stack-$(sha1sum "$STACK" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  rm -rf "$VENV"
  "$DEVICE_PY" -m venv "$VENV"
  quiet "$VENV/bin/pip" install -q $(python3 benchmarks/device/stack.py installed)
  # a dependency of the registry's packages that the machine lacks must come from .whl/ alone, as it does there
  carried=$(python3 benchmarks/device/stack.py carried | sed 's/==.*//')
  quiet "$VENV/bin/pip" uninstall -q -y $carried 2>/dev/null || true
  touch "$stamp"
fi

step "wheels"
bash benchmarks/device/wheels.sh | tail -2
site=$(mktemp -d)
work=$(mktemp -d)
trap 'rm -rf "$site" "$work"' EXIT
quiet "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --root-user-action=ignore \
  --target "$site" .whl/*.whl
export PATH="$PWD/$VENV/bin:$PATH" PYTHONWARNINGS=ignore DS_ACCELERATOR=cpu
versions=$(PYTHONPATH=$site python3 -c "
import importlib.metadata as m, platform
print(f'Python {platform.python_version()}, ' + ', '.join(f'{n} {m.version(n)}' for n in
      ('torch', 'transformers', 'accelerate', 'deepspeed', 'webdataset', 'numpy')))")
echo "$versions"

step "tests/unit/test_compat.py"
t=$(date +%s)
PYTHONPATH=$site python3 -m pytest -q -p no:cacheprovider tests/unit/test_compat.py tests/integration/test_fresh_process.py > "$work/compat.log" 2>&1 \
  || { tail -40 "$work/compat.log"; echo "error: tests/unit/test_compat.py failed under the GPU machine's stack" >&2; exit 1; }
tail -1 "$work/compat.log"
compat_s=$(( $(date +%s) - t ))

step "train.py, 2 ranks, ZeRO-3 (torchrun)"
[ -f data/digits/_info.json ] || PYTHONPATH=$site python3 data/make_shards.py digits data/digits
t=$(date +%s)
PYTHONPATH=$site OMP_NUM_THREADS=1 python3 -m torch.distributed.run --standalone --nproc_per_node 2 train.py \
  --config configs/digits-vit.yaml --zero_stage 3 --max_steps 40 --eval_every 40 --save_every 40 \
  --output_dir "$work/zero3" --progress false > "$work/zero3.log" 2>&1 || { tail -30 "$work/zero3.log"; exit 1; }
grep "^done:" "$work/zero3.log"
train_line=$(grep "^done:" "$work/zero3.log" | sed 's/ | model saved to .*//; s/ | /, /g')  # no | in the table
train_s=$(( $(date +%s) - t ))

step "benchmarks/gpu_check.sh, smoke mode, its default parts and part 3 (it installs .whl/ itself, as on the GPU machine)"
t=$(date +%s)
SMOKE=1 PARTS="1 3 7 8 9" GPU_CHECK_SITE="$work/gpu_check_site" bash benchmarks/gpu_check.sh "$work/out" > "$work/gpu_check.out" 2>&1 \
  || { cat "$work/gpu_check.out" | tail -30; echo "error: gpu_check.sh's smoke mode did not pass every part" >&2; exit 1; }
check_s=$(( $(date +%s) - t ))
tail -12 "$work/gpu_check.out"
step "benchmarks/gpu_check.sh, smoke mode, its second call: PARTS=\"1 10\" (the race where memory binds)"
t=$(date +%s)
SMOKE=1 PARTS="1 10" GPU_CHECK_SITE="$work/gpu_check_site" bash benchmarks/gpu_check.sh "$work/out10" \
  > "$work/gpu_check10.out" 2>&1 || { tail -30 "$work/gpu_check10.out"; echo "error: part 10's smoke did not pass" >&2; exit 1; }
grep -q '| 10 | race | ok |' "$work/out10/report.md" || { tail -30 "$work/gpu_check10.out"; exit 1; }
race_s=$(( $(date +%s) - t ))
# what comes back from the GPU machine: at most 8 files of at most 16 MiB, 2 folders deep, plain names
listing=$(python3 - "$work/out" <<'PY'
import os, re, sys
root = sys.argv[1]
files = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]
want = {"gpu_check.log", "results.json", "report.md"}
problems = [f"missing {w}" for w in sorted(want - set(files))]
problems += [f"{f}: not a returned file" for f in files if f not in want | {"pareto.png"}
             and not re.fullmatch(r"traces/[\w.-]+\.json\.gz", f)]
problems += [f"{f}: over 16 MiB" for f in files if os.path.getsize(os.path.join(root, f)) > 16 * 2**20]
problems += [f"{f}: odd name or too deep" for f in files if not re.fullmatch(r"[\w.-]+(/[\w.-]+){0,2}", f)]
if len(files) > 8:
    problems.append(f"{len(files)} files, over 8")
if problems:
    sys.exit("error: the output folder would not come back whole: " + "; ".join(problems))
print(", ".join(f"{f} ({os.path.getsize(os.path.join(root, f)) // 1024} KiB)" for f in sorted(files)))
PY
)
echo "$listing"

report=benchmarks/results/gpu-check/rehearsal.md
mkdir -p "$(dirname "$report")"
cat > "$report" <<MD
# The GPU machine's stack, rehearsed on CPU

Last passed: $(date -u +%F) at commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!benchmarks/results' || echo " (with uncommitted changes)"), by \`make device-rehearsal\` in $(( $(date +%s) - started )) s.
Stack: $versions (benchmarks/device/stack.txt; the packages the GPU machine lacks installed from .whl/ as it installs them).

| step | result | seconds |
|---|---|---|
| tests/unit/test_compat.py | passed | $compat_s |
| train.py, 2 ranks, ZeRO-3, 40 steps (torchrun, CPU) | $train_line | $train_s |
| benchmarks/gpu_check.sh, SMOKE=1 PARTS="1 3 7 8 9" (its default parts and the main job under both engines, CPU, tiny shapes) | every part ok | $check_s |
| benchmarks/gpu_check.sh, SMOKE=1 PARTS="1 10" (the race where memory binds) | every part ok | $race_s |

Files it wrote, as a GPU call returns them: $listing.
MD
echo "rehearsal passed: $report"
