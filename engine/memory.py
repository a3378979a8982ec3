"""Per-rank memory of each engine beside the activations (the planner's accounting, and what `auto` budgets the
activations against) and the bytes each rank sends per step."""


def zero_memory_bytes(n_params: int, zero_stage: int, world_size: int, precision: str, ds_config: dict) -> dict:
    """Per-rank bytes that do not depend on the batch, at the two moments that set a step's peak.

    ZeRO's accounting (Rajbhandari et al. 2020) with what DeepSpeed allocates when, read off the profiler's
    allocation events of training steps under each stage (docs/planner.md):
    - `backward`, when the backward starts and the activations peak: the weights (whole under ZeRO-1/2, a
      partition under ZeRO-3), the fp32 master partition (kept in fp32 training too) and AdamW's two fp32
      moments. ZeRO-3 also holds its gradient partition (allocated at initialisation), its prefetch bucket and
      gathered weights, counted as `stage3_max_live_parameters`: the forward ends holding about the last half
      reuse distance of them, and the backward's gathers, gradients and reduce-scatter copies add about as
      much again at its peak. ZeRO-2 holds its gradient partition from its first reduction on, which for the
      rank owning the last layers is the start of the backward. ZeRO-1 reduces at the end of the backward,
      when the activations are freed.
    - `optimizer_step`, which peaks in AdamW's update: the weights and states as above, the flat fp32 gradient
      partition DeepSpeed hands the optimizer, for torch's unfused (foreach) AdamW its two whole-partition
      temporaries (DeepSpeed flattens the partition into one tensor; the fused update has none) and, under
      ZeRO-1, the reduced gradient partition, which ZeRO-2 and 3 hold already.
    """
    parts = zero_memory_parts(n_params, zero_stage, world_size, precision, ds_config)
    held = sum(v for k, v in parts.items() if k != "optimizer_step_temporaries")
    return {"backward": held, "optimizer_step": held + parts["optimizer_step_temporaries"],
            "zero3_gathered": parts["zero3_gathered"]}


def fsdp2_memory_parts(n_params: int, outside_params: int, block_params: int, world_size: int, precision: str,
                       reshard: bool, fused_adamw: bool, grad_accum_steps: int = 1) -> dict:
    """fsdp2_memory_bytes's terms, per rank, under zero_memory_parts's names: weights (the fp32 shard, FSDP2's master
    copy), gradients (the fp32 gradient shard; with accumulation also the whole unsharded gradients it keeps
    between micro-batches without reducing them: engine/fsdp2.py), optimizer_states (AdamW's two moments),
    zero3_gathered (the unsharded weights in the compute dtype) and optimizer_step_temporaries (unfused AdamW's)."""
    compute = 2 if precision in ("bf16", "fp16") else 4
    shard = n_params / world_size
    unsharded = n_params if not reshard else min(n_params, outside_params + 2 * block_params)
    return {k: int(v) for k, v in {
        "weights": 4 * shard, "gradients": 4 * shard + (4 * n_params if grad_accum_steps > 1 else 0),
        "optimizer_states": 8 * shard, "zero3_gathered": compute * unsharded, "zero3_secondary": 0,
        "optimizer_step_temporaries": 0 if fused_adamw else 4 * shard}.items()}


def fsdp2_memory_bytes(n_params: int, outside_params: int, block_params: int, world_size: int, precision: str,
                       reshard: bool, fused_adamw: bool, grad_accum_steps: int = 1) -> dict:
    """zero_memory_bytes's figures for plain FSDP2 (`fully_shard` per block and on the root, torch AdamW), so
    that `auto` budgets FSDP2's activations as it does ZeRO's.

    - `backward`: the fp32 weight shard (the master copy itself) and AdamW's two moments; the unsharded weights
      in the compute dtype: the whole model without resharding, else the root's parameters (those outside the
      blocks, `outside_params`, gathered from the forward to the backward) and two blocks' (the one computing
      and the one prefetched, `block_params`: the largest block's).
    - `optimizer_step`: besides them, the fp32 gradient shard and, for torch's unfused (foreach) update, one
      shard-sized temporary; the fused update has none.
    """
    p = fsdp2_memory_parts(n_params, outside_params, block_params, world_size, precision, reshard, fused_adamw,
                           grad_accum_steps)
    accumulated = p["gradients"] - 4 * n_params / world_size  # the unsharded gradients kept between micro-batches
    backward = p["weights"] + p["optimizer_states"] + p["zero3_gathered"] + accumulated
    step = p["weights"] + p["optimizer_states"] + p["gradients"] - accumulated + p["optimizer_step_temporaries"]
    return {"backward": int(backward), "optimizer_step": int(max(step, backward)), "zero3_gathered": p["zero3_gathered"]}


def zero_memory_parts(n_params: int, zero_stage: int, world_size: int, precision: str, ds_config: dict) -> dict:
    """zero_memory_bytes's terms, per rank: weights (whole, or ZeRO-3's partition), gradients (ZeRO-2/3's
    partition, ZeRO-1's whole gradients between micro-batches), optimizer_states (fp32 master and AdamW's
    moments), zero3_gathered (prefetch bucket and live gathered weights) and optimizer_step_temporaries (the
    fp32 gradient partition, unfused AdamW's two temporaries and ZeRO-1's reduced gradient partition); with ZeRO++'s hpZ,
    zero3_secondary (the weights' secondary partition over the ranks of a node, which the backward gathers from).
    What ZeRO-Offload moves to host memory (`offload_optimizer`: the states, the fp32 gradient partition and the
    step; `offload_param` under ZeRO-3: the weights' partition) is not on the device: `offloaded_bytes` counts it."""
    weight = grad = 2 if precision in ("bf16", "fp16") else 4
    n, part = n_params, n_params / world_size
    zero = ds_config.get("zero_optimization", {})
    optimizer_off, param_off = offloaded(zero_stage, ds_config)
    parts = {"weights": weight * (part if zero_stage == 3 else n), "gradients": 0, "optimizer_states": 12 * part,
             "zero3_gathered": 0, "zero3_secondary": 0}
    hpz = zero.get("zero_hpz_partition_size", 1)
    if zero_stage == 3 and isinstance(hpz, int) and hpz > 1:  # ZeRO++'s hpZ: a secondary partition per node
        parts["zero3_secondary"] = weight * n / hpz
    if zero_stage == 3:
        live = min(zero.get("stage3_max_live_parameters", n), n)
        if zero.get("stage3_max_reuse_distance", 0) >= n:
            live = n
        parts["zero3_gathered"] = weight * (min(zero.get("stage3_prefetch_bucket_size", 0), n) + live)
    if zero_stage in (2, 3):
        parts["gradients"] = grad * part
    elif ds_config.get("gradient_accumulation_steps", 1) > 1:  # ZeRO-1 keeps gradients between micro-batches
        parts["gradients"] = grad * n
    fused = ds_config.get("optimizer", {}).get("params", {}).get("fused", False)
    # ZeRO-3 flattens and steps one sub-group of its partition at a time (DeepSpeed's default: 1e9 elements)
    stepped = min(part, zero.get("sub_group_size", 1e9)) if zero_stage == 3 else part
    parts["optimizer_step_temporaries"] = 4 * ((part if zero_stage == 1 else 0) + stepped * (1 if fused else 3))
    if optimizer_off:
        parts["optimizer_states"] = parts["optimizer_step_temporaries"] = 0
        if zero_stage in (2, 3):
            parts["gradients"] = 0
    if param_off:
        parts["weights"] = 0
    return {k: int(v) for k, v in parts.items()}


def offloaded(zero_stage: int, ds_config: dict) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) by the DeepSpeed config; parameters only under ZeRO-3."""
    zero = ds_config.get("zero_optimization", {})
    device = lambda what: zero.get(what, {}).get("device", "none") not in ("none", None)
    return device("offload_optimizer"), zero_stage == 3 and device("offload_param")


def offloaded_bytes(n_params: int, zero_stage: int, world_size: int, precision: str, ds_config: dict) -> int:
    """Per-rank bytes ZeRO-Offload keeps in host memory: the fp32 master partition and AdamW's moments, the fp32
    gradient partition the CPU step reads, and (parameter offload) the weights' partition."""
    optimizer_off, param_off = offloaded(zero_stage, ds_config)
    part = n_params / world_size
    weight = 2 if precision in ("bf16", "fp16") else 4
    return int((16 * part if optimizer_off else 0) + (weight * part if param_off else 0))


def comm_bytes(n_params: int, zero_stage: int, grad_accum: int, world_size: int, ranks_per_node: int,
               weight_bytes: int, zero: dict) -> tuple[float, float]:
    """(bytes within a node, bytes between nodes) each rank sends per optimizer step, ring collectives moving
    (N-1)/N of each tensor (Rajbhandari et al. 2020). ZeRO-1 reduces the gradients once and all-gathers the
    updated weights; ZeRO-2 reduces after every micro-batch (it keeps only its gradient partition). DeepSpeed
    reduces by all-reducing each bucket and keeping its partition (`use_multi_rank_bucket_allreduce`, on by
    default), twice a reduce-scatter's bytes, and otherwise by reducing each partition to its owner. ZeRO-3
    reduce-scatters the gradients after every micro-batch and all-gathers the weights in its forward and again
    in its backward. Gradients travel in the weights' precision. ZeRO++ (Wang et al. 2023): qwZ gathers int8
    weights (1 byte), hpZ gathers the backward's weights from a secondary partition within the node, qgZ
    reduces int4 gradients (0.5 byte)."""
    share = (world_size - 1) / world_size if world_size > 1 else 0.0
    multi_node = world_size > ranks_per_node
    if zero_stage in (1, 2):
        per_reduction = 2 if zero.get("use_multi_rank_bucket_allreduce", True) else 1
        reductions = 1 if zero_stage == 1 else grad_accum
        total = (reductions * per_reduction + 1) * n_params * weight_bytes * share
        return (0.0, total) if multi_node else (total, 0.0)
    hpz = zero.get("zero_hpz_partition_size", 1)
    hpz = hpz if isinstance(hpz, int) and hpz > 1 else 1
    forward = n_params * (1 if zero.get("zero_quantized_weights") else weight_bytes) * share
    grads = n_params * (0.5 if zero.get("zero_quantized_gradients") else weight_bytes) * share
    backward = n_params * weight_bytes * ((hpz - 1) / hpz if hpz > 1 else share)
    intra = inter = 0.0
    for volume, local in ((forward, False), (backward, hpz > 1), (grads, False)):
        if local or not multi_node:
            intra += volume * grad_accum
        else:
            inter += volume * grad_accum
    return intra, inter


def fsdp2_comm_bytes(n_params: int, reshard: bool, grad_accum: int, world_size: int, ranks_per_node: int,
                     weight_bytes: int, replicate: int = 1) -> tuple[float, float]:
    """comm_bytes for the FSDP2 engine (engine/fsdp2.py): each micro-batch all-gathers every weight in the compute
    dtype for its forward and, resharding, again for its backward; the gradients are reduce-scattered once a step
    in fp32 (micro-batches before the last accumulate without a reduction); ring collectives, (N-1)/N of each
    tensor. One mesh over every rank: across nodes every collective crosses them. HSDP (`replicate` > 1): the
    gathers and the reduce-scatter run within a shard group of world/replicate ranks, and each rank's fp32
    gradient shard is all-reduced across the replicas (2(R-1)/R of it), between nodes when a shard group is no
    larger than a node."""
    shards = world_size // replicate
    share = (shards - 1) / shards if shards > 1 else 0.0
    total = ((2 if reshard else 1) * grad_accum * weight_bytes + 4) * n_params * share
    across = 2 * (replicate - 1) / replicate * 4 * n_params / shards if replicate > 1 else 0.0
    if shards > ranks_per_node:
        return 0.0, total + across
    return (total, across) if world_size > ranks_per_node else (total + across, 0.0)
