"""Write WebDataset tar shards: OUT/{split}-%06d.tar plus OUT/_info.json.

    python data/make_shards.py digits data/digits                       # scikit-learn's bundled 8x8 digits
    python data/make_shards.py ~/imagenet/train data/in1k --split train --shard-size 1000
    python data/make_shards.py ~/imagenet/val data/in1k --split val      # a second split beside the first
    python data/make_shards.py ~/flowers data/flowers --val-fraction 0.1  # image folder -> train + val
    python data/make_shards.py ~/hf_saved data/x --image-column img --label-column label   # save_to_disk
    python data/make_shards.py ~/parquet_dir data/x                      # a folder of parquet files
    python data/make_shards.py digits-seg data/digits-seg                # segmentation: digits on a canvas
    python data/make_shards.py ~/ADEChallengeData2016 data/ade20k        # images/ + annotations/ pairs
    python data/make_shards.py ~/hf_seg data/x --mask-column annotation  # segmentation from save_to_disk

SRC is `digits`, an image folder with one sub-folder per class (ImageNet layout), a Hugging Face
`datasets` dataset saved with `save_to_disk`, or a folder of parquet files. Each sample holds
`__key__`, the image bytes as they came (`jpg`/`png`/`webp`; re-encoded only with --resize or
--format), `cls` (label index as text) and `txt` (class name). `_info.json` records the sample
counts per split and per shard and the class names, in the layout timm's WebDataset reader reads.
Unreadable images are skipped, counted and listed at the end; they never stop the run.

Segmentation (`digits-seg`, or a folder holding `images/` and `annotations/` as ADE20K's does): each sample holds
the image and `seg.png`, its mask (8-bit, a class index per pixel, 255 ignored); docs/data.md gives the layout.
"""
import argparse
import io
import json
import multiprocessing as mp
import os
import random
import sys

import webdataset as wds
from PIL import Image
from tqdm import tqdm

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
EXT_FORMAT = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
IGNORE_INDEX = 255  # a mask value no loss or metric counts (data/loader.py reads the same)


# ---------------------------------------------------------------- sources: (key, payload, label) items
def digits_items():
    """scikit-learn's digits as 8-bit grey PNGs; class names are the digits."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 ink levels -> 8-bit grey
    items = []
    for i, (image, label) in enumerate(zip(images, digits.target)):
        buf = io.BytesIO()
        Image.fromarray(image, mode="L").save(buf, format="PNG")
        items.append((f"digits_{i:05d}", buf.getvalue(), int(label)))
    return items, [str(c) for c in digits.target_names]


SEG_CANVAS, SEG_DIGIT = 32, 16  # digits-seg: a 32x32 canvas of 16x16 digits (the 8x8 ones, upscaled)


def digits_seg_items():
    """Segmentation from real data: each canvas holds one to three of scikit-learn's digits, upscaled to 16x16 and
    placed at random without overlap; each pixel of a digit's ink is labelled 1 + the digit, everything else
    0 (background). Canvas i holds digit i and, from a generator seeded by i, up to two others."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    ink = np.kron(np.round(digits.images * (255.0 / 16.0)).astype(np.uint8), np.ones((2, 2), np.uint8))
    cells = [(y, x) for y in range(0, SEG_CANVAS, SEG_DIGIT) for x in range(0, SEG_CANVAS, SEG_DIGIT)]
    items = []
    for i in range(len(digits.images)):
        rng = random.Random(f"digits-seg/{i}")
        chosen = [i] + [rng.randrange(len(digits.images)) for _ in range(rng.randint(0, 2))]
        image = np.zeros((SEG_CANVAS, SEG_CANVAS), np.uint8)
        mask = np.zeros((SEG_CANVAS, SEG_CANVAS), np.uint8)
        for d, (y, x) in zip(chosen, rng.sample(cells, len(chosen))):
            region = (slice(y, y + SEG_DIGIT), slice(x, x + SEG_DIGIT))
            image[region] = ink[d]
            mask[region][ink[d] >= 64] = 1 + int(digits.target[d])
        items.append((f"digits_seg_{i:05d}", _png(image), _png(mask)))
    return items, ["background"] + [str(c) for c in digits.target_names]


def _key(relative_path: str) -> str:
    """A sample's `__key__` from its file's path below the source: no dots or slashes (WebDataset splits on them)."""
    return os.path.splitext(relative_path)[0].replace("/", "_").replace(".", "_")


def _png(array) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def pair_items(root: str):
    """Segmentation pairs in ADE20K's layout: root/images/**/<name>.<jpg|png> and root/annotations/**/<name>.png,
    matched by their path below images/ and annotations/ (an image without its mask is reported and skipped).
    Class names from root/classes.txt (one per line, in label order) or else the label values found are named by
    number. Returns items (key, image path, mask path or None, split or None): a first folder named
    training/train or validation/val decides the split."""
    images, annotations = os.path.join(root, "images"), os.path.join(root, "annotations")
    items = []
    for dirpath, _, files in sorted(os.walk(images)):
        for f in sorted(files):
            if not f.lower().endswith(IMAGE_SUFFIXES):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), images)
            mask = os.path.join(annotations, os.path.splitext(rel)[0] + ".png")
            first = rel.split(os.sep)[0] if os.sep in rel else ""
            split = {"training": "train", "train": "train", "validation": "val", "val": "val"}.get(first)
            key = _key(rel)
            items.append((key, os.path.join(images, rel), mask if os.path.isfile(mask) else None, split))
    names_file = os.path.join(root, "classes.txt")
    if os.path.isfile(names_file):
        with open(names_file) as fh:
            return items, [line.strip() for line in fh if line.strip()]
    return items, _numbered_classes([mask for _, _, mask, _ in items])


def hf_pair_items(src: str, image_column: str, mask_column: str):
    """Segmentation pairs from a `save_to_disk` directory or parquet files: an image column and a mask column, both
    kept as stored; class names number the mask values found."""
    ds = _load_hf(src)
    for column in (image_column, mask_column):
        if column not in ds.column_names:
            raise SystemExit(f"error: column '{column}' not in {ds.column_names} (see --image-column/--mask-column)")
    masks = _stored(ds, mask_column)
    items = [(f"{i:08d}", image, mask) for i, (image, mask) in enumerate(zip(_stored(ds, image_column), masks))]
    return items, _numbered_classes(masks)


def _numbered_classes(masks) -> list:
    """'0' to the largest mask value found (the ignore index aside), for shards whose classes have no names."""
    import numpy as np

    top = 0
    for mask in masks:
        if mask is None:
            continue
        with Image.open(io.BytesIO(mask) if isinstance(mask, (bytes, bytearray)) else mask) as m:
            top = max([top] + [int(v) for v in np.unique(np.asarray(m)) if v != IGNORE_INDEX])
    return [str(i) for i in range(top + 1)]


def folder_items(root: str):
    """ImageNet layout: root/<class>/<image>; classes sorted by name, as torchvision's ImageFolder does."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise SystemExit(f"error: '{root}' has no class sub-folders")
    items = []
    for label, name in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, name))):
            for f in sorted(files):
                if f.lower().endswith(IMAGE_SUFFIXES):
                    path = os.path.join(dirpath, f)
                    key = _key(os.path.relpath(path, root))
                    items.append((key, path, label))  # a path: read in the worker processes
    return items, classes


def _load_hf(src: str):
    """The one split of a `save_to_disk` directory or a folder of parquet files."""
    import datasets

    if os.path.isfile(os.path.join(src, "dataset_info.json")) or os.path.isfile(os.path.join(src, "state.json")):
        ds = datasets.load_from_disk(src)
    else:
        files = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".parquet"))
        if not files:
            raise SystemExit(f"error: '{src}' holds neither a save_to_disk dataset nor parquet files")
        ds = datasets.load_dataset("parquet", data_files=files, split="train")
    if isinstance(ds, datasets.DatasetDict):
        raise SystemExit(f"error: '{src}' holds several splits ({', '.join(ds)}): point at one of them")
    return ds


def _stored(ds, column: str):
    """Each row's bytes (or path) of an image column, as stored: nothing decoded here."""
    import datasets

    if isinstance(ds.features[column], datasets.Image):
        ds = ds.cast_column(column, datasets.Image(decode=False))
    out = []
    for row in ds.select_columns([column]):
        image = row[column]
        payload = image.get("bytes") if isinstance(image, dict) else image
        if payload is None and isinstance(image, dict) and image.get("path"):
            payload = image["path"]
        out.append(payload)
    return out


def hf_items(src: str, image_column: str, label_column: str):
    """A `save_to_disk` directory or a folder of parquet files, images kept as their stored bytes."""
    import datasets

    ds = _load_hf(src)
    for column in (image_column, label_column):
        if column not in ds.column_names:
            raise SystemExit(f"error: column '{column}' not in {ds.column_names} (see --image-column/--label-column)")
    feature = ds.features[label_column]
    names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    items = [(f"{i:08d}", payload, label) for i, (payload, label) in enumerate(zip(_stored(ds, image_column),
                                                                                  ds[label_column]))]
    if names is None:
        labels = sorted({label for _, _, label in items if label is not None}, key=str)
        names = [str(label) for label in labels]
        index = {label: i for i, label in enumerate(labels)}
        items = [(k, p, index.get(label)) for k, p, label in items]
    return items, names


# ---------------------------------------------------------------- per-item work, in worker processes
def encode(item, resize: int, fmt: str):
    """(key, ext, bytes, label, None) or (key, None, None, None, reason) for an unreadable item."""
    key, payload, label = item
    try:
        if label is None or not isinstance(label, int) or label < 0:
            raise ValueError(f"missing or malformed label {label!r}")
        data = payload if isinstance(payload, (bytes, bytearray)) else open(payload, "rb").read()
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # decodes fully: catches truncated and corrupt files, not just bad headers
            source_format = img.format
            if resize or fmt or source_format not in FORMAT_EXT:
                out_format = EXT_FORMAT[fmt] if fmt else FORMAT_EXT.get(source_format, "PNG")
                if resize:
                    scale = resize / min(img.size)  # shorter side to `resize`, aspect kept
                    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                                     Image.BICUBIC)
                if out_format == "JPEG" and img.mode not in ("RGB", "L"):
                    img = img.convert("RGB")
                buf = io.BytesIO()
                img.save(buf, format=out_format, quality=90) if out_format == "JPEG" else img.save(buf, format=out_format)
                data, source_format = buf.getvalue(), out_format
        return key, FORMAT_EXT[source_format], bytes(data), label, None
    except Exception as e:  # any unreadable input is reported, never fatal
        return key, None, None, None, f"{type(e).__name__}: {e}"


def encode_pair(item, resize: int, fmt: str, reduce_zero_label: bool = False):
    """A segmentation pair: (key, ext, image bytes, mask PNG bytes, None) or (key, None, None, None, reason). The
    mask is stored as an 8-bit single-channel PNG, resized with nearest-neighbour alongside the image.
    `reduce_zero_label`: value 0 (ADE20K's "other") becomes the ignore index and every other value v becomes v - 1."""
    key, payload, mask_payload = item
    if mask_payload is None:
        return key, None, None, None, "no mask beside the image"
    key, ext, data, _, error = encode((key, payload, 0), resize, fmt)
    if error:
        return key, None, None, None, error
    try:
        raw = mask_payload if isinstance(mask_payload, (bytes, bytearray)) else open(mask_payload, "rb").read()
        with Image.open(io.BytesIO(raw)) as mask, Image.open(io.BytesIO(data)) as img:
            mask.load()
            if mask.mode not in ("L", "P"):
                raise ValueError(f"mask mode {mask.mode}: a mask holds one 8-bit channel of class indices")
            if reduce_zero_label:
                mask = mask.convert("L").point(lambda v: IGNORE_INDEX if v in (0, IGNORE_INDEX) else v - 1)
            if resize:
                mask = mask.resize(img.size, Image.NEAREST)
            elif mask.size != img.size:
                raise ValueError(f"mask {mask.size[0]}x{mask.size[1]} for an image of {img.size[0]}x{img.size[1]}")
            buf = io.BytesIO()
            mask.save(buf, format="PNG")
        return key, ext, data, buf.getvalue(), None
    except Exception as e:
        return key, None, None, None, f"{type(e).__name__}: {e}"


def _encode_star(args):
    return encode(*args)


def _encode_pair_star(args):
    return encode_pair(*args)


def write_split(out_dir: str, split: str, items, class_names, shard_size: int, resize: int, fmt: str,
                workers: int, bad: list, segmentation: bool = False, reduce_zero_label: bool = False):
    """Write one split's shards in item order; returns its `_info.json` entry. A classification sample holds
    the image, `cls` and `txt`; a segmentation one the image and its mask (`seg.png`)."""
    pattern = os.path.join(out_dir, f"{split}-%06d.tar")
    lengths = []
    jobs = ((item, resize, fmt, reduce_zero_label) if segmentation else (item, resize, fmt) for item in items)
    with mp.Pool(workers) if workers > 1 else _Serial() as pool, \
            wds.ShardWriter(pattern, maxcount=shard_size, verbose=0) as sink:
        results = pool.imap(_encode_pair_star if segmentation else _encode_star, jobs, chunksize=16)
        for key, ext, data, label, error in tqdm(results, total=len(items), desc=f"{split} shards", unit="img",
                                                 disable=not sys.stderr.isatty()):
            if error:
                bad.append((key, error))
                continue
            sink.write({"__key__": key, ext: data, "seg.png": label} if segmentation else
                       {"__key__": key, ext: data, "cls": str(label), "txt": class_names[label]})
            if sink.count == 1:
                lengths.append(0)
            lengths[-1] += 1
    names = [os.path.basename(pattern % i) for i in range(len(lengths))]
    return {"name": split, "num_samples": sum(lengths), "filenames": names, "shard_lengths": lengths}


class _Serial:
    """Pool stand-in for --workers 1."""

    def imap(self, fn, iterable, chunksize=1):
        return map(fn, iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="'digits', an image folder, a save_to_disk directory or a folder of parquet files")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--shard-size", type=int, default=400, help="samples per shard (default 400)")
    ap.add_argument("--split", default=None, help="write everything as this split (default: train + val)")
    ap.add_argument("--val-fraction", type=float, default=0.2, help="held-out fraction when splitting (default 0.2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the shuffle and train/val split")
    ap.add_argument("--resize", type=int, default=0, help="re-encode with the shorter side at this many pixels")
    ap.add_argument("--format", choices=sorted(EXT_FORMAT), default=None, help="re-encode to this format")
    ap.add_argument("--image-column", default="image", help="image column of a Hugging Face dataset")
    ap.add_argument("--label-column", default="label", help="label column of a Hugging Face dataset")
    ap.add_argument("--mask-column", default=None,
                    help="segmentation: the mask column of a Hugging Face dataset (writes image/mask shards)")
    ap.add_argument("--reduce-zero-label", action="store_true",
                    help="segmentation: mask value 0 is ignored (255) and v becomes v - 1 (ADE20K's 'other' is 0)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoding processes")
    args = ap.parse_args(argv)

    fixed_splits, segmentation = None, False
    if args.src == "digits":
        items, class_names, name = *digits_items(), "digits"
    elif args.src == "digits-seg":
        items, class_names, name, segmentation = *digits_seg_items(), "digits-seg", True
    elif not os.path.isdir(args.src):
        sys.exit(f"error: source '{args.src}' is neither 'digits', 'digits-seg' nor a directory")
    elif os.path.isdir(os.path.join(args.src, "images")) and os.path.isdir(os.path.join(args.src, "annotations")):
        pairs, class_names = pair_items(args.src)
        items, segmentation = [(k, i, m) for k, i, m, _ in pairs], True
        name = os.path.basename(os.path.normpath(args.src))
        if not args.split and pairs and all(split for *_, split in pairs):  # training/ and validation/ folders
            fixed_splits = {split: [(k, i, m) for k, i, m, sp in pairs if sp == split] for split in ("train", "val")}
    elif args.mask_column and any(f.endswith((".arrow", ".parquet", ".json")) for f in os.listdir(args.src)):
        items, class_names = hf_pair_items(args.src, args.image_column, args.mask_column)
        name, segmentation = os.path.basename(os.path.normpath(args.src)), True
    elif any(f.endswith((".arrow", ".parquet", ".json")) for f in os.listdir(args.src)):
        items, class_names, name = *hf_items(args.src, args.image_column, args.label_column), os.path.basename(
            os.path.normpath(args.src))
    else:
        items, class_names, name = *folder_items(args.src), os.path.basename(os.path.normpath(args.src))
    if not items:
        sys.exit(f"error: no images found in '{args.src}'")
    if args.reduce_zero_label and not segmentation:
        sys.exit("error: --reduce-zero-label applies to segmentation masks only")
    if args.reduce_zero_label and class_names and class_names[0] == "0":  # numbered from the values found
        class_names = [str(i) for i in range(len(class_names) - 1)]

    random.Random(args.seed).shuffle(items)  # shards hold a mix of classes, so any shard is a fair sample
    if args.split:
        splits = {args.split: items}
    elif fixed_splits:
        splits = {k: v for k, v in fixed_splits.items() if v}
        for v in splits.values():
            random.Random(args.seed).shuffle(v)
    else:
        n_val = int(round(len(items) * args.val_fraction))
        splits = {"train": items[n_val:], "val": items[:n_val]}
    os.makedirs(args.out, exist_ok=True)
    info_path = os.path.join(args.out, "_info.json")
    info = {"name": name, "num_classes": len(class_names), "class_names": class_names, "splits": {}}
    if segmentation:
        info.update(task="segmentation", ignore_index=IGNORE_INDEX)
    if args.split and os.path.isfile(info_path):  # adding a split to an existing output keeps the others
        with open(info_path) as f:
            info["splits"] = json.load(f).get("splits", {})
    bad = []
    for split, split_items in splits.items():
        info["splits"][split] = write_split(args.out, split, split_items, class_names, args.shard_size,
                                            args.resize, args.format, args.workers, bad, segmentation,
                                            args.reduce_zero_label)
    tmp = info_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, info_path)  # written last: its presence means the shards are whole
    for split in splits:
        s = info["splits"][split]
        key = "train_shards" if split == "train" else "val_shards"
        print(f"{split}: {s['num_samples']} samples in {len(s['filenames'])} shards -> "
              f"{args.out}/{split}-{{000000..{len(s['filenames']) - 1:06d}}}.tar ({key}: {args.out} reads them all)")
    if bad:
        print(f"skipped {len(bad)} unreadable items:")
        for key, error in bad:
            print(f"  {key}: {error}")


if __name__ == "__main__":
    main()
