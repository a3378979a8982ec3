"""Streaming reader: WebDataset shards -> augmented micro-batches, split over nodes, ranks and workers.

The data order is a function of the seed and a number of virtual *data streams*, not of the ranks or workers
that read them. Stream v is a raw sample sequence, a pure function of (seed, epoch, v), shuffled in blocks of
`shuffle_buffer` raw samples; a position in it is (epoch, block, index, batches done this epoch).

Micro-batches are numbered globally, g = step * D + slot, where D = world_size x grad_accum_steps is the number
of micro-batches in one optimizer step and slot = rank x grad_accum_steps + micro. Micro-batch g is the next
batch of stream g mod V. With V a multiple of D, each rank owns V / world_size streams and reads them in turn;
each of its DataLoader workers owns every num_workers-th of those. A checkpoint records every stream's position,
so a run resumed on a different number of ranks (the same D: 2 ranks x 1 accumulation step = 1 rank x 2)
reads exactly the batches the uninterrupted run would have read, in the same optimizer steps: nothing is
repeated or skipped. Whole shards are skipped by their sample counts when seeking; at most one is re-read.

- `epoch` mode: the epoch's shards are shuffled, laid end to end and cut into V equal contiguous slices, one per
  stream. Each stream yields the same whole number of batches per epoch, so ranks never wait on each other; the
  remainder beyond that is spare for skipped samples. Each sample is read at most once per epoch (if corrupt
  samples exceed the spares, earlier ones are repeated and counted).
- `resampled` mode: each stream draws shards with replacement, sources mixed by weight, endlessly.
"""
import ctypes
import functools
import io
import os
import random
import signal
import socket
import sys
import warnings
from itertools import accumulate

import torch
from PIL import Image

from data.shards import DataError, count_samples, iter_samples

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


def _open(data: bytes) -> Image.Image:
    """A PIL image decoded whole (a truncated or corrupt file raises here, not later in a transform)."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def _image_key(sample: dict) -> str:
    ext = next((k for k in IMAGE_KEYS if k in sample), None)
    if ext is None:
        raise ValueError(f"no image ({', '.join(IMAGE_KEYS)})")
    return ext


def decode(sample: dict, num_labels: int | None = None):
    """(PIL image, label) from a raw sample; raises on a corrupt image or a missing, malformed or out-of-range label
    (outside [0, num_labels) where it is given)."""
    ext = _image_key(sample)
    if "cls" not in sample:
        raise ValueError("no label (cls)")
    label = int(sample["cls"])
    if label < 0 or (num_labels is not None and label >= num_labels):
        raise ValueError(f"label {label} outside [0, {num_labels if num_labels is not None else 'inf'}) (num_labels)")
    return _open(sample[ext]), label


MASK_KEY = "seg.png"  # a segmentation sample's label map: one 8-bit channel, a class index per pixel
IGNORE_INDEX = 255  # a mask value that no loss or metric counts (ADE20K's "other", unlabelled pixels)


def decode_segmentation(sample: dict, num_labels: int | None = None):
    """(PIL image, PIL mask) from a raw segmentation sample; raises on a corrupt image or mask, a missing mask, a
    mask of another size than its image, or a mask value outside [0, num_labels) other than IGNORE_INDEX."""
    import numpy as np

    ext = _image_key(sample)
    if MASK_KEY not in sample:
        raise ValueError(f"no mask ({MASK_KEY}): not a segmentation sample")
    img, mask = _open(sample[ext]), _open(sample[MASK_KEY])
    if mask.mode not in ("L", "P"):
        raise ValueError(f"mask mode {mask.mode}: a mask holds one 8-bit channel of class indices (L or P)")
    if mask.size != img.size:
        raise ValueError(f"mask {mask.size[0]}x{mask.size[1]} for an image of {img.size[0]}x{img.size[1]}")
    if num_labels is not None:
        values = np.unique(np.asarray(mask))
        bad = values[(values >= num_labels) & (values != IGNORE_INDEX)]
        if bad.size:
            raise ValueError(f"mask value {int(bad.max())} outside [0, {num_labels}) (num_labels) and not the ignore "
                             f"index {IGNORE_INDEX}")
    return img, mask


LABEL_PROBE = 64  # samples read from the first shard of each source to check its labels before training


def check_labels(sources, num_labels: int, what: str):
    """DataError when most of the first samples of a source's first shard have labels outside [0, num_labels):
    the shards are of another data set, or num_labels is too small. A few such samples are corrupt ones, skipped
    and counted while training."""
    for source in sources:
        url, labels = source.urls[0], []
        for sample in iter_samples(url, []):
            try:
                labels.append(int(sample["cls"]))
            except (KeyError, ValueError):
                pass
            if len(labels) == LABEL_PROBE:
                break
        bad = [y for y in labels if not 0 <= y < num_labels]
        if labels and len(bad) * 2 > len(labels):
            raise DataError(f"{what}: {len(bad)} of the first {len(labels)} labels of {url} lie outside [0, "
                            f"{num_labels}) (num_labels {num_labels}); the largest is {max(labels)}: set num_labels "
                            f"to the shards' number of classes, or check that these are the shards you meant")


def check_masks(sources, num_labels: int, what: str):
    """DataError when the first samples of a source's first shard are no segmentation samples (most lack a mask),
    or most of their masks hold values outside [0, num_labels) other than the ignore index: shards of another
    task or data set, or num_labels too small. A few such samples are corrupt ones, skipped while training."""
    for source in sources:
        url, read, errors = source.urls[0], 0, []
        for sample in iter_samples(url, []):
            read += 1
            try:
                decode_segmentation(sample, num_labels)
            except ValueError as e:
                errors.append(str(e))
            if read == LABEL_PROBE:
                break
        if read and len(errors) * 2 > read:
            no_mask = sum(e.startswith("no mask") for e in errors)
            if no_mask * 2 > read:
                why = (f"{no_mask} of the first {read} samples of {url} hold no mask ({MASK_KEY}): these are not "
                       f"segmentation shards (data/make_shards.py writes them from image/mask pairs)")
            else:
                why = f"{len(errors)} of the first {read} samples of {url} are unusable, e.g. {errors[0]}"
            raise DataError(f"{what}: {why}")


def _rng(*parts) -> random.Random:
    return random.Random("/".join(map(str, parts)))  # string seeds hash deterministically (SHA-512)


def default_streams(world_size: int, grad_accum_steps: int, num_workers: int) -> int:
    """A fresh run's number of data streams: one per (rank, accumulation step, worker)."""
    return world_size * grad_accum_steps * max(1, num_workers)


def check_streams(streams: int, world_size: int, grad_accum_steps: int, num_workers: int) -> str | None:
    """Why `streams` data streams cannot be read by this layout, or None when they can."""
    per_step = world_size * grad_accum_steps
    if streams <= 0 or streams % per_step:
        return (f"{streams} data streams are not a multiple of the {per_step} micro-batches per step "
                f"({world_size} ranks x {grad_accum_steps} accumulation steps)")
    if (streams // world_size) % max(1, num_workers):
        return (f"the {streams // world_size} data streams per rank do not split over {num_workers} workers "
                f"(num_workers must divide them)")
    return None


class ShardStream(torch.utils.data.IterableDataset):
    def __init__(self, sources, *, mode: str, rank: int, world_size: int, num_workers: int, micro_batch_size: int,
                 shuffle_buffer: int, seed: int, transform, grad_accum_steps: int = 1, streams: int = 0,
                 state: dict | None = None, num_labels: int | None = None, task: str = "classification"):
        if mode not in ("epoch", "resampled"):
            raise DataError(f"data mode must be 'epoch' or 'resampled', got '{mode}'")
        self.sources, self.mode, self.rank, self.world_size = sources, mode, rank, world_size
        self.num_workers, self.mbs, self.block, self.seed = max(1, num_workers), micro_batch_size, \
            max(1, shuffle_buffer), seed
        self.grad_accum = grad_accum_steps
        self.streams = streams or default_streams(world_size, grad_accum_steps, num_workers)
        why = check_streams(self.streams, world_size, grad_accum_steps, num_workers)
        if why:
            raise DataError(why)
        # the streams this rank reads, in the order its micro-batches take them
        per_step, per_rank = world_size * grad_accum_steps, self.streams // world_size
        self.rank_streams = [(i // grad_accum_steps) * per_step + rank * grad_accum_steps + i % grad_accum_steps
                             for i in range(per_rank)]
        self.transform, self.num_labels = transform, num_labels  # a label outside [0, num_labels): a corrupt sample
        self.segmentation = task == "segmentation"  # (image, mask) samples, transformed together
        self.state = state or {"batches": 0, "streams": {}}
        if mode == "epoch":
            if any(s.weight != 1.0 for s in sources):
                raise DataError("source weights (@w) apply to data_mode 'resampled' only")
            self.urls = [u for s in sources for u in s.urls]
            self.counts = [c for s in sources for c in self._counts(s)]
            self.per_stream = sum(self.counts) // self.streams
            self.batches_per_epoch = self.per_stream // micro_batch_size  # per stream
            if self.batches_per_epoch == 0:
                raise DataError(f"epoch mode: {sum(self.counts)} samples over {self.streams} data streams leave "
                                f"less than one micro-batch of {micro_batch_size} each")
        else:
            self.counts_by_source = [s.counts for s in sources]  # None: unknown, counted once per shard on first draw

    @staticmethod
    def _counts(source):
        if source.counts:
            return source.counts
        warnings.warn(f"no _info.json beside {source.urls[0]}: counting samples by reading its shards")
        return [count_samples(u) for u in source.urls]

    def batches_per_rank_epoch(self) -> int | None:
        return self.batches_per_epoch * len(self.rank_streams) if self.mode == "epoch" else None

    # ------------------------------------------------------------- raw slots of one stream
    def _epoch_slots(self, epoch: int, stream: int):
        """(url, index in shard) for this stream's slice of the epoch, in shard order."""
        order = list(range(len(self.urls)))
        _rng(self.seed, "shards", epoch).shuffle(order)
        starts = [0, *accumulate(self.counts[i] for i in order)]
        lo, hi = stream * self.per_stream, (stream + 1) * self.per_stream
        slots = []
        for j, i in enumerate(order):
            a, b = max(lo, starts[j]), min(hi, starts[j + 1])
            slots.extend((self.urls[i], k - starts[j]) for k in range(a, b))
        return slots

    def _resampled_slots(self, stream: int, start: int):
        """This stream's endless (url, index) sequence from slot `start` on: sources mixed by weight, shards
        drawn with replacement per source. Seeking costs random draws, not reads, when counts are known."""
        n_sources = len(self.sources)
        mix = _rng(self.seed, "mix", stream)
        pick = (lambda: 0) if n_sources == 1 else \
            (lambda: mix.choices(range(n_sources), [s.weight for s in self.sources])[0])
        before = [0] * n_sources
        for _ in range(start):
            before[pick()] += 1
        sequences = [self._source_slots(stream, s, before[s]) for s in range(n_sources)]
        while True:
            yield next(sequences[pick()])

    def _source_slots(self, stream: int, s: int, skip: int):
        draws, source = _rng(self.seed, "draw", stream, s), self.sources[s]
        while True:
            shard = draws.randrange(len(source.urls))
            if self.counts_by_source[s] is None:
                self.counts_by_source[s] = [None] * len(source.urls)
            counts = self.counts_by_source[s]
            if counts[shard] is None:  # a source without _info.json: read this shard once to count it
                counts[shard] = count_samples(source.urls[shard])
            size = counts[shard]
            if skip >= size:
                skip -= size
                continue
            for k in range(skip, size):
                yield source.urls[shard], k
            skip = 0

    # ------------------------------------------------------------- reading
    def _prepare(self, sample, epoch: int):
        """(tensor, label or mask, key) or None for an unreadable sample, which is counted and skipped."""
        if sample is None:
            return None
        try:
            rng = _rng(self.seed, "aug", epoch, sample["__key__"])
            if self.segmentation:
                return (*self.transform(*decode_segmentation(sample, self.num_labels), rng), sample["__key__"])
            img, label = decode(sample, self.num_labels)
            return self.transform(img, rng), label, sample["__key__"]
        except Exception as e:  # corrupt image, missing or malformed label
            warnings.warn(f"skipped sample {sample.get('__key__')} of {sample.get('__url__')}: {e!r}")
            return None

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers = info.num_workers if info else 1
        if workers != self.num_workers:
            raise DataError(f"ShardStream built for {self.num_workers} workers runs under {workers}")
        # DataLoader serves its workers round-robin, so this worker makes every `workers`-th of the rank's
        # micro-batches from here on; micro-batch k comes from the rank's stream k mod len(rank_streams), so each
        # stream belongs to exactly one worker
        k, batches = self.state["batches"] + (info.id if info else 0), {}
        while True:
            stream = self.rank_streams[k % len(self.rank_streams)]
            if stream not in batches:
                batches[stream] = self._stream_batches(stream, *self.state["streams"].get(str(stream), (0, 0, 0, 0)))
            yield next(batches[stream])
            k += workers

    def _stream_batches(self, stream: int, epoch: int, block: int, index: int, done: int):
        """Stream `stream`'s micro-batches from the position (epoch, block, index, done) on, endlessly."""
        reader = _ShardReader()
        batch, skipped, padded = [], 0, 0
        while True:
            if self.mode == "epoch":
                slots_all = self._epoch_slots(epoch, stream)
                n_blocks = -(-len(slots_all) // self.block)
            else:
                sequence = self._resampled_slots(stream, block * self.block)
            good_in_cycle = 0
            while self.mode == "resampled" or done < self.batches_per_epoch:
                if self.mode == "epoch":
                    b = block % n_blocks  # past the last block: skips outran the spares, cycle to pad
                    slots = slots_all[b * self.block:(b + 1) * self.block]
                    if b == 0 and block > 0:
                        if good_in_cycle == 0:
                            raise DataError(f"data stream {stream}: no readable sample in its share of epoch {epoch}")
                        good_in_cycle = 0
                else:
                    slots = [next(sequence) for _ in range(self.block)]
                _rng(self.seed, "block", epoch, stream, block).shuffle(slots)
                for sample in reader.read(slots[index:]):
                    index += 1
                    item = self._prepare(sample, epoch)
                    if item is None:
                        skipped += 1
                        continue
                    good_in_cycle += 1
                    padded += self.mode == "epoch" and block >= n_blocks
                    batch.append(item)
                    if len(batch) < self.mbs:
                        continue
                    done += 1
                    pos = [epoch, block, index, done] if index < len(slots) else [epoch, block + 1, 0, done]
                    images, labels, keys = zip(*batch)
                    yield torch.stack(images), _collate(labels), {
                        "stream": stream, "pos": pos, "skipped": skipped, "padded": padded, "keys": list(keys)}
                    batch, skipped, padded = [], 0, 0
                    if self.mode == "epoch" and done == self.batches_per_epoch:
                        break
                for e in reader.errors:
                    warnings.warn(f"skipped data: {e}")
                reader.errors.clear()
                if self.mode == "epoch" and done == self.batches_per_epoch:
                    break
                block, index = block + 1, 0
            epoch, block, index, done = epoch + 1, 0, 0, 0


class _ShardReader:
    """Reads slots shard by shard, keeping one shard open so consecutive blocks continue where the last
    stopped instead of re-reading it from the start. Unreadable slots come back as None."""

    def __init__(self):
        self.url, self.samples, self.next_k, self.errors = None, None, 0, []
        self.short = {}  # url -> samples it really holds, for shards that ended early

    def _seek(self, url: str, k: int):
        if k >= self.short.get(url, float("inf")):
            self.url, self.next_k = None, float("inf")
            return
        if url != self.url or k < self.next_k:
            self.url, self.samples, self.next_k = url, iter_samples(url, self.errors, skip=k), k
        while self.next_k < k:  # forward within the open shard
            if next(self.samples, None) is None:
                self.short[url], self.next_k = self.next_k, float("inf")
                return
            self.next_k += 1

    def read(self, slots):
        by_shard = {}
        for i, (url, k) in enumerate(slots):
            by_shard.setdefault(url, []).append((k, i))
        out = [None] * len(slots)
        for url, wanted in sorted(by_shard.items(), key=lambda kv: min(kv[1])[0]):
            for k, i in sorted(wanted):
                self._seek(url, k)
                if self.next_k == k:
                    out[i] = next(self.samples, None)  # None: the shard ended before k
                    if out[i] is None:
                        self.short[url], self.next_k = k, float("inf")
                    else:
                        self.next_k = k + 1
        return out


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that forked it exits


def _worker_init(rank_pid: int, _worker_id: int):
    """A loader worker's start: it ignores SIGTERM and SIGUSR1, which a launcher or scheduler may send to every
    process (the training process decides when to stop, after its step), and it ends with its rank.

    Ending with the rank: the kernel kills the worker the moment its rank exits (PR_SET_PDEATHSIG; torch's own
    check of the parent runs every 5 s), and the worker closes the listening sockets it inherited from the fork
    (global rank 0 serves the process group's store on MASTER_PORT). Without both, a worker of a failed job held
    the master port for seconds after the launcher had returned, and an immediate relaunch failed on it."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != rank_pid:  # the rank died before the line above took effect
            os._exit(1)
        _close_inherited_listeners()


def worker_init():
    """The loader workers' `worker_init_fn` for workers forked by this process (_worker_init)."""
    return functools.partial(_worker_init, os.getpid())


def _close_inherited_listeners():
    """Close the listening sockets among this process's descriptors (a forked worker serves nothing)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=fd)
        except OSError:  # closed meanwhile (the listing's own descriptor), or not a socket
            continue
        try:
            listening = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        probe.detach()  # the descriptor stays open unless it listens
        if listening:
            os.close(fd)


class TrainLoader:
    """DataLoader over a ShardStream that tracks every stream's position for checkpoints."""

    def __init__(self, dataset: ShardStream, num_workers: int):
        self.dataset = dataset
        self.state = {"batches": dataset.state["batches"], "streams": dict(dataset.state["streams"])}
        self.skipped = self.padded = 0
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                                  persistent_workers=num_workers > 0,
                                                  pin_memory=torch.cuda.is_available(),
                                                  worker_init_fn=worker_init())
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        images, labels, meta = next(self._it)
        self.state["batches"] += 1
        self.state["streams"][str(meta["stream"])] = meta["pos"]
        self.skipped += meta["skipped"]
        self.padded += meta["padded"]
        return images, labels, meta

    def state_dict(self) -> dict:
        """This rank's stream positions and the layout that gives them their meaning."""
        d = self.dataset
        return {"streams": dict(self.state["streams"]), "layout": {
            "mode": d.mode, "seed": d.seed, "data_streams": d.streams, "micro_batch_size": d.mbs,
            "shuffle_buffer": d.block, "world_size": d.world_size, "grad_accum_steps": d.grad_accum,
            "num_workers": d.num_workers}}


def merge_states(states: list[dict]) -> dict:
    """Every rank's state_dict -> one data position for the whole run (what a checkpoint holds)."""
    merged = {"layout": states[0]["layout"], "streams": {}}
    for s in states:
        merged["streams"].update(s["streams"])
    return merged


# the layout keys a data position depends on; world_size, grad_accum_steps and num_workers may change
ORDER_KEYS = ("mode", "seed", "micro_batch_size", "shuffle_buffer")


def resume_state(saved: dict | None, *, step: int, mode: str, seed: int, data_streams: int, world_size: int,
                 grad_accum_steps: int, num_workers: int, micro_batch_size: int, shuffle_buffer: int):
    """(state, streams, None) to continue the saved data position on this run's layout, or (None, 0, reason)."""
    if not saved:
        return None, 0, "no data position in the checkpoint"
    if mode == "synthetic" or saved["layout"].get("mode") == "synthetic":
        return None, 0, "synthetic data has no position"
    layout = saved["layout"]
    now = {"mode": mode, "seed": seed, "micro_batch_size": micro_batch_size, "shuffle_buffer": max(1, shuffle_buffer)}
    changed = [f"{k} {layout.get(k)} -> {v}" for k, v in now.items() if layout.get(k) != v]
    if data_streams and data_streams != layout["data_streams"]:
        changed.append(f"data_streams {layout['data_streams']} -> {data_streams}")
    if changed:
        return None, 0, "the data layout changed (" + ", ".join(changed) + ")"
    streams = layout["data_streams"]
    why = check_streams(streams, world_size, grad_accum_steps, num_workers)
    if why:
        return None, 0, why
    # every rank has taken grad_accum_steps micro-batches per step
    return {"batches": step * grad_accum_steps, "streams": saved["streams"]}, streams, None


def _collate(labels) -> torch.Tensor:
    """A batch's labels, (B,), or its masks, (B, H, W)."""
    return torch.stack(labels) if isinstance(labels[0], torch.Tensor) else torch.tensor(labels)


def eval_batches(sources, transform, batch_size: int, rank: int, world_size: int, num_labels: int | None = None,
                 task: str = "classification"):
    """Every validation sample once across ranks, in order; ranks may get different batch counts
    (engine.evaluation.evaluate evens them out). Unreadable samples, and labels outside [0, num_labels), are skipped
    with a warning. `segmentation`: (images, masks) batches."""
    urls = [u for s in sources for u in s.urls]
    mine = urls[rank::world_size] if len(urls) >= world_size else urls
    stride = 1 if len(urls) >= world_size else world_size
    batch, errors, n = [], [], 0
    for url in mine:
        for sample in iter_samples(url, errors):
            n += 1
            if stride > 1 and (n - 1) % stride != rank:
                continue
            try:
                if task == "segmentation":
                    batch.append(transform(*decode_segmentation(sample, num_labels)))
                else:
                    img, label = decode(sample, num_labels)
                    batch.append((transform(img, None), label))
            except Exception as e:
                warnings.warn(f"skipped val sample {sample.get('__key__')} of {sample.get('__url__')}: {e!r}")
            if len(batch) == batch_size:
                yield torch.stack([b[0] for b in batch]), _collate([b[1] for b in batch])
                batch = []
    for e in errors:
        warnings.warn(f"skipped val data: {e}")
    if batch:
        yield torch.stack([b[0] for b in batch]), _collate([b[1] for b in batch])
