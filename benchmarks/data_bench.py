"""Data-only benchmark: decode + augment 224x224 JPEG shards through the training reader.

    python benchmarks/data_bench.py                     # writes benchmarks/results/data/
    python benchmarks/data_bench.py --images 512 --repeats 3 --out /tmp/data-bench   # quick

Measures images/s of the real training path (tar read -> JPEG decode -> random resized crop -> flip ->
RandAugment(2, 9) -> normalise -> batch) for each worker count, and of the evaluation path. All
configurations run in this one invocation, in alternating order, repeated; the median is reported with
min-max (docs/benchmarks.md).
"""
import argparse
import csv
import io
import os
import platform
import sys
import tempfile
import time
from datetime import date

import numpy as np
import torch
import webdataset as wds
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.loader import ShardStream, TrainLoader, eval_batches  # noqa: E402
from data.shards import parse_spec  # noqa: E402
from data.transforms import EvalTransform, TrainTransform  # noqa: E402
from models import build_model  # noqa: E402


def write_jpeg_shards(root: str, n: int, per_shard: int = 256):
    """Photo-like 224x224 JPEGs (smooth colour fields plus texture and noise, quality 90)."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:224, 0:224] / 224.0
    with wds.ShardWriter(os.path.join(root, "bench-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            f = rng.uniform(1, 6, 3)
            img = np.stack([np.sin(f[c] * (xx + rng.uniform()) * np.pi + f[(c + 1) % 3] * yy) for c in range(3)], -1)
            img = (img * 80 + 128 + rng.normal(0, 18, (224, 224, 3))).clip(0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            sink.write({"__key__": f"img{i:06d}", "jpg": buf.getvalue(), "cls": str(i % 1000)})
    return f"{root}/bench-{{000000..{(n - 1) // per_shard:06d}}}.tar"


def time_train(spec, processor, workers: int, batch: int, batches: int) -> float:
    sources = parse_spec(spec, "bench")
    stream = ShardStream(sources, mode="resampled", rank=0, world_size=1, num_workers=workers, micro_batch_size=batch,
                         shuffle_buffer=256, seed=0, transform=TrainTransform(processor, 0.08, 0.5, 2, 9))
    loader = TrainLoader(stream, workers)
    for _ in range(max(2, workers)):  # warm-up: worker start-up and first shards
        next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * batch / (time.perf_counter() - start)


def time_eval(spec, processor, batch: int) -> float:
    sources = parse_spec(spec, "bench")
    start, n = time.perf_counter(), 0
    for images, _ in eval_batches(sources, EvalTransform(processor), batch, 0, 1):
        n += len(images)
    return n / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2048, help="JPEGs in the benchmark shards")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=48, help="timed batches per measurement")
    ap.add_argument("--workers", default="0,1,2", help="DataLoader worker counts (0 = in the main process)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "data"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # each worker decodes on one core; the training ranks keep the rest
    _, processor = build_model("vit-small", 1000, 224)
    configs = [("train", int(w)) for w in args.workers.split(",")] + [("eval", 0)]
    runs = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_jpeg_shards(tmp, args.images)
        shard_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        for r in range(args.repeats):
            order = configs if r % 2 == 0 else configs[::-1]  # A B C, C B A, ...
            for kind, workers in order:
                ips = time_train(spec, processor, workers, args.batch, args.batches) if kind == "train" \
                    else time_eval(spec, processor, args.batch)
                runs[kind, workers].append(ips)
                print(f"repeat {r}: {kind:5s} workers={workers}: {ips:7.1f} images/s", flush=True)

    os.makedirs(args.out, exist_ok=True)
    rows = []
    for (kind, workers), values in runs.items():
        per_worker = np.median(values) / max(1, workers)
        rows.append({"path": kind, "workers": workers, "images_per_sec_median": round(float(np.median(values)), 1),
                     "min": round(min(values), 1), "max": round(max(values), 1),
                     "per_worker": round(float(per_worker), 1), "repeats": len(values)})
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    import subprocess

    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), capture_output=True, text=True).stdout.strip() or "unknown"
    meta = (f"commit {commit}; {cpu}, {os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}, "
            f"webdataset {wds.__version__ if hasattr(wds, '__version__') else '1.0.2'}; {date.today()}; "
            f"{args.images} JPEGs of 224x224 ({shard_bytes / args.images / 1024:.0f} KiB each), batch {args.batch}, "
            f"{args.batches} timed batches, {args.repeats} repeats")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"{meta}\n\n| path | workers | images/s (median) | min-max | per worker |\n|---|---|---|---|---|\n")
        for row in rows:
            f.write(f"| {row['path']} | {row['workers']} | {row['images_per_sec_median']} | {row['min']}-{row['max']} "
                    f"| {row['per_worker']} |\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r["path"] == "train"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["workers"] for r in train]
    ax.bar([str(x) for x in xs], [r["images_per_sec_median"] for r in train], color="#4c72b0",
           yerr=[[r["images_per_sec_median"] - r["min"] for r in train], [r["max"] - r["images_per_sec_median"]
                                                                          for r in train]], capsize=4)
    for r in rows:
        if r["path"] == "eval":
            ax.axhline(r["images_per_sec_median"], color="#dd8452", ls="--", label="eval path (resize only), 0 workers")
    ax.set_xlabel("DataLoader workers (0 = main process)")
    ax.set_ylabel("images/s (median, min-max)")
    ax.set_title("Train path: JPEG decode + crop + flip + RandAugment(2, 9), 224²", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, meta[:110], fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(os.path.join(args.out, "throughput.png"), dpi=120)
    print(open(os.path.join(args.out, "results.md")).read())


if __name__ == "__main__":
    main()
