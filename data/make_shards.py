"""Write WebDataset tar shards: OUT/{split}-%06d.tar plus OUT/_info.json.

    python data/make_shards.py digits data/digits            # scikit-learn's bundled 8x8 digits

Each sample holds `__key__`, the image bytes (`png` here), `cls` (the label as text) and `txt`
(the class name). `_info.json` records sample counts per split and per shard and the class names.
"""
import argparse
import io
import json
import os
import sys

import numpy as np
import webdataset as wds
from PIL import Image


def digits_samples(seed: int, val_fraction: float):
    """{split: [(key, png bytes, label)]} from scikit-learn's bundled digits, with a fixed seeded split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 ink levels -> 8-bit grey
    order = np.random.default_rng(seed).permutation(len(images))
    n_val = int(round(len(images) * val_fraction))
    splits = {"train": order[n_val:], "val": order[:n_val]}
    out = {}
    for split, idx in splits.items():
        samples = []
        for i in idx:
            buf = io.BytesIO()
            Image.fromarray(images[i], mode="L").save(buf, format="PNG")
            samples.append((f"digits_{i:05d}", buf.getvalue(), int(digits.target[i])))
        out[split] = samples
    return out, [str(c) for c in digits.target_names]


def write_split(out_dir: str, split: str, samples, class_names, shard_size: int, image_ext: str = "png"):
    """Write one split's shards; returns its `_info.json` entry."""
    pattern = os.path.join(out_dir, f"{split}-%06d.tar")
    lengths = []
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0) as sink:
        for key, image, label in samples:
            sink.write({"__key__": key, image_ext: image, "cls": str(label), "txt": class_names[label]})
            if sink.count == 1:
                lengths.append(0)
            lengths[-1] += 1
    names = [os.path.basename(pattern % i) for i in range(len(lengths))]
    return {"num_samples": sum(lengths), "filenames": names, "shard_lengths": lengths}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="'digits' (the bundled default)")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--shard-size", type=int, default=400, help="samples per shard")
    ap.add_argument("--val-fraction", type=float, default=0.2, help="held-out fraction for the val split")
    ap.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    args = ap.parse_args(argv)
    if args.src != "digits":
        sys.exit(f"error: unsupported source '{args.src}' (supported: digits)")

    splits, class_names = digits_samples(args.seed, args.val_fraction)
    os.makedirs(args.out, exist_ok=True)
    info = {"name": "digits", "num_classes": len(class_names), "class_names": class_names, "splits": {}}
    for split, samples in splits.items():
        info["splits"][split] = write_split(args.out, split, samples, class_names, args.shard_size)
    tmp = os.path.join(args.out, "_info.json.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, os.path.join(args.out, "_info.json"))  # written last: its presence means the shards are whole
    for split, s in info["splits"].items():
        print(f"{split}: {s['num_samples']} samples in {len(s['filenames'])} shards -> {args.out}/{split}-*.tar")


if __name__ == "__main__":
    main()
