"""DeepSpeed ZeRO's checkpoint layout: the files each rank writes, the universal format a checkpoint is converted
to when another number of ranks resumes it, and the fp32 weights read back in one process for export.

A checkpoint of W ranks at ZeRO stage S and tensor-parallel size T holds each rank's optimizer partition
(`zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt`, `bf16_`-prefixed under bf16 with ZeRO-1/2), under ZeRO-3 each
rank's weights (`zero_pp_rank_<d>_mp_rank_<t>_model_states.pt`), and below ZeRO-3 the weights once per tensor rank
(`mp_rank_<t>_model_states.pt`). These files are DeepSpeed's own pickles: reading them unpickles (`torch.load` with
`weights_only=False`), so load only checkpoints you or your cluster wrote.

Another number of ranks resumes through DeepSpeed's universal format (`python -m
deepspeed.checkpoint.ds_to_universal`), written once into `<tag>_universal/` beside the checkpoint and loaded with
`"checkpoint": {"load_universal": true}`. The original is only read.
"""
import contextlib
import os
import shutil
import subprocess
import sys

from config import Config, ConfigError
from engine.base import STATE_FILE
from parallel.tensor import layout

UNIVERSAL_SUFFIX = "_universal"


def missing_files(path: str, world_size: int, stage: int, tp_size: int = 1) -> list[str]:
    """The DeepSpeed files a checkpoint of `world_size` ranks at ZeRO `stage` and `tp_size` holds that are not in
    `path`: each rank's optimizer partition (and under ZeRO-3 its weights), named by its data-parallel rank and its
    rank in the tensor group; below ZeRO-3 the weights once per tensor rank."""
    missing = []
    names = os.listdir(path)
    for r in range(world_size):
        dp, tp = layout(r, tp_size)
        optim = f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt"  # bf16_ prefixed under bf16 with ZeRO-1/2
        if optim not in names and f"bf16_{optim}" not in names:
            missing.append(optim)
        if stage == 3 and f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt" not in names:
            missing.append(f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt")
    for tp in range(tp_size if stage < 3 else 0):
        if f"mp_rank_{tp:02d}_model_states.pt" not in names:
            missing.append(f"mp_rank_{tp:02d}_model_states.pt")
    return missing


def convert_command(path: str) -> str:
    return (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {path} "
            f"--output_folder {path}{UNIVERSAL_SUFFIX} --inject_missing_state")


class ZeroCheckpoint:
    """engine/base.py's CheckpointFormat for DeepSpeed's engine."""

    def check(self, path: str, state: dict, cfg: Config, world_size: int) -> bool:
        if state["zero_stage"] != cfg.zero_stage:
            raise ConfigError(f"resume: checkpoint {path} was written under ZeRO-{state['zero_stage']} and this run "
                              f"uses ZeRO-{cfg.zero_stage}; resume it with --zero_stage {state['zero_stage']}")
        tp_size = state.get("tp_size", 1)
        if tp_size != cfg.tp_size:
            raise ConfigError(f"resume: checkpoint {path} was written with tp_size {tp_size} and this run uses "
                              f"tp_size {cfg.tp_size}: this trainer reshards ZeRO's partitions (through DeepSpeed's "
                              f"universal checkpoint), not a tensor-parallel split; resume it with --tp_size {tp_size}")
        if tp_size > 1 and state["world_size"] != world_size:
            raise ConfigError(f"resume: checkpoint {path} was written by {state['world_size']} ranks with tp_size "
                              f"{tp_size} and this run has {world_size}: this trainer reshards ZeRO's partitions "
                              f"only without tensor parallelism; resume it on {state['world_size']} ranks")
        missing = missing_files(path, state["world_size"], state["zero_stage"], tp_size)
        if missing:
            raise ConfigError(f"resume: checkpoint {path} is incomplete: {len(missing)} of the files its "
                              f"{state['world_size']} ranks wrote are missing ({', '.join(missing[:4])}"
                              f"{', ...' if len(missing) > 4 else ''})")
        return state["world_size"] != world_size

    def load_tag(self, tag: str, converted: bool) -> str:
        return tag + UNIVERSAL_SUFFIX if converted else tag

    def remove_derived(self, path: str):
        shutil.rmtree(path + UNIVERSAL_SUFFIX, ignore_errors=True)

    def convert(self, path: str, state: dict, world_size: int, log=print):
        """Write `<tag>_universal` beside the checkpoint unless it is there already (run on one rank). The
        conversion goes to a temporary directory renamed at the end, so an interrupted one is never taken for a
        finished one."""
        out = path + UNIVERSAL_SUFFIX
        if os.path.isdir(out):
            log(f"resume: {state['world_size']} -> {world_size} ranks: loading the universal checkpoint {out}")
            return
        log(f"resume: checkpoint written by {state['world_size']} ranks, this run has {world_size}: converting it "
            f"to DeepSpeed's universal format in {out} (the original is not modified; the same by hand: "
            f"{convert_command(path)})")
        tmp = out + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               path, "--output_folder", tmp, "--num_extract_workers", "1",
                               "--num_merge_workers", "1", "--inject_missing_state"], capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(f"resume: converting {path} to the universal format failed:\n"
                              f"{(proc.stdout + proc.stderr)[-3000:]}")
        shutil.copy2(os.path.join(path, STATE_FILE), tmp)
        os.rename(tmp, out)
        with open(os.path.join(os.path.dirname(path), "latest_universal"), "w") as f:  # ds_to_universal named tmp
            f.write(os.path.basename(out))

    @contextlib.contextmanager
    def read_weights(self, checkpoint: str, state: dict, hf_config: str):
        """The fp32 master weights, merged from every rank's partitions (and tensor ranks' shards) lazily."""
        tp_size, zero_stage = state.get("tp_size", 1), state.get("zero_stage")
        if tp_size == 1:
            yield data_parallel_weights(checkpoint, zero_stage)
            return
        import tempfile

        with tempfile.TemporaryDirectory() as views:
            yield tensor_parallel_weights(checkpoint, tp_size, hf_config, zero_stage, views)


def tensor_parallel_weights(checkpoint: str, tp_size: int, hf_config: str, zero_stage, views: str):
    """Each tensor rank's fp32 master weights, merged over ZeRO's partitions (lazily: nothing read yet), then
    joined weight by weight against the shapes of the model `hf_config` describes. ZeRO-1/2's through
    `zero_to_fp32`; ZeRO-3's by zero3_tensor_ranks."""
    import torch
    from transformers import AutoConfig, AutoModelForImageClassification

    from parallel.tensor import block_linears, unshard

    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(AutoConfig.from_pretrained(hf_config))
    full = model.state_dict()
    if zero_stage == 3:
        split = {f"{prefix}.{kind}" for prefix, _ in block_linears(model) for kind in ("weight", "bias")}
        shards = zero3_tensor_ranks(checkpoint, tp_size, split)
    else:
        shards = [zero12_tensor_rank(checkpoint, t, views) for t in range(tp_size)]
    missing = set(full) - set(shards[0])  # (a checkpoint may also hold buffers the model does not save)
    if missing:
        raise ValueError(f"{checkpoint} does not hold the weights of the model in {hf_config} (missing: "
                         f"{', '.join(sorted(missing)[:3])})")
    return full, lambda name: unshard(name, [s[name].contiguous() for s in shards], full[name].shape)


def data_parallel_weights(checkpoint: str, zero_stage):
    """The fp32 master weights merged over ZeRO's partitions by DeepSpeed's `zero_to_fp32` (lazily: nothing read
    yet). ZeRO-1 saves no frozen parameter beside the optimizer's state (DeepSpeed saves them with ZeRO-2 and 3):
    those come from the module's own copy in its model states."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt_dir, tag = os.path.split(checkpoint)
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag, lazy_mode=True)
    if zero_stage == 1:
        module = torch.load(os.path.join(checkpoint, "mp_rank_00_model_states.pt"), map_location="cpu", mmap=True,
                            weights_only=False)["module"]  # DeepSpeed's pickle; mapped: only the tensors taken are read
        state.update({name: tensor for name, tensor in module.items() if name not in state})
    return state, lambda name: state[name].contiguous()


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
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)  # DeepSpeed's pickle

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
