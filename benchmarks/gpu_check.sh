#!/usr/bin/env bash
# The GPU paths in one short script, for a session that is lent a GPU (one H200 here); ~8 minutes.
#   bash benchmarks/gpu_check.sh     # writes benchmarks/results/gpu-check/
# 1. train.py in bf16 on one rank over NCCL (the main job's recipe, 200 steps), with its torch.cuda figures;
# 2. every activation-checkpointing policy, bf16, one rank: loss equal to `none` and the allocator's peak;
# 3. the gpu benchmark suite on the GPUs present, one repeat (a check of the harness, not a result).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/gpu-check
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
[ -f data/digits/_info.json ] || $PY data/make_shards.py digits data/digits
$PY -m torch.distributed.run --nproc_per_node 1 train.py --config configs/digits-vit.yaml --precision bf16 \
  --max_steps 200 --eval_every 200 --save_every 0 --output_dir "$OUT/digits-bf16" --progress false 2>&1 | tail -3 \
  | tee "$OUT/train.txt"
tail -1 "$OUT/digits-bf16/metrics.jsonl" >> "$OUT/train.txt"
for ac in none selective full hierarchical offload; do
  $PY -m torch.distributed.run --nproc_per_node 1 train.py --config configs/digits-vit.yaml --precision bf16 \
    --zero_stage 3 --ac $ac --max_steps 20 --eval_every 0 --save_every 0 --output_dir "$OUT/ac-$ac" --progress false \
    > /dev/null 2>&1 && echo "$ac $(tail -1 $OUT/ac-$ac/metrics.jsonl)" | tee -a "$OUT/ac.txt"
done
timeout 420 $PY benchmarks/train_bench.py --suite gpu --ranks "$($PY -c 'import torch; print(torch.cuda.device_count())')" \
  --repeats 1 --out "$OUT/suite" || echo "gpu suite: exit $?" | tee -a "$OUT/suite.txt"
