"""The DeepSpeed config of a run: a JSON template from ds_configs/ with its "auto" fields filled from the run
config; an explicit template value that disagrees with the run config is an error naming both."""
import json
import math
import os

import torch

from config import Config, ConfigError

DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")
ADAM_EPS = 1e-8
MUON_MOMENTUM = 0.95  # Muon's Nesterov momentum (Jordan et al. 2024)
# Bucket sizes follow Hugging Face's DeepSpeed integration, derived from the model's hidden size h: DeepSpeed's
# own defaults (5e8 elements, 2 GB in fp32) are sized for large language models.
MIN_BUCKET_ELEMENTS = 2**20  # a floor, so that small models do not pay one collective per tensor
PREFETCH_FRACTION = 0.9  # stage3_prefetch_bucket_size = 0.9 * h^2
BLOCK_PARAMS_PER_HIDDEN_SQ = 12  # a transformer block holds ~12 h^2 parameters (attention 4 h^2, MLP 8 h^2)
GPU_BUCKET_BLOCKS = 4  # GPU: a reduce or all-gather bucket holds about four blocks' parameters
GPU_SUB_GROUP = 10**9  # GPU: ZeRO-3's optimizer sub-group, DeepSpeed's default (the whole partition of most models)
PERSISTENCE_PER_HIDDEN = 10  # GPU: ZeRO-3 keeps parameters of at most 10 h elements gathered
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the `precision` key's dtypes


def resolve_precision(precision: str) -> str:
    """fp32 | bf16 | fp16 for the `precision` key; `auto` is bf16 on GPUs that support it, fp32 elsewhere."""
    if precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("precision fp16 needs a GPU: DeepSpeed's CPU accelerator has no fp16; use fp32 or bf16")
    if precision != "auto":
        return precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def _fill(ds: dict, path: str, value, where: str):
    """Set ds[path] when it is "auto" or absent; a different explicit value is a contradiction."""
    *parents, leaf = path.split(".")
    node = ds
    for key in parents:
        node = node.setdefault(key, {})
    current = node.get(leaf, "auto")
    if current == "auto":
        node[leaf] = value
    elif current != value and not (isinstance(value, float) and isinstance(current, (int, float))
                                   and math.isclose(current, value)):
        raise ConfigError(f"{where} sets {path} = {current!r} but the run config implies {value!r}: "
                          f"make them agree or set it to \"auto\"")


def _walk(d: dict, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


# ZeRO++ (Wang et al. 2023): hpZ keeps a secondary copy of each parameter partitioned within a node, so the
# backward's gathers stay inside it; qwZ and qgZ quantize the weights' gathers and the gradients' reduce-scatter
ZEROPP_QUANTIZED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


def _zeropp(zero: dict, where: str, node_ranks: int | None, gpu: bool | None):
    """Fill hpZ's "auto" partition size with the ranks per node; refuse quantized communication without a GPU.
    `node_ranks`, `gpu`: the cluster a plan is for (plan.py), instead of this process's."""
    from loop.distributed import ranks_per_node

    if zero.get("zero_hpz_partition_size") == "auto":
        zero["zero_hpz_partition_size"] = node_ranks or ranks_per_node()
    quantized = [k for k in ZEROPP_QUANTIZED if zero.get(k)]
    if quantized and not (torch.cuda.is_available() if gpu is None else gpu):
        raise ConfigError(f"{where} sets {' and '.join(quantized)}: ZeRO++'s quantized communication runs "
                          f"DeepSpeed's CUDA quantizer kernels and needs a GPU; on CPU set them false (hierarchical "
                          f"partitioning, zero_hpz_partition_size, runs anywhere)")


def auto_zero_sizes(hidden_size: int, gpu: bool) -> dict:
    """The zero_optimization sizes a template leaves "auto", per device, in elements (h: the hidden size).

    CPU: Hugging Face's h^2 buckets and the sizes measured for CPU memory (benchmarks/results/ds-tuning-*).
    GPU: ZeRO's Python hooks run per parameter, per bucket and per optimizer sub-group, and on a GPU that host
    work sets the step's pace (docs/benchmarks.md: the H200 traces): several blocks per bucket, a block's small
    parameters kept gathered, one block prefetched, and the optimizer stepping the whole partition at once
    (DeepSpeed's own default, up to 1e9 elements). engine/memory.py counts what each choice keeps."""
    block = BLOCK_PARAMS_PER_HIDDEN_SQ * hidden_size * hidden_size
    if gpu:
        bucket = max(GPU_BUCKET_BLOCKS * block, MIN_BUCKET_ELEMENTS)
        return {
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            # the next block's weights, in one coalesced gather
            "stage3_prefetch_bucket_size": block,
            # biases and norms (h or 4h elements) stay gathered: a block's gather and release handle its four
            # matrices, not its sixteen tensors (Hugging Face's "auto" is this 10 h)
            "stage3_param_persistence_threshold": PERSISTENCE_PER_HIDDEN * hidden_size,
            # the block computing, the one prefetched and one released late
            "stage3_max_live_parameters": 3 * block,
            "stage3_max_reuse_distance": 2 * block,
            "sub_group_size": GPU_SUB_GROUP,
            "overlap_comm": True,  # the reduction on a second stream, hidden behind the backward
        }
    bucket = max(hidden_size * hidden_size, MIN_BUCKET_ELEMENTS)
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": int(PREFETCH_FRACTION * bucket),
        # no parameter stays gathered: a block's biases and norms come with its weights in the block's one
        # coalesced gather (its blocks are leaf modules), while ZeRO-3 all-gathers every persistent one again
        # after each optimizer step, one collective per tensor (benchmarks/results/ds-tuning-persistence)
        "stage3_param_persistence_threshold": 0,
        # DeepSpeed's defaults (1e9 elements) keep every gathered parameter from its forward to its backward, a
        # whole unsharded model per rank; two blocks' worth lets a block's weights go after its forward, and a
        # checkpointed block's recompute runs inside its backward, after the block's own gather
        "stage3_max_live_parameters": 2 * block,
        "stage3_max_reuse_distance": block,
        # ZeRO-3 steps the optimizer one sub-group of the partition at a time, flattening the sub-group's fp32
        # gradients first: one block's worth bounds that copy (DeepSpeed's 1e9 spans the whole partition)
        "sub_group_size": block,
        # a second stream for the reduction only adds copies on CPU (benchmarks/results/ds-tuning-vit-s)
        "overlap_comm": False,
    }


def build_ds_config(cfg: Config, hidden_size: int, world_size: int, precision: str, ranks_per_node: int | None = None,
                    gpu: bool | None = None) -> dict:
    """The DeepSpeed config for this run: the template's explicit values win only where they agree.
    `ranks_per_node`, `gpu`: the cluster a plan is for (plan.py); by default this process's."""
    path = cfg.ds_config or os.path.join(DS_CONFIG_DIR, f"zero{cfg.zero_stage}.json")
    try:
        with open(path) as f:
            ds = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read ds_config '{path}': {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"ds_config '{path}' is not valid JSON: {e}") from None
    where = f"ds_config '{os.path.relpath(path)}'"
    if "tensor_parallel" in ds:
        raise ConfigError(f"{where} has a 'tensor_parallel' section: tensor parallelism comes from tp_size, with this "
                          f"project's partition of ViT and Swin blocks (parallel/tensor.py); remove it")
    if "scheduler" in ds:
        raise ConfigError(f"{where} has a 'scheduler': the schedule comes from warmup_steps, max_steps, lr and "
                          f"min_lr; remove it")

    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * world_size
    if ds.get("train_batch_size", "auto") not in ("auto", global_batch):
        raise ConfigError(f"{where} sets train_batch_size = {ds['train_batch_size']} but micro_batch_size x "
                          f"grad_accum_steps x world size = {cfg.micro_batch_size} x {cfg.grad_accum_steps} x "
                          f"{world_size} = {global_batch}")
    _fill(ds, "train_batch_size", global_batch, where)
    _fill(ds, "train_micro_batch_size_per_gpu", cfg.micro_batch_size, where)
    _fill(ds, "gradient_accumulation_steps", cfg.grad_accum_steps, where)
    _fill(ds, "gradient_clipping", cfg.grad_clip, where)
    _fill(ds, "zero_optimization.stage", cfg.zero_stage, where)
    _fill(ds, "bf16.enabled", precision == "bf16", where)
    _fill(ds, "fp16.enabled", precision == "fp16", where)
    ds.setdefault("optimizer", {"type": "auto", "params": {}})
    _fill(ds, "optimizer.type", "Muon" if cfg.optimizer == "muon" else "AdamW", where)
    _fill(ds, "optimizer.params.lr", cfg.lr, where)
    _fill(ds, "optimizer.params.betas", [cfg.beta1, cfg.beta2], where)
    _fill(ds, "optimizer.params.eps", ADAM_EPS, where)
    _fill(ds, "optimizer.params.weight_decay", cfg.weight_decay, where)
    if cfg.optimizer == "muon":  # lr, betas and eps are its AdamW half's
        _fill(ds, "optimizer.params.muon_lr", cfg.muon_lr, where)
        ds["optimizer"]["params"].setdefault("momentum", MUON_MOMENTUM)
    offloaded = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    # torch's AdamW, not DeepSpeed's FusedAdam: on GPUs its fused kernel, the same single-kernel update and the
    # optimizer the FSDP2 baseline runs, with no JIT build of a CUDA op at start (DeepSpeed hands extra optimizer
    # params to torch's AdamW: `fused` reaches it). On CPU its foreach update: with the fused CPU kernel an
    # element's update depends on where it sits in the rank's flat partition, so a resume on another number of
    # ranks is not bitwise (tests/integration/test_elastic.py); the foreach update is the same whatever the partition.
    # Optimizer states offloaded to CPU memory step with DeepSpeed's CPU Adam, built at the first run.
    ds["optimizer"]["params"].setdefault("torch_adam", not offloaded)
    if ds["optimizer"]["params"]["torch_adam"] and cfg.optimizer == "adamw":
        ds["optimizer"]["params"].setdefault("fused", torch.cuda.is_available() if gpu is None else gpu)

    zero = ds["zero_optimization"]
    on_gpu = torch.cuda.is_available() if gpu is None else gpu
    for key, value in auto_zero_sizes(hidden_size, on_gpu).items():
        if zero.get(key) == "auto":
            zero[key] = value
    _zeropp(zero, where, ranks_per_node, gpu)
    if cfg.optimizer == "muon" and cfg.zero_stage == 3:  # Muon's update needs each matrix's whole gradient
        if zero.get("reduce_scatter", "auto") not in ("auto", False):
            raise ConfigError(f"{where} sets zero_optimization.reduce_scatter, which DeepSpeed's ZeRO-3 cannot "
                              f"combine with optimizer muon: set it false or \"auto\"")
        zero["reduce_scatter"] = False
    leftover = [k for k, v in _walk(ds) if v == "auto"]
    if leftover:
        raise ConfigError(f"{where} has \"auto\" fields this trainer cannot fill: {', '.join(leftover)}")
    return ds
