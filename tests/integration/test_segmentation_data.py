"""Segmentation's data path: image/mask shards written by data/make_shards.py (the bundled digits-on-a-canvas and
ADE20K's folder layout), read through real tar files and DataLoader workers, transformed together, and checked
before training."""
import io
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from test_data import read_tar, run_writer, write_shard
from transformers import ViTImageProcessorPil

from data.loader import IGNORE_INDEX, ShardStream, TrainLoader, check_masks, eval_batches
from data.shards import DataError, parse_spec
from data.transforms import SegEvalTransform, SegTrainTransform


def png(array, mode="L") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.asarray(array, np.uint8), mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def test_writer_digits_seg_labels_each_digits_ink(digits_seg):
    """digits-seg: 1797 canvases, each sample an image and a mask of its size. Checked against scikit-learn's
    digits themselves, not the writer's formula: canvas i shows digit i (its 8x8 image, upscaled 2x, in one 16x16
    cell) and labels that cell 1 + its class and nothing else; unlit pixels are background, strongly lit ones
    (>= half of full ink) labelled; each cell holds one label; every class turns up."""
    from sklearn.datasets import load_digits

    sk = load_digits()
    info = json.loads((digits_seg / "_info.json").read_text())
    assert info["task"] == "segmentation" and info["ignore_index"] == IGNORE_INDEX
    assert info["class_names"] == ["background"] + [str(d) for d in range(10)] and info["num_classes"] == 11
    keys, found = set(), set()
    for split in ("train", "val"):
        for name in info["splits"][split]["filenames"]:
            for key, s in read_tar(digits_seg / name).items():
                assert set(s) == {"png", "seg.png"}, s.keys()
                image, mask = (np.asarray(Image.open(io.BytesIO(s[k]))) for k in ("png", "seg.png"))
                assert image.shape == mask.shape == (32, 32)
                assert (mask[image == 0] == 0).all() and (mask[image >= 128] > 0).all(), key
                cells = {(y, x): (image[y:y + 16, x:x + 16], mask[y:y + 16, x:x + 16])
                         for y in (0, 16) for x in (0, 16)}
                for _, cell_mask in cells.values():
                    assert len(set(np.unique(cell_mask).tolist()) - {0}) <= 1, key  # one digit per cell
                i = int(key.rsplit("_", 1)[1])
                shown = np.kron(sk.images[i] / 16.0, np.ones((2, 2)))
                at = [c for c, (img, _) in cells.items() if np.abs(img / 255.0 - shown).max() < 0.01]
                assert at, f"{key}: sklearn's digit {i} is in none of the cells"
                assert any(set(np.unique(cells[c][1]).tolist()) == {0, 1 + int(sk.target[i])} for c in at), key
                found |= set(np.unique(mask).tolist())
                keys.add(key)
    assert len(keys) == 1797 and found == set(range(11))


def test_writer_pairs_in_ade20k_layout(tmp_path):
    """images/ and annotations/ matched by path; training/ and validation/ decide the splits; an image without its
    mask, or with a mask of another size, is reported and skipped; the masks are stored value for value; class
    names number the values found (255, the ignore index, is none)."""
    rng = np.random.default_rng(0)
    masks = {}
    for split, names in (("training", "abc"), ("validation", "d")):
        (tmp_path / "src" / "images" / split).mkdir(parents=True)
        (tmp_path / "src" / "annotations" / split).mkdir(parents=True)
        for n in names:
            Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)).save(
                tmp_path / "src" / "images" / split / f"{n}.jpg")
            if n == "c":
                continue  # no mask
            mask = rng.integers(0, 6, (12, 10) if n != "b" else (6, 5)).astype(np.uint8)
            mask[0, 0] = IGNORE_INDEX
            masks[f"{split}_{n}"] = mask
            (tmp_path / "src" / "annotations" / split / f"{n}.png").write_bytes(png(mask))
    out = run_writer(tmp_path / "src", tmp_path / "out", "--workers", "1")
    assert "skipped 2 unreadable items" in out and "training_b" in out and "training_c" in out
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    assert info["splits"]["train"]["num_samples"] == 1 and info["splits"]["val"]["num_samples"] == 1
    assert info["class_names"] == [str(i) for i in range(6)]
    for split, key in (("train", "training_a"), ("val", "validation_d")):
        sample = read_tar(tmp_path / "out" / f"{split}-000000.tar")[key]
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(sample["seg.png"]))), masks[key])

    # ADE20K's convention (--reduce-zero-label): 0, "other", is ignored and every class moves down by one
    run_writer(tmp_path / "src", tmp_path / "reduced", "--workers", "1", "--reduce-zero-label")
    info = json.loads((tmp_path / "reduced" / "_info.json").read_text())
    assert info["class_names"] == [str(i) for i in range(5)]
    reduced = np.asarray(Image.open(io.BytesIO(read_tar(tmp_path / "reduced" / "train-000000.tar")["training_a"][
        "seg.png"])))
    mask = masks["training_a"].astype(int)
    assert np.array_equal(reduced, np.where((mask == 0) | (mask == IGNORE_INDEX), IGNORE_INDEX, mask - 1))


def test_writer_hugging_face_dataset_with_a_mask_column(tmp_path):
    """A save_to_disk dataset with image and annotation columns (--mask-column): every pair once, the masks value
    for value, class names numbering the values found."""
    import datasets

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (8, 6, 3), dtype=np.uint8)) for _ in range(6)]
    masks = [rng.integers(0, 4, (8, 6)).astype(np.uint8) for _ in range(6)]
    ds = datasets.Dataset.from_dict({"image": images, "annotation": [Image.fromarray(m, mode="L") for m in masks]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "annotation": datasets.Image()}))
    ds.save_to_disk(str(tmp_path / "src"))
    run_writer(tmp_path / "src", tmp_path / "out", "--mask-column", "annotation", "--split", "train")
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    assert info["task"] == "segmentation" and info["class_names"] == ["0", "1", "2", "3"]
    samples = read_tar(tmp_path / "out" / "train-000000.tar")
    assert len(samples) == 6
    for key, sample in samples.items():
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(sample["seg.png"]))), masks[int(key)])


def synthetic_shard(path, n, size=24):
    """Samples whose grey image is 20 x its mask, pixel for pixel: any transform that moves the image and its mask
    alike keeps that relation."""
    rng = np.random.default_rng(1)
    samples = []
    for i in range(n):
        mask = np.kron(rng.integers(0, 11, (4, 4)), np.ones((size // 4, size // 4), np.int64)).astype(np.uint8)
        samples.append((f"s{i:03d}", {"png": png(mask * 20), "seg.png": png(mask)}))
    write_shard(path, samples)
    (path.parent / "_info.json").write_text(json.dumps({"splits": {"train": {
        "name": "train", "num_samples": n, "filenames": [path.name], "shard_lengths": [n]}}}))
    return parse_spec(str(path), "train_shards")


def stream(sources, transform, workers=2):  # the same samples in the same order whatever the transform
    ds = ShardStream(sources, mode="epoch", rank=0, world_size=1, num_workers=workers, micro_batch_size=4,
                     shuffle_buffer=8, seed=0, transform=transform, num_labels=11, task="segmentation")
    return ds, TrainLoader(ds, workers)


def test_crop_and_flip_move_the_image_and_its_mask_together(tmp_path):
    """Through DataLoader workers: (B, 3, 16, 16) uint8 images and (B, 16, 16) int64 masks, each image still 20 x
    its mask after the random resized crop and flip (nearest resampling here, so no pixel is blended); the
    photometric ops change the image and never the mask; the batches differ from the unaugmented ones."""
    sources = synthetic_shard(tmp_path / "train-000000.tar", 16)
    nearest = ViTImageProcessorPil(size={"height": 16, "width": 16}, resample=0)
    runs = []
    for transform in (SegTrainTransform(nearest, 0.3, 0.5, 0), SegTrainTransform(nearest, 0.3, 0.5, 2),
                      SegEvalTransform(nearest)):
        ds, loader = stream(sources, transform)
        runs.append([next(loader)[:2] for _ in range(ds.batches_per_rank_epoch())])
        del loader  # its worker processes end here, before any assertion
    moved = changed = 0
    for (images, masks), (images2, masks2), (_, masks0) in zip(*runs):
        assert images.shape == (4, 3, 16, 16) and images.dtype == torch.uint8
        assert masks.shape == (4, 16, 16) and masks.dtype == torch.int64
        assert torch.equal(images[:, 0].long(), masks * 20) and torch.equal(images[:, 2].long(), masks * 20)
        assert torch.equal(masks2, masks)
        changed += not torch.equal(images2, images)
        moved += not torch.equal(masks, masks0)
    assert len(runs[0]) == 4 and moved and changed


def test_check_masks_refuses_shards_of_another_task_or_too_few_labels(tmp_path, digits, digits_seg):
    """Classification shards, and masks whose values exceed num_labels: one DataError each, before training; the
    ignore index is no label."""
    with pytest.raises(DataError, match=r"train_shards: 64 of the first 64 samples of .* hold no mask \(seg.png\)"):
        check_masks(parse_spec(digits["train"], "train_shards"), 10, "train_shards")
    seg = parse_spec(f"{digits_seg}/train-{{000000..000003}}.tar", "train_shards")
    with pytest.raises(DataError, match=r"mask value \d+ outside \[0, 5\) \(num_labels\)"):
        check_masks(seg, 5, "train_shards")
    check_masks(seg, 11, "train_shards")


def test_eval_batches_yield_masks_and_skip_a_mask_out_of_range(tmp_path):
    """Every validation sample once, masks resized nearest-neighbour beside their images; a mask with a value
    outside [0, num_labels) (not the ignore index) is skipped with a warning."""
    mask = np.zeros((8, 8), np.uint8)
    mask[:4] = 3
    mask[0, 0] = IGNORE_INDEX
    bad = mask.copy()
    bad[7, 7] = 11
    write_shard(tmp_path / "val-000000.tar", [(f"v{i}", {"png": png(mask * 20), "seg.png": png(mask)})
                                              for i in range(5)] + [("bad", {"png": png(bad), "seg.png": png(bad)})])
    transform = SegEvalTransform(ViTImageProcessorPil(size={"height": 16, "width": 16}, resample=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(eval_batches(parse_spec(str(tmp_path / "val-000000.tar"), "val_shards"), transform, 4, 0, 1,
                                    num_labels=11, task="segmentation"))
    assert [b[1].shape for b in batches] == [(4, 16, 16), (1, 16, 16)]
    assert all(torch.equal(b[1][0], torch.from_numpy(np.kron(mask, np.ones((2, 2), np.uint8))).long())
               for b in batches)
    assert any("mask value 11 outside [0, 11)" in str(w.message) for w in caught)
