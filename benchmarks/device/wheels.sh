#!/usr/bin/env bash
# Build .whl/: the packages the GPU machine lacks ([carried] in benchmarks/device/stack.txt), as wheels for its
# Python, then check that they install offline there the way benchmarks/gpu_check.sh installs them.
#   bash benchmarks/device/wheels.sh            # from the repository root, after `make` (it builds with .venv)
# deepspeed is published as source only: it is built here with DS_BUILD_OPS=0, a py3-none-any wheel whose CUDA
# ops (none of which the GPU check uses) would be JIT-built on first use. Every other wheel is PyPI's own,
# for CPython 3.12 on manylinux x86-64.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device/common.sh
BUILD_PY=${BUILD_PY:-.venv/bin/python}  # has torch, which deepspeed's setup.py imports
DEVICE_PY=$(device_python)
OUT=.whl
LIMIT_MB=24  # of the 64 MiB the working tree and the wheels share on the way to the GPU machine
mkdir -p "$OUT"
rm -f "$OUT"/*.whl
# the commit the GPU check's reports name: the tree is copied to the GPU machine without its .git
git describe --always --dirty --abbrev=40 > "$OUT/COMMIT"
pyver=$("$BUILD_PY" benchmarks/device/stack.py python)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for req in $("$BUILD_PY" benchmarks/device/stack.py carried); do
  if [[ $req == deepspeed==* ]]; then
    DS_BUILD_OPS=0 quiet "$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$req"
  else
    quiet "$BUILD_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
      "${platforms[@]}" -d "$OUT" "$req"
  fi
done
echo "wheels in $OUT:"; ls -1 "$OUT"
total_kb=$(du -sk "$OUT" | cut -f1)
echo "total $((total_kb / 1024)) MiB (limit $LIMIT_MB MiB)"
[ "$total_kb" -le $((LIMIT_MB * 1024)) ] || { echo "error: $OUT is over $LIMIT_MB MiB" >&2; exit 1; }
# exactly one wheel per carried package, then the offline install the GPU check makes
[ "$(ls "$OUT"/*.whl | wc -l)" -eq "$("$BUILD_PY" benchmarks/device/stack.py carried | wc -l)" ] \
  || { echo "error: $OUT does not hold one wheel per [carried] package" >&2; exit 1; }
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
quiet "$DEVICE_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --root-user-action=ignore --target "$target" "$OUT"/*.whl
# what installed, read from the target's metadata (importing needs the machine's own packages: the rehearsal does)
"$DEVICE_PY" - "$target" <<'PY'
import importlib.metadata as m, sys
sys.path.insert(0, "benchmarks/device")
from stack import pins
found = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in m.distributions(path=[sys.argv[1]])}
if found != pins("carried"):
    sys.exit(f"error: the wheels installed {found}, not stack.txt's [carried] {pins('carried')}")
print("installed offline into a --target folder:", ", ".join(f"{k} {v}" for k, v in sorted(found.items())))
PY
