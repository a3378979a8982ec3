"""An exponential moving average of the weights (Polyak averaging, as timm and DeiT train with it).

Each rank averages the part of every parameter it holds (`compat.local_weights`): under ZeRO-3 its partition,
so no rank holds a whole extra copy of the model; under ZeRO-1/2, where every rank holds the whole weights, the
whole tensors. The average is kept in fp32 whatever the training precision.

A checkpoint holds it as `ema/rank<NNNNN>.pt`, one file per rank under ZeRO-3 and FSDP2 (HSDP: the first replica's
ranks), rank 0's alone otherwise (a pipeline: the first pipeline's ranks, one per stage); each file records where
its pieces sit in the flattened parameters, by the parameters' names in the whole model, so that a run on another
number of ranks, another ZeRO stage or another number of pipeline stages reassembles its own parts from them.
"""
import contextlib
import os

import torch
import torch.distributed as dist

import compat

EMA_DIR = "ema"


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float, stages: int = 1):
        """`model`'s weights (under a pipeline: its stage's, under their whole-model names), `stages`: pp_size (the
        first `stages` ranks, the first pipeline, hold every stage once)."""
        self.decay = decay
        self.stages = stages
        self.params = dict(model.named_parameters())
        # ZeRO-3's partitions and FSDP2's shards: each rank holds and saves a part of every parameter
        self.partitioned = any(compat.is_zero3_partitioned(p) or compat.is_dtensor(p) for p in self.params.values())
        self.shadow = {name: compat.local_weights(p)[0].detach().float().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def update(self):
        """After an applied optimizer step: shadow <- decay * shadow + (1 - decay) * weights."""
        for name, p in self.params.items():
            self.shadow[name].lerp_(compat.local_weights(p)[0].float(), 1 - self.decay)

    @contextlib.contextmanager
    def swapped(self, engine):
        """The model holds the averaged weights inside, its own weights again (bitwise) after. Every rank enters."""
        live = {}
        with torch.no_grad(), engine.writing_local_weights():
            for name, p in self.params.items():
                local = compat.local_weights(p)[0]
                live[name] = local.clone()
                local.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad(), engine.writing_local_weights():
                for name, p in self.params.items():
                    compat.local_weights(p)[0].copy_(live[name])

    def save(self, checkpoint_dir: str):
        """This rank's part into `checkpoint_dir/ema/` (every rank calls it)."""
        rank = dist.get_rank()
        if not self.partitioned and rank >= self.stages:  # whole weights: one copy of each stage's
            return
        # HSDP: the first replica's ranks hold every part once
        if self.partitioned and not all(compat.is_first_replica(p) for p in self.params.values() if compat.is_dtensor(p)):
            return
        out = os.path.join(checkpoint_dir, EMA_DIR)
        os.makedirs(out, exist_ok=True)
        pieces = {name: (self.shadow[name], compat.local_weights(p)[1]) for name, p in self.params.items()}
        torch.save({"decay": self.decay, "pieces": pieces}, os.path.join(out, f"rank{rank:05d}.pt"))

    def load(self, checkpoint_dir: str) -> bool:
        """This rank's part from a checkpoint written by any number of ranks under any ZeRO stage; False (and the
        average left at the current weights) when the checkpoint has none."""
        folder = os.path.join(checkpoint_dir, EMA_DIR)
        if not os.path.isdir(folder):
            return False
        # memory-mapped: each parameter is reassembled from the files' pieces in turn
        files = [torch.load(os.path.join(folder, f), mmap=True, weights_only=True)["pieces"]
                 for f in sorted(os.listdir(folder)) if f.endswith(".pt")]
        missing = [name for name in self.params if not any(name in pieces for pieces in files)]
        if missing:
            raise KeyError(f"{folder} holds no EMA of {len(missing)} of the model's weights, e.g. {missing[0]}")
        for name, p in self.params.items():
            local, offset = compat.local_weights(p)
            numel = compat.param_numel(p)
            if not self.partitioned:
                whole = torch.empty(numel, dtype=torch.float32)
                self._gather(files, name, whole, 0)
                self.shadow[name].copy_(whole.view_as(self.shadow[name]))
            else:  # this rank's slice of the flattened parameter; the padding past its end stays zero
                flat = self.shadow[name].view(-1)  # ZeRO-3's partition is flat, an FSDP2 shard has the rows' shape
                flat.zero_()
                self._gather(files, name, flat[:max(0, min(local.numel(), numel - offset))], offset)
        return True

    @staticmethod
    def _gather(files, name: str, out: torch.Tensor, start: int):
        """Fill `out` with elements [start, start + len(out)) of the flattened parameter `name` from the pieces (a
        pipeline's files hold their stage's weights alone)."""
        end = start + out.numel()
        for pieces in files:
            if name not in pieces:
                continue
            piece, at = pieces[name]
            piece = piece.reshape(-1)
            lo, hi = max(start, at), min(end, at + piece.numel())
            if lo < hi:
                out[lo - start:hi - start] = piece[lo - at:hi - at]


def read_ema(folder: str, shapes: dict) -> dict:
    """{name: the EMA's whole fp32 tensor} from a checkpoint's `ema/` files, written by any number of ranks under
    any engine, for the weights `shapes` names ({name: anything with .shape}) that the EMA holds; one process, no
    process group (export.py --ema)."""
    files = [torch.load(os.path.join(folder, f), mmap=True, weights_only=True)["pieces"]
             for f in sorted(os.listdir(folder)) if f.endswith(".pt")]
    held = set().union(*(pieces.keys() for pieces in files)) if files else set()
    out = {}
    for name in held & set(shapes):
        whole = torch.empty(shapes[name].shape, dtype=torch.float32)
        EMA._gather(files, name, whole.view(-1), 0)
        out[name] = whole
    return out

