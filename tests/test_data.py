"""The first reader: shard checks and evaluation coverage."""
import json
import os

import pytest
import torch
from data.loader import DataError, class_names, eval_loader, expand_shards, make_transform, train_loader
from models import build_model


def test_shards_and_info(digits):
    with open(os.path.join(digits["dir"], "_info.json")) as f:
        info = json.load(f)
    assert info["splits"]["train"]["num_samples"] + info["splits"]["val"]["num_samples"] == 1797
    assert sum(info["splits"]["train"]["shard_lengths"]) == info["splits"]["train"]["num_samples"]
    urls = expand_shards(digits["train"], "train_shards")
    assert len(urls) == len(info["splits"]["train"]["filenames"]) == 4
    assert class_names(urls) == [str(i) for i in range(10)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_covers_every_sample_once(digits, world_size):
    _, processor = build_model("vit-debug", 10, 16)
    urls = expand_shards(digits["val"], "val_shards")
    labels = []
    for rank in range(world_size):
        for images, y in eval_loader(urls, make_transform(processor), 64, rank, world_size):
            assert images.shape[1:] == (3, 16, 16)
            labels.append(y)
    assert len(torch.cat(labels)) == 359


def test_train_stream_is_seeded(digits):
    _, processor = build_model("vit-debug", 10, 16)
    urls = expand_shards(digits["train"], "train_shards")

    def first_labels(seed):
        batches = iter(train_loader(urls, make_transform(processor), 16, 0, 100, seed))
        return torch.cat([next(batches)[1] for _ in range(3)])

    assert first_labels(1).equal(first_labels(1))
    assert not first_labels(1).equal(first_labels(2))


def test_missing_and_empty(tmp_path):
    with pytest.raises(DataError, match="not found"):
        expand_shards(str(tmp_path / "x-{0..2}.tar"), "train_shards")
    with pytest.raises(DataError, match="is empty"):
        expand_shards("", "val_shards")
