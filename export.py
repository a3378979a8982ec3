"""Convert a training checkpoint to a Hugging Face directory that `from_pretrained` and `pipeline()` load.

    python export.py runs/digits-vit/checkpoints/step0000600 runs/digits-vit/hf-step600
    python export.py runs/digits-vit/checkpoints/step0000600 out --dtype bf16

    python export.py runs/digits-vit/checkpoints/step0000600 runs/digits-vit/hf-ema --ema

Any engine, any ZeRO stage, any world size, on one CPU process, without a process group. The weights are the
checkpoint's fp32 weights (DeepSpeed's master copy), read by the format of the engine that wrote the checkpoint
(engine/zero_checkpoint.py: merged from every rank's partitions, and tensor ranks' shards, lazily;
engine/dcp_checkpoint.py: each weight whole from every rank's shards) and written shard by shard (safetensors,
5 GB shards), so host memory never holds more than one shard of the model. `--ema`: the checkpoint's exponential
moving average of the weights instead (a run with `ema_decay`). config.json and the image processor come from
the run's `hf_config/`, which train.py writes at start. The directory is written under `OUT.partial` and renamed
when complete.
"""
import argparse
import json
import os
import shutil
import sys

DTYPES = ("fp32", "bf16", "fp16")
MAX_SHARD = "5GB"


def export(checkpoint: str, out: str, dtype: str = "fp32", ema: bool = False, log=print):
    import torch

    from engine.base import STATE_FILE
    from engine.registry import written_by
    from loop.ema import EMA_DIR, read_ema

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
    if ema and not os.path.isdir(os.path.join(checkpoint, EMA_DIR)):
        raise ValueError(f"{checkpoint} holds no EMA of the weights (the run trained without ema_decay)")
    fmt = written_by(state).checkpoint_format
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(hf_config, partial)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    try:
        with fmt.read_weights(checkpoint, state, hf_config) as (shapes, tensor):
            if ema:  # the EMA's files hold every weight the model trains; buffers come from the checkpoint
                averaged = read_ema(os.path.join(checkpoint, EMA_DIR), shapes)
                live = tensor
                tensor = lambda name: averaged[name] if name in averaged else live(name)  # noqa: E731
            write_safetensors(shapes, tensor, partial, torch_dtype)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, out)
    log(f"exported {checkpoint}{' (its EMA)' if ema else ''} ({dtype}) to {out}")


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory: <output_dir>/checkpoints/step<N>")
    parser.add_argument("out", help="the Hugging Face directory to write (must not exist)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights' precision (default fp32)")
    parser.add_argument("--ema", action="store_true",
                        help="export the checkpoint's EMA of the weights (a run with ema_decay) instead of the live ones")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out, args.dtype, args.ema)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
