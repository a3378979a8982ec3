"""The trained model as a Hugging Face directory: the weights gathered from the engine (under ZeRO-3 one module at a
time), checked finite, written beside the image processor and renamed into place when complete."""
import os
import shutil
import sys

import torch
import torch.distributed as dist

from engine import compat


def export_hf_model(engine, processor, out_dir: str, rank: int) -> bool:
    """A Hugging Face directory `pipeline("image-classification", model=out_dir)` loads; False (and nothing
    written) if a weight is not finite."""
    state_dict = full_state_dict(engine, rank)
    bad = [k for k, v in state_dict.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        print(f"error: not exported: {len(bad)} weight tensors hold inf or NaN ({', '.join(bad[:3])}"
              f"{', ...' if len(bad) > 3 else ''})", file=sys.stderr, flush=True)
    elif rank == 0:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one shard: a bar says nothing
        partial = out_dir + ".partial"  # renamed when complete: a kill mid-export leaves the previous export whole
        shutil.rmtree(partial, ignore_errors=True)
        engine.module.save_pretrained(partial, state_dict=state_dict)
        processor.save_pretrained(partial)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(partial, out_dir)
    exported = [not bad]
    dist.broadcast_object_list(exported, src=0)  # only rank 0 holds the weights
    return exported[0]


def full_state_dict(engine, rank: int) -> dict:
    """The whole model's weights on rank 0 ({} elsewhere). Under ZeRO-3 each module's parameters are gathered
    in turn (`deepspeed.zero.GatheredParameters`) and copied out, so no rank gathers the whole model at once; under
    tensor parallelism DeepSpeed's own consolidation does the same over the tensor groups too."""
    import deepspeed

    module = engine.module
    tensor_parallel = engine.autotp_size() > 1
    if not tensor_parallel and not engine.zero_optimization_partition_weights():
        return module.state_dict() if rank == 0 else {}
    params = {name for name, _ in module.named_parameters()}
    state = {k: v for k, v in module.state_dict().items() if k not in params} if rank == 0 else {}  # buffers
    if tensor_parallel:  # each AutoTP layer's shards, and under ZeRO-3 its partitions, gathered
        return {**state, **compat.tp_gathered_parameters(engine)}
    for prefix, sub in module.named_modules():
        own = dict(sub.named_parameters(recurse=False))
        if not own:
            continue
        with deepspeed.zero.GatheredParameters(list(own.values())):
            if rank == 0:
                state.update({f"{prefix}.{n}" if prefix else n: p.detach().cpu().clone() for n, p in own.items()})
    return state
