"""Convert a training checkpoint to a Hugging Face directory that `from_pretrained` and `pipeline()` load.

    python export.py runs/digits-vit/checkpoints/step0000600 runs/digits-vit/hf-step600
    python export.py runs/digits-vit/checkpoints/step0000600 out --dtype bf16

Any ZeRO stage, any world size, on one CPU process, without DeepSpeed's process group. The weights are the
checkpoint's fp32 master copy, merged from every rank's partitions by DeepSpeed's `zero_to_fp32` in lazy mode
and written shard by shard (safetensors, 5 GB shards), so host memory never holds more than one shard of the
model. A tensor-parallel checkpoint (`tp_size` > 1) is merged per tensor rank (ZeRO-1/2's the same way, ZeRO-3's
from its partitions as DeepSpeed lays them out under AutoTP), then each split weight is concatenated along its
split dimension, one weight at a time. An FSDP2 checkpoint (torch.distributed.checkpoint's files) is read tensor
by tensor without a process group, each weight whole from every rank's shards. config.json and the image processor come from the run's `hf_config/`,
which train.py writes at start. The directory is written under `OUT.partial` and renamed when complete.
"""
import argparse
import json
import os
import shutil
import sys
import warnings

DTYPES = ("fp32", "bf16", "fp16")
MAX_SHARD = "5GB"


def export(checkpoint: str, out: str, dtype: str = "fp32", log=print):
    import torch

    from engine.checkpoint import STATE_FILE

    checkpoint = checkpoint.rstrip("/")
    ckpt_dir, tag = os.path.split(checkpoint)
    hf_config = os.path.join(os.path.dirname(ckpt_dir), "hf_config")
    if not os.path.isdir(checkpoint):
        raise ValueError(f"checkpoint directory '{checkpoint}' does not exist")
    if not os.path.isfile(os.path.join(hf_config, "config.json")):
        raise ValueError(f"no {hf_config}/config.json: export.py converts checkpoints of train.py runs, whose "
                         f"run directory holds the model's config (written at the start of the run)")
    if os.path.exists(out):
        raise ValueError(f"'{out}' exists: choose a new directory")
    state_file = os.path.join(checkpoint, STATE_FILE)
    state = json.load(open(state_file)) if os.path.isfile(state_file) else {}
    tp_size = state.get("tp_size", 1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(hf_config, partial)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    try:
        if state.get("engine") == "fsdp2":
            merge_fsdp2(checkpoint, partial, torch_dtype)
        elif tp_size > 1:
            merge_tensor_parallel(checkpoint, tp_size, hf_config, partial, torch_dtype, state.get("zero_stage"))
        else:
            merge_data_parallel(checkpoint, partial, torch_dtype, state.get("zero_stage"))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, out)
    log(f"exported {checkpoint} ({dtype}) to {out}")


def merge_tensor_parallel(checkpoint: str, tp_size: int, hf_config: str, out: str, dtype, zero_stage):
    """Each tensor rank's fp32 master weights, merged over ZeRO's partitions (lazily: nothing read yet), then
    joined weight by weight against the shapes of the model `hf_config` describes, and written one safetensors
    shard at a time. ZeRO-1/2's through `zero_to_fp32`; ZeRO-3's by zero3_tensor_ranks."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForImageClassification

    from engine.tensor_parallel import block_linears, unshard

    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(AutoConfig.from_pretrained(hf_config))
    full = model.state_dict()
    with tempfile.TemporaryDirectory() as views:
        if zero_stage == 3:
            split = {f"{prefix}.{kind}" for prefix, _ in block_linears(model) for kind in ("weight", "bias")}
            shards = zero3_tensor_ranks(checkpoint, tp_size, split)
        else:
            shards = [zero12_tensor_rank(checkpoint, t, views) for t in range(tp_size)]
        missing = set(full) - set(shards[0])  # (a checkpoint may also hold buffers the model does not save)
        if missing:
            raise ValueError(f"{checkpoint} does not hold the weights of the model in {hf_config} (missing: "
                             f"{', '.join(sorted(missing)[:3])})")
        write_safetensors(full, lambda name: unshard(name, [s[name].contiguous() for s in shards], full[name].shape),
                          out, dtype)


def merge_data_parallel(checkpoint: str, out: str, dtype, zero_stage):
    """The fp32 master weights merged over ZeRO's partitions by DeepSpeed's `zero_to_fp32` (lazily: nothing read
    yet), written one safetensors shard at a time. ZeRO-1 saves no frozen parameter beside the optimizer's state
    (DeepSpeed saves them with ZeRO-2 and 3): those come from the module's own copy in its model states."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt_dir, tag = os.path.split(checkpoint)
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag, lazy_mode=True)
    if zero_stage == 1:
        module = torch.load(os.path.join(checkpoint, "mp_rank_00_model_states.pt"), map_location="cpu", mmap=True,
                            weights_only=False)["module"]  # mapped: only the tensors taken are read
        state.update({name: tensor for name, tensor in module.items() if name not in state})
    write_safetensors(state, lambda name: state[name].contiguous(), out, dtype)


def merge_fsdp2(checkpoint: str, out: str, dtype):
    """The fp32 weights of an FSDP2 checkpoint (the DCP files every rank wrote), each assembled whole from its
    shards as its safetensors shard is written, one weight in memory at a time beside the shard."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    shapes = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
              for key, meta in stored.items() if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}

    def tensor(name):
        whole = {"model": {name: torch.empty(shapes[name].shape, dtype=shapes[name].dtype)}}
        with warnings.catch_warnings():  # DCP says it loads in one process, which is the intent here
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(whole, checkpoint_id=checkpoint, no_dist=True)
        return whole["model"][name]

    write_safetensors(shapes, tensor, out, dtype)


def write_safetensors(shapes: dict, tensor, out: str, dtype):
    """The weights `shapes` names ({name: anything with .shape and .dtype}), each read by `tensor(name)` and cast to
    `dtype` when floating, as model.safetensors or model-0000i-of-0000n.safetensors shards of at most MAX_SHARD with
    their index, one shard in memory at a time."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    empty = {k: torch.empty(v.shape, dtype=dtype if v.dtype.is_floating_point else v.dtype) for k, v in shapes.items()}
    files = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD)
    for filename, names in files.filename_to_tensors.items():
        tensors = {}
        for name in names:
            whole = tensor(name)
            tensors[name] = whole.to(dtype) if whole.is_floating_point() else whole
        save_file(tensors, os.path.join(out, filename), metadata={"format": "pt"})
        del tensors
    if files.is_sharded:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": files.metadata, "weight_map": files.tensor_to_filename}, f, indent=2)


def zero12_tensor_rank(checkpoint: str, t: int, views: str) -> dict:
    """Tensor rank `t`'s fp32 weights of a ZeRO-1/2 checkpoint, lazily, through `zero_to_fp32`, which reads tensor
    rank 0's file names: rank t's files are linked under those names in a folder of `views`."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = os.path.basename(checkpoint)
    view = os.path.join(views, str(t), tag)
    os.makedirs(view)
    for name in os.listdir(checkpoint):
        if f"mp_rank_{t:02d}_" in name:
            os.symlink(os.path.abspath(os.path.join(checkpoint, name)),
                       os.path.join(view, name.replace(f"mp_rank_{t:02d}_", "mp_rank_00_")))
    return get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(view), tag, lazy_mode=True)


class _Stream:
    """One rank's fp32 partitions, as the checkpoint holds them: a list of flat sub-groups (memory-mapped), read
    as one stream."""

    def __init__(self, groups: list):
        self.groups, self.starts = groups, [0]
        for g in groups:
            self.starts.append(self.starts[-1] + g.numel())

    def numel(self) -> int:
        return self.starts[-1]

    def read(self, start: int, n: int) -> list:
        """Values [start, start + n) of the stream, as slices of its sub-groups."""
        out = []
        for g, lo, hi in zip(self.groups, self.starts, self.starts[1:]):
            if lo < start + n and start < hi:
                a = max(start, lo) - lo
                out.append(g.narrow(0, a, min(start + n, hi) - lo - a))
        return out


class _Gathered:
    """One parameter's fp32 value, read when asked for: its partitions' slices of the ranks' streams."""

    def __init__(self, pieces: list, shape):
        self.pieces, self.shape = pieces, shape

    def contiguous(self):
        import torch

        parts = [p for stream, start, n in self.pieces for p in stream.read(start, n)]
        return torch.cat(parts)[:self.shape.numel()].view(self.shape).clone()


def zero3_tensor_ranks(checkpoint: str, tp_size: int, split: set) -> list:
    """Every tensor rank's fp32 weights of a ZeRO-3 checkpoint under tensor parallelism, lazily: [{name: value}].

    The model is built under `zero.Init` over every rank, and AutoTP then replaces the split linear layers (`split`,
    their weights and biases), whose new parameters ZeRO-3 partitions over the data-parallel group alone. So a
    replicated parameter is in world_size partitions, partition r on global rank r = data rank x tp_size + tensor
    rank; a split one is in world_size / tp_size partitions of its tensor rank's shard, partition d on data rank
    d. Each rank's file holds its partitions in the order of the parameter shapes it records, each
    ceil(numel / partitions) long; a file whose length is not that sum is refused."""
    import math

    import torch

    def load(d, t, kind):
        path = os.path.join(checkpoint, f"zero_pp_rank_{d}_mp_rank_{t:02d}_{kind}_states.pt")
        if not os.path.isfile(path):
            raise ValueError(f"{checkpoint} lacks {os.path.basename(path)}: not every rank's ZeRO-3 files are there")
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)

    data_ranks = sum(1 for n in os.listdir(checkpoint) if n.endswith("_mp_rank_00_optim_states.pt"))
    world = data_ranks * tp_size
    streams, shapes = {}, []
    for t in range(tp_size):
        shapes.append({k: v for group in load(0, t, "model")["param_shapes"] for k, v in group.items()})
        for d in range(data_ranks):
            streams[d, t] = _Stream(load(d, t, "optim")["optimizer_state_dict"]["fp32_flat_groups"])
    out = []
    for t in range(tp_size):
        offset, params = 0, {}
        for name, shape in shapes[t].items():
            parts = data_ranks if name in split else world
            n = math.ceil(shape.numel() / parts)
            owners = [(d, t) for d in range(data_ranks)] if parts == data_ranks else \
                [(r // tp_size, r % tp_size) for r in range(world)]
            params[name] = _Gathered([(streams[owner], offset, n) for owner in owners], shape)
            offset += n
        if offset != streams[0, t].numel():
            raise ValueError(f"{checkpoint}: tensor rank {t}'s ZeRO-3 partitions hold {streams[0, t].numel()} values, "
                             f"not the {offset} its parameters' shapes need: not a layout export.py reads")
        out.append(params)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory: <output_dir>/checkpoints/step<N>")
    parser.add_argument("out", help="the Hugging Face directory to write (must not exist)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights' precision (default fp32)")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out, args.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
