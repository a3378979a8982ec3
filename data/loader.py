"""Streaming reader: WebDataset shards -> augmented micro-batches, split over nodes, ranks and workers.

Every (rank, worker) pair, a "consumer", reads a raw sample stream that is a pure function of
(seed, epoch, rank, worker), shuffled in blocks of `shuffle_buffer` raw samples. A position in it is
(epoch, block, index); each batch carries its worker's position after it, so a checkpoint records
where every worker stands and a resumed run seeks there (whole shards are skipped by their sample
counts; at most one shard is re-read) instead of replaying the epoch.

- `epoch` mode: the epoch's shards are shuffled, laid end to end and cut into equal contiguous slices,
  one per consumer. Each consumer yields the same whole number of batches per epoch, so ranks never
  wait on each other; the remainder beyond that is spare for skipped samples. Each sample is read at
  most once per epoch (if corrupt samples exceed the spares, earlier ones are repeated and counted).
- `resampled` mode: each consumer draws shards with replacement, sources mixed by weight, endlessly.

DataLoader serves workers round-robin; a resumed loader rotates worker ids so that the worker due next
in the original run comes first.
"""
import io
import random
import warnings
from itertools import accumulate

import torch
from PIL import Image

from data.shards import DataError, count_samples, iter_samples

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


def decode(sample: dict):
    """(PIL image, label) from a raw sample; raises on a corrupt image or a missing/malformed label."""
    ext = next((k for k in IMAGE_KEYS if k in sample), None)
    if ext is None:
        raise ValueError(f"no image ({', '.join(IMAGE_KEYS)})")
    if "cls" not in sample:
        raise ValueError("no label (cls)")
    label = int(sample["cls"])
    if label < 0:
        raise ValueError(f"negative label {label}")
    img = Image.open(io.BytesIO(sample[ext]))
    img.load()
    return img, label


def _rng(*parts) -> random.Random:
    return random.Random("/".join(map(str, parts)))  # string seeds hash deterministically (SHA-512)


class ShardStream(torch.utils.data.IterableDataset):
    def __init__(self, sources, *, mode: str, rank: int, world_size: int, num_workers: int, micro_batch_size: int,
                 shuffle_buffer: int, seed: int, transform, state: dict | None = None):
        if mode not in ("epoch", "resampled"):
            raise DataError(f"data mode must be 'epoch' or 'resampled', got '{mode}'")
        self.sources, self.mode, self.rank, self.world_size = sources, mode, rank, world_size
        self.num_workers, self.mbs, self.block, self.seed = max(1, num_workers), micro_batch_size, \
            max(1, shuffle_buffer), seed
        self.transform = transform
        self.state = state or {"batches": 0, "workers": {}}
        if mode == "epoch":
            if any(s.weight != 1.0 for s in sources):
                raise DataError("source weights (@w) apply to data_mode 'resampled' only")
            self.urls = [u for s in sources for u in s.urls]
            self.counts = [c for s in sources for c in self._counts(s)]
            consumers = world_size * self.num_workers
            self.per_consumer = sum(self.counts) // consumers
            self.batches_per_epoch = self.per_consumer // micro_batch_size  # per consumer
            if self.batches_per_epoch == 0:
                raise DataError(f"epoch mode: {sum(self.counts)} samples over {consumers} consumers (ranks x "
                                f"workers) leave less than one micro-batch of {micro_batch_size} each")
        else:
            self.counts_by_source = [s.counts for s in sources]  # None: unknown, counted once per shard on first draw

    @staticmethod
    def _counts(source):
        if source.counts:
            return source.counts
        warnings.warn(f"no _info.json beside {source.urls[0]}: counting samples by reading its shards")
        return [count_samples(u) for u in source.urls]

    def batches_per_rank_epoch(self) -> int | None:
        return self.batches_per_epoch * self.num_workers if self.mode == "epoch" else None

    # ------------------------------------------------------------- raw slots of one consumer
    def _epoch_slots(self, epoch: int, consumer: int):
        """(url, index in shard) for this consumer's slice of the epoch, in shard order."""
        order = list(range(len(self.urls)))
        _rng(self.seed, "shards", epoch).shuffle(order)
        starts = [0, *accumulate(self.counts[i] for i in order)]
        lo, hi = consumer * self.per_consumer, (consumer + 1) * self.per_consumer
        slots = []
        for j, i in enumerate(order):
            a, b = max(lo, starts[j]), min(hi, starts[j + 1])
            slots.extend((self.urls[i], k - starts[j]) for k in range(a, b))
        return slots

    def _resampled_slots(self, consumer: int, start: int):
        """This consumer's endless (url, index) stream from slot `start` on: sources mixed by weight, shards
        drawn with replacement per source. Seeking costs random draws, not reads, when counts are known."""
        n_sources = len(self.sources)
        mix = _rng(self.seed, "mix", consumer)
        pick = (lambda: 0) if n_sources == 1 else \
            (lambda: mix.choices(range(n_sources), [s.weight for s in self.sources])[0])
        before = [0] * n_sources
        for _ in range(start):
            before[pick()] += 1
        streams = [self._source_slots(consumer, s, before[s]) for s in range(n_sources)]
        while True:
            yield next(streams[pick()])

    def _source_slots(self, consumer: int, s: int, skip: int):
        draws, source = _rng(self.seed, "draw", consumer, s), self.sources[s]
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
        """(tensor, label, key) or None for an unreadable sample, which is counted and skipped."""
        if sample is None:
            return None
        try:
            img, label = decode(sample)
            return self.transform(img, _rng(self.seed, "aug", epoch, sample["__key__"])), label, sample["__key__"]
        except Exception as e:  # corrupt image, missing or malformed label
            warnings.warn(f"skipped sample {sample.get('__key__')} of {sample.get('__url__')}: {e!r}")
            return None

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers = info.num_workers if info else 1
        if workers != self.num_workers:
            raise DataError(f"ShardStream built for {self.num_workers} workers runs under {workers}")
        logical = ((info.id if info else 0) + self.state["batches"]) % workers  # the worker due next comes first
        consumer = self.rank * workers + logical
        epoch, block, index, done = self.state["workers"].get(str(logical), (0, 0, 0, 0))
        reader = _ShardReader()
        batch, skipped, padded = [], 0, 0
        while True:
            if self.mode == "epoch":
                slots_all = self._epoch_slots(epoch, consumer)
                n_blocks = -(-len(slots_all) // self.block)
            else:
                stream = self._resampled_slots(consumer, block * self.block)
            good_in_cycle = 0
            while self.mode == "resampled" or done < self.batches_per_epoch:
                if self.mode == "epoch":
                    b = block % n_blocks  # past the last block: skips outran the spares, cycle to pad
                    slots = slots_all[b * self.block:(b + 1) * self.block]
                    if b == 0 and block > 0:
                        if good_in_cycle == 0:
                            raise DataError(f"consumer {consumer}: no readable sample in its share of epoch {epoch}")
                        good_in_cycle = 0
                else:
                    slots = [next(stream) for _ in range(self.block)]
                _rng(self.seed, "block", epoch, consumer, block).shuffle(slots)
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
                    yield torch.stack(images), torch.tensor(labels), {
                        "worker": logical, "pos": pos, "skipped": skipped, "padded": padded, "keys": list(keys)}
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


class TrainLoader:
    """DataLoader over a ShardStream that tracks the data position for checkpoints."""

    def __init__(self, dataset: ShardStream, num_workers: int):
        self.dataset = dataset
        self.state = {"batches": dataset.state["batches"], "workers": dict(dataset.state["workers"])}
        self.skipped = self.padded = 0
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                                  persistent_workers=num_workers > 0,
                                                  pin_memory=torch.cuda.is_available())
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        images, labels, meta = next(self._it)
        self.state["batches"] += 1
        self.state["workers"][str(meta["worker"])] = meta["pos"]
        self.skipped += meta["skipped"]
        self.padded += meta["padded"]
        return images, labels, meta

    def state_dict(self) -> dict:
        d = self.dataset
        return {**self.state, "mode": d.mode, "seed": d.seed, "world_size": d.world_size,
                "num_workers": d.num_workers, "micro_batch_size": d.mbs, "shuffle_buffer": d.block}


def resume_state(saved: dict | None, mode, seed, world_size, num_workers, micro_batch_size, shuffle_buffer):
    """The saved data position if it still applies to this run's layout, else None (with the reason)."""
    if not saved:
        return None, "no data position in the checkpoint"
    now = {"mode": mode, "seed": seed, "world_size": world_size, "num_workers": max(1, num_workers),
           "micro_batch_size": micro_batch_size, "shuffle_buffer": max(1, shuffle_buffer)}
    changed = [f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v]
    if changed:
        return None, "the data layout changed (" + ", ".join(changed) + ")"
    return {"batches": saved["batches"], "workers": saved["workers"]}, None


def eval_batches(sources, transform, batch_size: int, rank: int, world_size: int):
    """Every validation sample once across ranks, in order; ranks may get different batch counts
    (train.evaluate evens them out). Unreadable samples are skipped with a warning."""
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
                img, label = decode(sample)
                batch.append((transform(img, None), label))
            except Exception as e:
                warnings.warn(f"skipped val sample {sample.get('__key__')}: {e!r}")
            if len(batch) == batch_size:
                yield torch.stack([b[0] for b in batch]), torch.tensor([b[1] for b in batch])
                batch = []
    for e in errors:
        warnings.warn(f"skipped val data: {e}")
    if batch:
        yield torch.stack([b[0] for b in batch]), torch.tensor([b[1] for b in batch])
