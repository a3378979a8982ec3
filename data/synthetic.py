"""`data_mode: synthetic`: random images and targets in the loader's own format, no shards read, for measuring the
training step alone (the GPU check, throughput sweeps). A few fixed micro-batches of uint8 images (pinned on GPUs)
are drawn from the seed and the rank and served in turn, so the step still copies and normalises its images;
classification and pretraining get class labels, segmentation masks."""
import itertools

import torch

POOL = 4  # distinct micro-batches served in turn
VAL_BATCHES = 2  # the validation set: this many micro-batches per rank


def _draw(n: int, micro_batch_size: int, image_size: int, num_labels: int, task: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        images = torch.randint(0, 256, (micro_batch_size, 3, image_size, image_size), dtype=torch.uint8, generator=g)
        shape = (micro_batch_size, image_size, image_size) if task == "segmentation" else (micro_batch_size,)
        targets = torch.randint(0, num_labels, shape, generator=g)
        if torch.cuda.is_available():
            images, targets = images.pin_memory(), targets.pin_memory()
        out.append((images, targets))
    return out


class SyntheticBatches:
    """What TrainLoader gives train.py (images, targets, meta) and its data position, which is only a count."""

    def __init__(self, micro_batch_size: int, image_size: int, num_labels: int, task: str, seed: int, rank: int):
        self.pool = _draw(POOL, micro_batch_size, image_size, num_labels, task, seed * 1009 + rank)
        self.cycle = itertools.cycle(self.pool)
        self.state = {"batches": 0}
        self.layout = {"mode": "synthetic", "seed": seed, "micro_batch_size": micro_batch_size}

    def __iter__(self):
        return self

    def __next__(self):
        images, targets = next(self.cycle)
        self.state["batches"] += 1
        return images, targets, {"skipped": 0, "padded": 0}

    def state_dict(self) -> dict:
        return {"streams": {}, "layout": self.layout}


def val_batches(micro_batch_size: int, image_size: int, num_labels: int, task: str, seed: int, rank: int):
    """A fresh pass over this rank's synthetic validation set."""
    return iter(_draw(VAL_BATCHES, micro_batch_size, image_size, num_labels, task, seed * 1009 + rank + 10**6))
