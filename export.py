"""Convert a training checkpoint to a Hugging Face directory that `from_pretrained` and `pipeline()` load.

    python export.py runs/digits-vit/checkpoints/step0000600 runs/digits-vit/hf-step600
    python export.py runs/digits-vit/checkpoints/step0000600 out --dtype bf16

Any ZeRO stage, any world size, on one CPU process, without DeepSpeed's process group. The weights are the
checkpoint's fp32 master copy, merged from every rank's partitions by DeepSpeed's `zero_to_fp32` in lazy mode
and written shard by shard (safetensors, 5 GB shards), so host memory never holds more than one shard of the
model. config.json and the image processor come from the run's `hf_config/`, which train.py writes at start.
The directory is written under `OUT.partial` and renamed when complete.
"""
import argparse
import json
import os
import shutil
import sys

DTYPES = ("fp32", "bf16", "fp16")


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
    tp_size = json.load(open(state_file)).get("tp_size", 1) if os.path.isfile(state_file) else 1
    if tp_size > 1:
        raise ValueError(f"{checkpoint} was written with tp_size {tp_size}: export.py merges ZeRO's partitions, not "
                         f"tensor-parallel shards; the run's hf_model/, written at its end, holds the whole model")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(hf_config, partial)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    convert_zero_checkpoint_to_state_dict(ckpt_dir, partial, dtype=torch_dtype, max_shard_size="5GB",
                                          safe_serialization=True, tag=tag)
    os.rename(partial, out)
    log(f"exported {checkpoint} ({dtype}) to {out}")


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
