#!/usr/bin/env bash
# The GPU paths in one short script, for a session that is lent a GPU.
#   bash benchmarks/gpu_check.sh [OUT]                  # default OUT: benchmarks/results/gpu-check
#   PARTS="1 4" bash benchmarks/gpu_check.sh            # only those parts (default: 1 2 3 4)
# On one H200: parts 1 and 2 about 2 minutes, part 3 about 3 (7 short runs), part 4 about 6 (10 jobs of the
# gpu-small suite at ~35 s each, after the planner's calibration). All four exceed an 8-minute device window: run "1 4" first, then "2 3".
# 1. the GPU, versions, and a bf16 GEMM's rate (8192^3, the figure MFU is read against);
# 2. train.py's main job (digits) in bf16 on one rank over NCCL, with its torch.cuda memory figures;
# 3. the activation-checkpointing policies under ZeRO-3 in bf16 (none, selective, full, and offload, which
#    needs a GPU), fp16 with its loss scaler under ZeRO-2, and ZeRO++'s quantized communication
#    (ds_configs/zero3pp.json, CUDA kernels): 20 steps each, the last loss beside `none`'s;
# 4. the gpu-small benchmark suite (ViT-L/16, one GPU, one repeat: FSDP2 and ZeRO-3 at none, selective and full,
#    ZeRO-2 at none and selective): a check of the harness, not a result; its planner.md holds plan.py's bf16
#    predictions against torch.cuda.max_memory_allocated for each row and its step times calibrated on the GPU
#    at the suite's start (environment.json: the replayed operators' rates, and any that did not replay), and
#    traces/ a torch.profiler CUDA trace of one warm step per configuration.
# Each step has its own time limit, so one that hangs leaves the others' figures.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu-check}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
run() { local limit=$1; shift; timeout "$limit" "$@"; local rc=$?; [ $rc -eq 0 ] || echo "FAILED (exit $rc): $*"; }

echo "== 1. machine"
echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown), $(date -u +%F)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY - <<'EOF'
import time, torch, deepspeed, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}) | "
      f"deepspeed {deepspeed.__version__} | transformers {transformers.__version__}")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ a
rates = []
for _ in range(5):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize(); rates.append(10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12)
print(f"bf16 GEMM 8192^3: median {sorted(rates)[2]:.0f} TFLOP/s (min {min(rates):.0f}, max {max(rates):.0f})")
EOF
[ -f data/digits/_info.json ] || $PY data/make_shards.py digits data/digits

part() { [[ " ${PARTS:-1 2 3 4} " == *" $1 "* ]]; }

if part 2; then
echo "== 2. train.py, digits, bf16, 1 rank, NCCL"
run 150 $PY -m torch.distributed.run --nproc_per_node 1 train.py --config configs/digits-vit.yaml --precision bf16 \
  --save_every 0 --output_dir "$OUT/digits-bf16" --progress false > "$OUT/digits-bf16.log" 2>&1
grep -v "^\[" "$OUT/digits-bf16.log" | tail -4
tail -1 "$OUT/digits-bf16/metrics.jsonl" 2>/dev/null

fi

if part 3; then
echo "== 3. activation checkpointing on the GPU: 20 steps each, last loss"
policy() {  # precision stage ac [ds_config]
  local dir="$OUT/ac-$1-zero$2-${3//:/_}${4:+-$(basename "$4" .json)}"
  run 90 $PY -m torch.distributed.run --nproc_per_node 1 train.py --config configs/digits-vit.yaml --precision "$1" \
    --zero_stage "$2" --ac "$3" ${4:+--ds_config "$4"} --max_steps 20 --eval_every 0 --save_every 0 --output_dir "$dir" \
    --progress false > "$dir.log" 2>&1 || tail -5 "$dir.log"
  $PY - "$dir/metrics.jsonl" "$1 ZeRO-$2 $3 ${4:+$(basename "$4")}" <<'EOF' 2>&1 | tail -1
import json, sys
r = [json.loads(line) for line in open(sys.argv[1])][-1]
print(f"{sys.argv[2]:28s} step {r['step']}: loss {r['loss']:.6f} | peak {r['peak_mem_bytes'] / 2**20:.0f} MiB | "
      f"activations planned {r['ac/activation_bytes'] / 2**20:.1f} MiB | recompute {r['ac/recompute_flops_frac']:.1%} "
      f"| {r['images_per_sec']:.0f} img/s")
EOF
}
for ac in none selective full offload; do policy bf16 3 "$ac"; done
for ac in none selective; do policy fp16 2 "$ac"; done
# ZeRO++'s quantized weight gathers and gradient reduce-scatter run DeepSpeed's CUDA quantizer (refused on CPU);
# on one GPU hpZ's partition is the one rank, so this checks the quantized paths, not hpZ
policy bf16 3 none ds_configs/zero3pp.json

fi

if part 4; then
echo "== 4. the gpu-small benchmark suite"
# each job's warm-up step (step 5) traced with CUDA activity, one file per configuration, for diagnosis
mkdir -p "$OUT/traces"
BENCH_TRACE_DIR="$OUT/traces" BENCH_TRACE_STEP=5 run 420 $PY benchmarks/train_bench.py --suite gpu-small \
  --out "$OUT/suite" > "$OUT/suite.log" 2>&1
grep -v "it/s\]\|s/it\]" "$OUT/suite.log" | tail -40
echo "-- plan.py's predictions (bf16) against the suite's torch.cuda peaks"
tail -n +5 "$OUT/suite/planner.md" 2>/dev/null || echo "no planner.md"
fi
