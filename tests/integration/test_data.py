"""The data pipeline: shard writer, streaming reader, bad data, exact resume, remote sources."""
import collections
import functools
import http.server
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import time
import threading

import numpy as np
import pytest
import torch
from conftest import REPO, check_input, run_entry
from data.loader import ShardStream, TrainLoader, eval_batches, merge_states, resume_state
from data.shards import DataError, parse_spec
from data.transforms import EvalTransform, Normalize, TrainTransform, mix_batch
from models import build_model
from PIL import Image

PROCESSOR = build_model("vit-debug", 10, 16)[1]


def png(value: int, size=8) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size), value, np.uint8), mode="L").save(buf, format="PNG")
    return buf.getvalue()


def write_shard(path, samples, truncate_to=None):
    """samples: (key, {ext: bytes}); optionally cut the file to `truncate_to` bytes, as a failed upload would."""
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if truncate_to is not None:
        with open(path, "r+b") as f:
            f.truncate(truncate_to)


def make_shards(root, n_shards, per_shard, prefix="train", key_prefix="s"):
    """Synthetic shards with unique keys, and the `_info.json` that gives their counts."""
    names = []
    for s in range(n_shards):
        name = f"{prefix}-{s:06d}.tar"
        write_shard(root / name, [(f"{key_prefix}{s}_{i:03d}", {"png": png(i % 250), "cls": str(i % 10).encode()})
                                  for i in range(per_shard)])
        names.append(name)
    info = {"class_names": [str(i) for i in range(10)],
            "splits": {prefix: {"name": prefix, "num_samples": n_shards * per_shard, "filenames": names,
                                "shard_lengths": [per_shard] * n_shards}}}
    (root / "_info.json").write_text(json.dumps(info))
    return f"{root}/{prefix}-{{000000..{n_shards - 1:06d}}}.tar"


def read_epoch(spec, world_size, num_workers, mbs, mode="epoch", batches=None, state=None, block=16, seed=0,
               grad_accum=1, streams=0, num_labels=None):
    """{rank: ([keys of each batch], loader)} read through real DataLoader worker processes. `state`: the run's
    data position, as resume_state gives it."""
    sources = parse_spec(spec, "train_shards")
    out = {}
    for rank in range(world_size):
        ds = ShardStream(sources, mode=mode, rank=rank, world_size=world_size, num_workers=num_workers,
                         micro_batch_size=mbs, shuffle_buffer=block, seed=seed, grad_accum_steps=grad_accum,
                         streams=streams, transform=TrainTransform(PROCESSOR, 1.0, 0.0, 0), state=state,
                         num_labels=num_labels)
        loader = TrainLoader(ds, num_workers)
        n = batches if batches is not None else ds.batches_per_rank_epoch()
        out[rank] = ([next(loader)[2]["keys"] for _ in range(n)], loader)
    return out


# ---------------------------------------------------------------- writer
def run_writer(*args):
    proc = subprocess.run([sys.executable, "data/make_shards.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def read_tar(path):
    samples = collections.defaultdict(dict)
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            samples[key][ext] = tar.extractfile(m).read()
    return samples


def test_writer_digits(digits):
    with open(os.path.join(digits["dir"], "_info.json")) as f:
        info = json.load(f)
    train, val = info["splits"]["train"], info["splits"]["val"]
    assert train["num_samples"] + val["num_samples"] == 1797 and val["num_samples"] == 359
    assert sum(train["shard_lengths"]) == train["num_samples"] and train["name"] == "train"
    keys = set()
    for name in train["filenames"] + val["filenames"]:
        samples = read_tar(os.path.join(digits["dir"], name))
        assert all(set(s) == {"png", "cls", "txt"} and s["cls"] == s["txt"] for s in samples.values())
        keys |= samples.keys()
    assert len(keys) == 1797  # every image once, none in both splits


def test_writer_image_folder_keeps_bytes_and_skips_corrupt(tmp_path):
    rng = np.random.default_rng(0)
    originals = {}
    for c in ("cat", "dog"):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(5):
            path = tmp_path / "src" / c / f"{i}.{'jpg' if i % 2 else 'png'}"
            Image.fromarray(rng.integers(0, 255, (12, 20, 3), dtype=np.uint8)).save(path)
            originals[f"{c}_{i}"] = path.read_bytes()
    (tmp_path / "src" / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    out = run_writer(tmp_path / "src", tmp_path / "out", "--split", "train", "--shard-size", "4", "--workers", "2")
    assert "skipped 1 unreadable items" in out and "dog_broken" in out
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    assert info["class_names"] == ["cat", "dog"]
    assert info["splits"]["train"]["shard_lengths"] == [4, 4, 2]
    samples = {}
    for name in info["splits"]["train"]["filenames"]:
        samples.update(read_tar(tmp_path / "out" / name))
    assert samples.keys() == originals.keys()
    for key, s in samples.items():
        ext = "jpg" if int(key[-1]) % 2 else "png"
        assert s[ext] == originals[key]  # bytes as they came, not re-encoded
        assert int(s["cls"]) == (key.startswith("dog")) and s["txt"].decode() == key.split("_")[0]

    run_writer(tmp_path / "src", tmp_path / "small", "--split", "train", "--resize", "6", "--format", "webp")
    sample = next(iter(read_tar(tmp_path / "small" / "train-000000.tar").values()))
    assert min(Image.open(io.BytesIO(sample["webp"])).size) == 6


@pytest.mark.parametrize("layout", ["save_to_disk", "parquet"])
def test_writer_hugging_face_dataset(tmp_path, layout):
    import datasets

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)) for _ in range(8)]
    features = datasets.Features({"img": datasets.Image(), "y": datasets.ClassLabel(names=["a", "b", "c"])})
    ds = datasets.Dataset.from_dict({"img": images, "y": [0, 1, 2, 0, 1, 2, 0, 1]}, features=features)
    src = tmp_path / "src"
    if layout == "save_to_disk":
        ds.save_to_disk(str(src))
    else:
        src.mkdir()
        ds.to_parquet(str(src / "part-0.parquet"))
    run_writer(src, tmp_path / "out", "--image-column", "img", "--label-column", "y", "--val-fraction", "0.25")
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    assert info["splits"]["train"]["num_samples"] == 6 and info["splits"]["val"]["num_samples"] == 2
    labels = collections.Counter()
    for split in ("train", "val"):
        for s in read_tar(tmp_path / "out" / f"{split}-000000.tar").values():
            labels[s["txt"].decode()] += 1
            assert info["class_names"][int(s["cls"])] == s["txt"].decode()
    assert labels == {"a": 3, "b": 3, "c": 2}


# ---------------------------------------------------------------- reader: coverage and equal batches
@pytest.mark.parametrize("n_shards,per_shard", [(4, 48), (3, 64)])  # (3, 64): fewer shards than 4 consumers
def test_epoch_covers_every_sample_once_with_equal_batches(tmp_path, n_shards, per_shard):
    spec = make_shards(tmp_path, n_shards, per_shard)
    epoch = read_epoch(spec, world_size=2, num_workers=2, mbs=8)
    counts = {rank: len(batches) for rank, (batches, _) in epoch.items()}
    assert len(set(counts.values())) == 1, counts
    keys = [k for batches, _ in epoch.values() for b in batches for k in b]
    assert len(keys) == len(set(keys)) == n_shards * per_shard
    # the next epoch is a different order of the same samples
    two = read_epoch(spec, world_size=2, num_workers=2, mbs=8, batches=2 * counts[0])
    second = [k for batches, _ in two.values() for b in batches[counts[0]:] for k in b]
    assert sorted(second) == sorted(keys) and second != keys


def test_bad_data_is_skipped_counted_and_batches_stay_equal(tmp_path):
    good = lambda s, i: (f"s{s}_{i:03d}", {"png": png(i), "cls": str(i % 10).encode()})
    write_shard(tmp_path / "train-000000.tar", [good(0, i) for i in range(40)])
    write_shard(tmp_path / "train-000001.tar", [good(1, i) for i in range(30)] + [
        ("bad_image", {"png": b"\x89PNG not an image", "cls": b"1"}),
        ("no_label", {"png": png(1)}),
        ("bad_label", {"png": png(1), "cls": b"seven"}),
        ("label_42", {"png": png(1), "cls": b"42"}),  # outside [0, num_labels): a corrupt sample, not a crash
    ] + [good(1, i) for i in range(30, 36)])
    write_shard(tmp_path / "train-000002.tar", [good(2, i) for i in range(40)])
    with open(tmp_path / "train-000002.tar", "r+b") as f:  # cut mid-member, as a failed upload leaves it
        f.truncate(os.path.getsize(tmp_path / "train-000002.tar") // 2 + 100)
    info = {"splits": {"train": {"filenames": [f"train-00000{i}.tar" for i in range(3)],
                                 "shard_lengths": [40, 40, 40]}}}
    (tmp_path / "_info.json").write_text(json.dumps(info))

    epoch = read_epoch(f"{tmp_path}/train-{{000000..000002}}.tar", world_size=2, num_workers=2, mbs=4, num_labels=10)
    counts = [len(batches) for batches, _ in epoch.values()]
    assert counts[0] == counts[1] == 14  # 120 slots / 4 consumers = 30 -> 7 batches of 4 per worker
    keys = [k for batches, _ in epoch.values() for batch in batches for k in batch]
    assert not {"bad_image", "no_label", "bad_label", "label_42"} & set(keys)
    assert all(k.startswith(("s0_", "s1_", "s2_")) for k in keys)
    assert len({k for k in keys if k.startswith("s2_")}) <= 25  # the truncated shard lost about half its samples
    skipped = sum(loader.skipped for _, loader in epoch.values())
    padded = sum(loader.padded for _, loader in epoch.values())
    assert skipped >= 4 and len(keys) - padded == len(set(keys))  # at most once, unless padded (counted)


def test_missing_pattern_and_dead_url_are_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="4 of 4 shards not found"):
        parse_spec(f"{tmp_path}/x-{{0..3}}.tar", "train_shards")
    with pytest.raises(DataError, match="is empty"):
        parse_spec("", "val_shards")
    with pytest.raises(DataError, match=r"cannot open 1 of 1 URLs, e.g. http://127.0.0.1:9/x.tar"):
        parse_spec("http://127.0.0.1:9/x.tar", "train_shards")


# ---------------------------------------------------------------- exact resume
def resume_from(part, step, **layout):
    """The data position a checkpoint after `step` steps of `part` gives a run with `layout`."""
    merged = merge_states([loader.state_dict() for _, loader in part.values()])
    saved = merged["layout"]
    now = dict(mode=saved["mode"], seed=saved["seed"], data_streams=0, micro_batch_size=saved["micro_batch_size"],
               shuffle_buffer=saved["shuffle_buffer"])
    state, streams, why = resume_state(json.loads(json.dumps(merged)), step=step, **{**now, **layout})
    assert why is None, why
    return state, streams


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
@pytest.mark.parametrize("stop_after", [5, 13])  # 13 batches: past the end of the first epoch (12 per rank)
def test_resume_reads_exactly_what_the_uninterrupted_run_reads(tmp_path, mode, stop_after):
    spec = make_shards(tmp_path, 3, 64)  # 192 samples / 4 streams / 8 = 6 batches per stream, 12 per rank
    total = 20
    full = read_epoch(spec, 2, 2, 8, mode=mode, batches=total)
    part = read_epoch(spec, 2, 2, 8, mode=mode, batches=stop_after)
    state, streams = resume_from(part, stop_after, world_size=2, grad_accum_steps=1, num_workers=2)
    rest = read_epoch(spec, 2, 2, 8, mode=mode, batches=total - stop_after, state=state, streams=streams)
    for rank in range(2):
        assert part[rank][0] + rest[rank][0] == full[rank][0]
    assert full[0][0] != full[1][0]


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
def test_resume_on_another_world_size_reads_the_same_global_batches(tmp_path, mode):
    """2 ranks x 1 micro-batch per step -> 1 rank x 2 accumulated micro-batches -> 2 ranks again, with
    2 workers per rank throughout: every optimizer step takes the same samples as the uninterrupted 2-rank run,
    across the end of the first epoch; nothing is repeated or skipped."""
    spec = make_shards(tmp_path, 3, 64)
    total, first, second = 16, 5, 9
    full = read_epoch(spec, 2, 2, 8, mode=mode, batches=total)
    steps = [full[0][0][s] + full[1][0][s] for s in range(total)]  # a step's keys: rank 0's batch, then rank 1's

    part = read_epoch(spec, 2, 2, 8, mode=mode, batches=first)
    state, streams = resume_from(part, first, world_size=1, grad_accum_steps=2, num_workers=2)
    assert streams == 4  # the data streams of the run that wrote the position
    one = read_epoch(spec, 1, 2, 8, mode=mode, batches=2 * (second - first), state=state, grad_accum=2,
                     streams=streams)
    batches = one[0][0]
    assert [batches[2 * i] + batches[2 * i + 1] for i in range(second - first)] == steps[first:second]

    state, streams = resume_from(one, second, world_size=2, grad_accum_steps=1, num_workers=2)
    rest = read_epoch(spec, 2, 2, 8, mode=mode, batches=total - second, state=state, streams=streams)
    assert [rest[0][0][i] + rest[1][0][i] for i in range(total - second)] == steps[second:]


def test_resume_that_cannot_keep_the_order_says_why(tmp_path):
    spec = make_shards(tmp_path, 3, 64)
    part = read_epoch(spec, 2, 1, 8, batches=3)  # 2 streams
    merged = merge_states([loader.state_dict() for _, loader in part.values()])
    layout = dict(step=3, mode="epoch", seed=0, data_streams=0, micro_batch_size=8, shuffle_buffer=16)
    assert resume_state(merged, **layout, world_size=3, grad_accum_steps=1, num_workers=1)[2] == \
        "2 data streams are not a multiple of the 3 micro-batches per step (3 ranks x 1 accumulation steps)"
    assert "do not split over 2 workers" in resume_state(merged, **layout, world_size=2, grad_accum_steps=1,
                                                         num_workers=2)[2]
    assert resume_state(merged, **{**layout, "seed": 1}, world_size=2, grad_accum_steps=1, num_workers=1)[2] == \
        "the data layout changed (seed 0 -> 1)"


def test_resampled_mixes_sources_by_weight(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = make_shards(tmp_path / "a", 2, 50, prefix="a", key_prefix="a")
    b = make_shards(tmp_path / "b", 2, 50, prefix="b", key_prefix="b")
    read = read_epoch(f"{a}@3 + {b}@1", world_size=1, num_workers=1, mbs=50, mode="resampled", batches=40)
    keys = [k for batch in read[0][0] for k in batch]
    assert len(keys) == 2000
    assert 0.72 < sum(k.startswith("a") for k in keys) / len(keys) < 0.78  # weight 3:1


def test_epoch_mode_rejects_weights(tmp_path):
    spec = make_shards(tmp_path, 2, 16)
    with pytest.raises(DataError, match="resampled"):
        read_epoch(f"{spec}@2", 1, 1, 4)


# ---------------------------------------------------------------- remote sources
@pytest.fixture
def http_server(tmp_path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_and_pipe_sources_stream_the_same_samples(tmp_path, http_server):
    spec = make_shards(tmp_path, 3, 32)
    local = read_epoch(spec, 2, 2, 8)
    remote = read_epoch(f"{http_server}/train-{{000000..000002}}.tar", 2, 2, 8)  # _info.json over http too
    piped = parse_spec(f"pipe:cat {tmp_path}/train-{{000000..000002}}.tar", "train_shards")
    assert piped[0].counts is None  # no _info.json for pipes: counted by reading
    with pytest.warns(UserWarning, match="counting samples"):
        through_pipe = read_epoch(f"pipe:cat {tmp_path}/train-{{000000..000002}}.tar", 2, 2, 8)
    for rank in range(2):
        assert remote[rank][0] == local[rank][0] == through_pipe[rank][0]


def test_a_url_the_server_refuses_is_one_line_with_its_status(http_server):
    import re

    spec = f"{http_server}/gone-{{000000..000001}}.tar"
    with pytest.raises(DataError, match=re.escape(f"train_shards '{spec}': cannot open 2 of 2 URLs, e.g. "
                                                  f"{http_server}/gone-000000.tar (HTTP 404 File not found)")):
        parse_spec(spec, "train_shards")


# ---------------------------------------------------------------- evaluation and transforms
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_covers_every_sample_once(digits, world_size):
    sources = parse_spec(digits["val"], "val_shards")
    labels = []
    for rank in range(world_size):
        for images, y in eval_batches(sources, EvalTransform(PROCESSOR), 64, rank, world_size):
            assert images.shape[1:] == (3, 16, 16)
            labels.append(y)
    assert len(torch.cat(labels)) == 359


def test_train_transform_is_seeded_and_changes_the_image():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 60, 3), dtype=np.uint8))
    t = TrainTransform(PROCESSOR, 0.08, 0.5, 2, 9)
    a, b = t(img, random.Random("k")), t(img, random.Random("k"))
    assert a.shape == (3, 16, 16) and a.equal(b)
    assert not a.equal(t(img, random.Random("other")))
    assert not a.equal(EvalTransform(PROCESSOR)(img))


def test_uint8_batches_normalise_on_the_device_as_the_float_path_did():
    """Workers hand over uint8 images; `Normalize` then gives, bitwise, what normalising each image in float32
    in the worker gave, and what the image processor (the exported model's `pipeline`) computes, to 1e-6."""
    img = Image.fromarray(np.random.default_rng(1).integers(0, 255, (40, 60, 3), dtype=np.uint8))
    t = EvalTransform(PROCESSOR)
    x = t(img)
    assert x.dtype == torch.uint8 and x.shape == (3, 16, 16) and x.is_contiguous()
    ours = Normalize(PROCESSOR)(x[None])[0]
    resized = np.asarray(img.convert("RGB").resize(t.size, t.resample), dtype=np.float32) / 255.0
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (PROCESSOR.image_mean, PROCESSOR.image_std))
    assert torch.equal(ours, (torch.from_numpy(resized).permute(2, 0, 1) - mean) / std)
    hf = PROCESSOR(images=img, return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(ours, hf, atol=1e-6, rtol=0)
    augmented = TrainTransform(PROCESSOR, 0.08, 0.5, 2, 9)(img, random.Random("k"))
    assert augmented.dtype == torch.uint8 and augmented.is_contiguous()


@pytest.mark.parametrize("mixup,cutmix", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_mix_batch_soft_targets(mixup, cutmix):
    images, labels = torch.randn(8, 3, 16, 16), torch.arange(8) % 10
    mixed, targets = mix_batch(images, labels, 10, mixup, cutmix, torch.Generator().manual_seed(0))
    assert mixed.shape == images.shape and targets.shape == (8, 10)
    torch.testing.assert_close(targets.sum(-1), torch.ones(8))
    assert (targets.max(-1).values < 1).any()  # something was mixed
    plain, one_hot = mix_batch(images, labels, 10, 0.0, 0.0, None)
    assert plain is images and one_hot.argmax(-1).equal(labels)


def test_data_benchmark_runs(tmp_path):
    proc = run_entry("benchmarks.data_bench", "--images", "64", "--batches", "2", "--repeats", "1", "--workers", "0,1",
                     "--out", tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    import csv

    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    # uint8 at 0 and 1 workers, the float32 baseline at 1, and the eval path three ways
    assert [(r["path"], r["workers"], r["batches"]) for r in rows] == [
        ("train", "0", "uint8"), ("train", "1", "uint8"), ("train", "1", "float32"), ("eval", "0", "uint8"),
        ("eval", "0", "uint8+normalize"), ("eval", "0", "float32")]
    assert float(rows[1]["vs_float32_median"]) > 0 and rows[0]["vs_float32_median"] == ""
    assert (tmp_path / "throughput.png").stat().st_size > 10_000


WORKER_PARENT = """
import os, socket, sys, time
from data.loader import worker_init

server = socket.socket()  # what global rank 0 holds: the process group's store, listening on MASTER_PORT
server.bind(("127.0.0.1", 0))
server.listen(4)
init = worker_init()  # what the rank's DataLoader runs in each worker it forks
ready_r, ready_w = os.pipe()
if os.fork() == 0:  # the worker: its start, then busy (a long decode, a blocked read) for a minute
    init(0)
    os.write(ready_w, b"1")
    time.sleep(60)
    os._exit(0)
os.read(ready_r, 1)
print(server.getsockname()[1], flush=True)
os._exit(1)  # the rank dies as a failed one does, without closing anything
"""


def test_a_loader_worker_ends_with_its_rank(tmp_path):
    """A rank that dies abruptly while its loader worker is busy (the worker forked while the rank listened on a
    port, as global rank 0 serves the store on MASTER_PORT, and started by data.loader.worker_init): when the
    rank has exited, the worker is gone within half a second and the port binds, so a relaunch starts at once.
    Without it the worker lives on until torch's check of its parent (every 5 s, once the worker is idle),
    holding the listening socket it inherited."""
    import socket

    import psutil

    # not subprocess.run: it would wait for the pipe's end, which a surviving worker holds open
    proc = subprocess.Popen([sys.executable, "-c", WORKER_PARENT], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, JOB_MARK=str(tmp_path)))
    port = int(proc.stdout.readline())
    assert proc.wait(timeout=120) == 1

    def left():
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("JOB_MARK") == str(tmp_path):
                    found.append(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    deadline = time.monotonic() + 0.5
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == []
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_short_shard_spec_warns_and_strict_data_stops_it(digits, capsys, monkeypatch, tmp_path):
    """A brace spec over 3 of the 4 train shards its _info.json lists: one warning with the counts (shards and
    samples) at start; with strict_data, one error line, exit 2 and nothing written. The directory reads every
    shard of each key's split, silently; a glob as a brace spec does; epochs count the split's samples."""
    short = f"{digits['dir']}/train-{{000000..000002}}.tar"
    code, err = check_input(["--train_shards", short, "--val_shards", digits["val"], "--output_dir", tmp_path / "a"],
                            capsys, monkeypatch)
    assert code == 0 and [line for line in err if "covers" in line] == [
        f"warning: train_shards covers 3 of the 4 shards {digits['dir']}/_info.json lists for split train, 1,200 of "
        f"its 1,438 samples: the rest is never read; give the directory (train_shards: {digits['dir']}) to read "
        f"them all"]
    code, err = check_input(["--train_shards", short, "--val_shards", digits["val"], "--strict_data", "true",
                             "--output_dir", tmp_path / "b"], capsys, monkeypatch)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: train_shards covers 3 of the 4 shards")
    assert err[0].endswith("(strict_data)") and not (tmp_path / "b").exists()
    code, err = check_input(["--train_shards", digits["dir"], "--val_shards", digits["dir"], "--output_dir",
                             tmp_path / "c"], capsys, monkeypatch)
    assert code == 0 and not any("covers" in line for line in err)
    whole = parse_spec(digits["dir"], "train_shards")[0]
    assert [u.rsplit("/", 1)[1] for u in whole.urls] == [f"train-00000{i}.tar" for i in range(4)]
    assert [u.rsplit("/", 1)[1] for u in parse_spec(digits["dir"], "val_shards")[0].urls] == ["val-000000.tar"]
    assert parse_spec(f"{digits['dir']}/train-*.tar", "train_shards")[0].urls == whole.urls
    with pytest.raises(DataError, match="a directory without an _info.json"):
        parse_spec(str(tmp_path), "train_shards")


def test_epochs_become_steps_of_the_global_batch(digits, capsys, monkeypatch, tmp_path):
    """epochs and warmup_epochs: the train split's samples over the global batch, rounded up (1,438 / 32 = 44.9
    steps an epoch on one rank); a later --max_steps wins over a recipe's epochs; both on the command line is an
    error; without sample counts (synthetic data) epochs is one line."""
    import train
    from config import parse

    cfg = parse(["--train_shards", digits["dir"], "--val_shards", digits["dir"], "--epochs", "2",
                 "--warmup_epochs", "0.5", "--output_dir", str(tmp_path / "a")])
    train.epochs_to_steps(cfg, parse_spec(cfg.train_shards, "train_shards"), data_ranks=1)
    assert (cfg.max_steps, cfg.warmup_steps) == (90, 23)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("epochs: 300\nwarmup_epochs: 5\n")
    cfg = parse(["--config", str(recipe), "--max_steps", "2", "--warmup_steps", "1"])
    assert (cfg.epochs, cfg.warmup_epochs, cfg.max_steps, cfg.warmup_steps) == (0, 0, 2, 1)
    code, err = check_input(["--epochs", "2", "--max_steps", "5", "--output_dir", tmp_path / "b"], capsys, monkeypatch)
    assert code == 2 and err == ["error: --max_steps and --epochs both set the run's length: give one"]
    code, err = check_input(["--epochs", "2", "--data_mode", "synthetic", "--output_dir", tmp_path / "c"], capsys,
                            monkeypatch)
    assert code == 2 and "epochs and warmup_epochs need the train shards' sample counts" in err[0]
