"""Data-only benchmark: decode + augment 224x224 JPEG shards through the training reader.

    python -m benchmarks.data_bench                     # writes benchmarks/results/data/
    python -m benchmarks.data_bench --images 512 --repeats 3 --out /tmp/data-bench   # quick

Measures images/s of the real training path (tar read -> JPEG decode -> random resized crop -> flip ->
RandAugment(2, 9) -> uint8 batch) for each worker count, and of the evaluation path (decode -> resize -> uint8
batch; also with the normalisation the trainer then applies, here on the CPU). The baseline in the same
invocation is the float32 path the reader had before: each image normalised to float32 in the worker (three
full passes, a non-contiguous result) and float32 batches across processes. All configurations run in this one
invocation, in alternating order, repeated; the median is reported with min-max (docs/benchmarks.md).
"""
import argparse
import csv
import io
import os
import platform
import tempfile
import time
from datetime import date

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from data.loader import ShardStream, TrainLoader, eval_batches
from data.shards import parse_spec
from data.transforms import EvalTransform, Normalize, TrainTransform
from models import build_model


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


class FloatPath:
    """The baseline: the transform's image normalised to float32 in the worker, as the reader did before
    (float32 from PIL, then subtract and divide over a channels-last view, giving a non-contiguous tensor)."""

    def __init__(self, transform, processor):
        self.transform = transform
        self.mean = torch.tensor(processor.image_mean).view(3, 1, 1)
        self.std = torch.tensor(processor.image_std).view(3, 1, 1)

    def __call__(self, img, rng=None):
        pixels = self.transform(img, rng).permute(1, 2, 0).numpy()  # the augmented PIL image's pixels
        x = torch.from_numpy(np.asarray(pixels, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - self.mean) / self.std


def time_train(spec, processor, workers: int, batch: int, batches: int, path: str) -> float:
    sources = parse_spec(spec, "bench")
    transform = TrainTransform(processor, 0.08, 0.5, 2, 9)
    stream = ShardStream(sources, mode="resampled", rank=0, world_size=1, num_workers=workers, micro_batch_size=batch,
                         shuffle_buffer=256, seed=0,
                         transform=FloatPath(transform, processor) if path == "float32" else transform)
    loader = TrainLoader(stream, workers)
    for _ in range(max(2, workers)):  # warm-up: worker start-up and first shards
        next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * batch / (time.perf_counter() - start)


def time_eval(spec, processor, batch: int, path: str) -> float:
    sources = parse_spec(spec, "bench")
    transform = FloatPath(EvalTransform(processor), processor) if path == "float32" else EvalTransform(processor)
    normalize = Normalize(processor) if path == "uint8+normalize" else (lambda x: x)
    start, n = time.perf_counter(), 0
    for images, _ in eval_batches(sources, transform, batch, 0, 1):
        n += len(normalize(images))
    return n / (time.perf_counter() - start)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2048, help="JPEGs in the benchmark shards")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=48, help="timed batches per measurement")
    ap.add_argument("--workers", default="0,1,2", help="DataLoader worker counts (0 = in the main process)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "data"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # each worker decodes on one core; the training ranks keep the rest
    _, processor = build_model("vit-small", 1000, 224)
    configs = ([("train", int(w), "uint8") for w in args.workers.split(",")]
               + [("train", int(w), "float32") for w in args.workers.split(",") if int(w) > 0]
               + [("eval", 0, "uint8"), ("eval", 0, "uint8+normalize"), ("eval", 0, "float32")])
    runs = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_jpeg_shards(tmp, args.images)
        shard_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        for r in range(args.repeats):
            order = configs if r % 2 == 0 else configs[::-1]  # A B C, C B A, ...
            for kind, workers, path in order:
                ips = time_train(spec, processor, workers, args.batch, args.batches, path) if kind == "train" \
                    else time_eval(spec, processor, args.batch, path)
                runs[kind, workers, path].append(ips)
                print(f"repeat {r}: {kind:5s} workers={workers} {path:15s}: {ips:7.1f} images/s", flush=True)

    os.makedirs(args.out, exist_ok=True)
    rows = []
    for (kind, workers, path), values in runs.items():
        per_worker = np.median(values) / max(1, workers)
        baseline = runs.get((kind, workers, "float32"))
        ratio = [v / b for v, b in zip(values, baseline)] if baseline and path != "float32" else None
        rows.append({"path": kind, "workers": workers, "batches": path,
                     "images_per_sec_median": round(float(np.median(values)), 1),
                     "vs_float32_median": round(float(np.median(ratio)), 2) if ratio else "",
                     "vs_float32_min": round(min(ratio), 2) if ratio else "",
                     "vs_float32_max": round(max(ratio), 2) if ratio else "",
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
        f.write(f"{meta}\n\n| path | workers | batches | images/s (median) | min-max | per worker | "
                f"vs float32, same repeat: median (min-max) |\n|---|---|---|---|---|---|---|\n")
        for row in rows:
            ratio = (f"{row['vs_float32_median']}x ({row['vs_float32_min']}-{row['vs_float32_max']})"
                     if row["vs_float32_median"] != "" else "")
            f.write(f"| {row['path']} | {row['workers']} | {row['batches']} | {row['images_per_sec_median']} | "
                    f"{row['min']}-{row['max']} | {row['per_worker']} | {ratio} |\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["path"], r["workers"]) for r in rows})
    labels = [f"{path}\n{workers} worker{'s' if workers != 1 else ''}" for path, workers in groups]
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"float32": ("#999999", -0.27), "uint8": ("#4c72b0", 0.0), "uint8+normalize": ("#55a868", 0.27)}
    for batches, (color, shift) in styles.items():
        mine = {(r["path"], r["workers"]): r for r in rows if r["batches"] == batches}
        xs = [i + shift for i, g in enumerate(groups) if g in mine]
        picked = [mine[g] for g in groups if g in mine]
        ax.bar(xs, [r["images_per_sec_median"] for r in picked], width=0.26, color=color, capsize=3,
               yerr=[[r["images_per_sec_median"] - r["min"] for r in picked],
                     [r["max"] - r["images_per_sec_median"] for r in picked]],
               label={"float32": "float32 batches (before)", "uint8": "uint8 batches",
                      "uint8+normalize": "uint8, normalised after (CPU)"}[batches])
    ax.set_xticks(range(len(groups)), labels, fontsize=8)
    ax.set_ylabel("images/s (median, min-max)")
    ax.set_title("Train: JPEG decode + crop + flip + RandAugment(2, 9); eval: decode + resize; 224²", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, meta[:110], fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(os.path.join(args.out, "throughput.png"), dpi=120)
    print(open(os.path.join(args.out, "results.md")).read())


if __name__ == "__main__":
    main()
