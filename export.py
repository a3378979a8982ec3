"""Convert a training checkpoint to a Hugging Face directory that `from_pretrained` and `pipeline()` load.

    python export.py runs/digits-vit/checkpoints/step0000600 runs/digits-vit/hf-step600
    python export.py runs/digits-vit/checkpoints/step0000600 out --dtype bf16

Any ZeRO stage, any world size, on one CPU process, without DeepSpeed's process group. The weights are the
checkpoint's fp32 master copy, merged from every rank's partitions by DeepSpeed's `zero_to_fp32` in lazy mode
and written shard by shard (safetensors, 5 GB shards), so host memory never holds more than one shard of the
model. A tensor-parallel checkpoint (`tp_size` > 1) of ZeRO-1 or 2 is merged per tensor rank the same way, then
each split weight is concatenated along its split dimension, one weight at a time (ZeRO-3's under tensor
parallelism is refused). config.json and the image processor come from the run's `hf_config/`, which train.py
writes at start. The directory is written under `OUT.partial` and renamed when complete.
"""
import argparse
import json
import os
import shutil
import sys

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
    if tp_size > 1 and state.get("zero_stage") == 3:
        raise ValueError(f"{checkpoint} was written under ZeRO-3 with tp_size {tp_size}, whose partitions "
                         f"zero_to_fp32 does not merge per tensor rank; export.py merges tensor-parallel checkpoints "
                         f"of ZeRO-1 and 2, and the run's hf_model/, written at its end, holds the whole model")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(hf_config, partial)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    try:
        if tp_size > 1:
            merge_tensor_parallel(checkpoint, tp_size, hf_config, partial, torch_dtype)
        else:
            convert_zero_checkpoint_to_state_dict(ckpt_dir, partial, dtype=torch_dtype, max_shard_size=MAX_SHARD,
                                                  safe_serialization=True, tag=tag)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, out)
    log(f"exported {checkpoint} ({dtype}) to {out}")


def merge_tensor_parallel(checkpoint: str, tp_size: int, hf_config: str, out: str, dtype):
    """Each tensor rank's fp32 master weights, merged over ZeRO's partitions by `zero_to_fp32` (lazily: nothing
    read yet), then joined weight by weight against the shapes of the model `hf_config` describes, and written
    one safetensors shard at a time."""
    import tempfile

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForImageClassification

    from engine.tensor_parallel import unshard

    with torch.device("meta"):
        full = AutoModelForImageClassification.from_config(AutoConfig.from_pretrained(hf_config)).state_dict()
    tag = os.path.basename(checkpoint)
    with tempfile.TemporaryDirectory() as views:
        shards = []
        for t in range(tp_size):  # zero_to_fp32 reads tensor rank 0's file names: each rank's files seen as those
            view = os.path.join(views, str(t), tag)
            os.makedirs(view)
            for name in os.listdir(checkpoint):
                if f"mp_rank_{t:02d}_" in name:
                    os.symlink(os.path.abspath(os.path.join(checkpoint, name)),
                               os.path.join(view, name.replace(f"mp_rank_{t:02d}_", "mp_rank_00_")))
            shards.append(get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(view), tag, lazy_mode=True))
        missing = set(full) - set(shards[0])  # (a checkpoint may also hold buffers the model does not save)
        if missing:
            raise ValueError(f"{checkpoint} does not hold the weights of the model in {hf_config} (missing: "
                             f"{', '.join(sorted(missing)[:3])})")
        empty = {k: torch.empty(v.shape, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in full.items()}
        split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=MAX_SHARD)
        for filename, names in split.filename_to_tensors.items():
            tensors = {}
            for name in names:
                whole = unshard(name, [s[name].contiguous() for s in shards], full[name].shape)
                tensors[name] = whole.to(dtype) if whole.is_floating_point() else whole
            save_file(tensors, os.path.join(out, filename), metadata={"format": "pt"})
            del tensors
    if split.is_sharded:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)


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
