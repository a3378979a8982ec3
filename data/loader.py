"""A first WebDataset reader: endless resampled training stream, exact-once evaluation split across ranks.

Reading (tar -> samples), decoding (bytes -> PIL) and transforming (PIL -> normalised tensor) are
separate pipeline stages.
"""
import io
import json
import os
import random
import warnings

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from webdataset.shardlists import expand_urls

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


class DataError(ValueError):
    """A shard spec that matches nothing: reported as one line before training starts."""


def expand_shards(spec: str, what: str) -> list[str]:
    """The shard URLs of a brace spec; local files must exist and be non-empty."""
    if not spec:
        raise DataError(f"{what} is empty: give a WebDataset shard spec such as data/digits/train-{{000000..000003}}.tar")
    urls = expand_urls(spec)
    local = [u for u in urls if not u.startswith(("pipe:", "http://", "https://"))]
    missing = [u for u in local if not os.path.isfile(u)]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise DataError(f"{what} '{spec}': {len(missing)} of {len(urls)} shards not found ({shown})")
    empty = [u for u in local if os.path.getsize(u) == 0]
    if empty:
        raise DataError(f"{what} '{spec}': empty shard file {empty[0]}")
    return urls


def class_names(urls: list[str]):
    """Class names from the `_info.json` beside the first shard, or None."""
    path = os.path.join(os.path.dirname(urls[0]), "_info.json")
    if urls[0].startswith(("pipe:", "http://", "https://")) or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("class_names")


def make_transform(processor):
    """PIL image -> (3, H, W) float tensor, resized and normalised as the model's image processor does."""
    size = (processor.size["width"], processor.size["height"])
    resample = int(processor.resample)
    mean = torch.tensor(processor.image_mean).view(3, 1, 1)
    std = torch.tensor(processor.image_std).view(3, 1, 1)

    def transform(img: Image.Image) -> torch.Tensor:
        img = img.convert("RGB").resize(size, resample)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)  # (3, H, W)
        return (x - mean) / std

    return transform


def decode(sample: dict):
    """(PIL image, label) from a raw tar sample; raises on a corrupt image or label."""
    ext = next((k for k in IMAGE_KEYS if k in sample), None)
    if ext is None:
        raise ValueError(f"sample {sample.get('__key__')} has no image ({', '.join(IMAGE_KEYS)})")
    img = Image.open(io.BytesIO(sample[ext]))
    img.load()
    return img, int(sample["cls"])


def _shuffle(src, bufsize: int, seed: int):
    """Shuffle buffer seeded per (seed, rank, worker), so streams differ across ranks but repeat across runs."""
    rank, _, worker, _ = wds.utils.pytorch_worker_info()
    rng = random.Random(f"{seed}/{rank}/{worker}")
    buf = []
    for sample in src:
        buf.append(sample)
        if len(buf) >= bufsize:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


def _warn(exn):
    warnings.warn(f"skipped bad sample: {exn!r}")
    return True


def train_loader(urls, transform, micro_batch_size: int, num_workers: int, shuffle_buffer: int, seed: int):
    """Endless stream of (images, labels) micro-batches, shards sampled with replacement per rank and worker."""
    pipeline = wds.DataPipeline(
        wds.ResampledShards(urls, seed=seed, deterministic=True),  # seeds per rank and worker
        wds.tarfile_to_samples(handler=_warn),
        wds.pipelinefilter(_shuffle)(shuffle_buffer, seed),
        wds.map(decode, handler=_warn),
        wds.map_tuple(transform, lambda y: y),
        wds.batched(micro_batch_size, partial=False),
    )
    return torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=num_workers,
                                       persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available())


def eval_loader(urls, transform, batch_size: int, rank: int, world_size: int):
    """Each sample exactly once across ranks; ranks may get different batch counts (see train.evaluate)."""
    if len(urls) >= world_size:  # whole shards per rank
        stages = [wds.SimpleShardList(urls[rank::world_size]), wds.tarfile_to_samples(handler=_warn)]
    else:  # fewer shards than ranks: every rank reads all of them and keeps every world_size-th sample
        stages = [wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=_warn), wds.slice(rank, None, world_size)]
    pipeline = wds.DataPipeline(*stages, wds.map(decode, handler=_warn), wds.map_tuple(transform, lambda y: y),
                                wds.batched(batch_size, partial=True))
    return torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=0)
