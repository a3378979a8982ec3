#!/usr/bin/env bash
# The GPU check, in one call on the GPU machine (one H200, its own Python, no network):
#   bash benchmarks/gpu_check.sh [OUT]        # OUT: $OUT where set (the device tool's folder), else
#                                             # benchmarks/results/gpu-check/latest
#   PARTS="5 6" bash benchmarks/gpu_check.sh  # a second call: the parts the first did not reach
#   PARTS="1 10" BUDGET_S=540 bash ...       # the race where memory binds (ViT-H/14 at 40 GiB), its own call
#   SMOKE=1 bash benchmarks/gpu_check.sh OUT  # on CPU with tiny shapes: the same files (make device-rehearsal)
#   GPU_CHECK_COMMIT=<hash> bash ...          # the commit the reports name (default: .whl/COMMIT, from make wheels)
# What each part measures, and the files it writes: benchmarks/gpu_check.py. The packages that machine lacks travel
# as wheels in .whl/ (benchmarks/device/wheels.sh builds them; the device call carries ".whl"); they are
# installed here as they are there: offline, without dependencies, into a folder on PYTHONPATH.
# BUDGET_S (480 s on the GPU) bounds the whole call: a part that does not fit what is left is not started.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-benchmarks/results/gpu-check/latest}}
PY=${PY:-python3}
if ! "$PY" -c "import deepspeed, webdataset" >/dev/null 2>&1; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "error: deepspeed or webdataset is missing and there is no .whl/ to" \
    "install them from: run bash benchmarks/device/wheels.sh here and carry .whl" >&2; exit 2; }
  site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --root-user-action=ignore --upgrade \
    --target "$site" .whl/*.whl || { echo "error: installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" -m benchmarks.gpu_check "$out"
