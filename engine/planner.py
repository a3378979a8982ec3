"""The run planner: per-rank memory and step time of a configuration on a cluster, and the search for the fastest
configuration that fits, from a profile of the model on the meta device (no weight is allocated, so a 22B model
plans on a laptop). The accounting is the one `ac: auto` plans with (engine/memory.py, models/checkpointing.py);
docs/planner.md says what is counted, what is assumed and how close it is to what was measured."""
from dataclasses import dataclass, replace

import torch

from config import Config, ConfigError
from engine import compat
from engine.ds_config import DTYPES
from engine.memory import offloaded, offloaded_bytes, zero_memory_bytes, zero_memory_parts
from models.blocks import Block, find_blocks
from models.checkpointing import PROFILE_BATCH, choose_plan, plan_figures, profile_blocks
from models.registry import add_drop_path, model_config

GiB = 2**30
ZEROPP_TEMPLATE = "ds_configs/zero3pp.json"


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # dense bf16 FLOP/s (fp32 for the CPU entry)
    memory_gib: float  # what the device reports as total memory
    intra_gbs: float  # GB/s per direction per device between devices of one node
    inter_gbs: float  # GB/s per direction per device between nodes (its share of the network)
    op_overhead_s: float = 10e-6  # host time to launch one operator (eager PyTorch): a floor on small micro-batches
    host_gbs: float = 25.0  # GB/s per direction between the device and host memory (ZeRO-Offload's traffic)
    host_memory_gib: float = 1024.0  # host memory of a node, for what ZeRO-Offload keeps there
    mem_gbs: float = 2000.0  # GB/s of the device's memory: what memory-bound operators are limited by


# Vendors' data sheets: dense bf16 tensor-core FLOP/s (SXM parts), memory as nvidia-smi reports it, NVLink
# bandwidth per direction, and one 200 Gb/s (A100 systems) or 400 Gb/s (H100 and later) NIC per GPU.
# Host side: PCIe 4.0 x16 (A100) or 5.0 x16 (H100 and later) at about 80% of its per-direction rate, and the host
# memory of the vendor's 8-GPU system (DGX A100 40/80 GB: 1/2 TB; DGX H100, H200: 2 TB; DGX B200: 4 TB).
# Memory bandwidth: HBM2 (A100 40 GB: 1.56 TB/s), HBM2e (A100 80 GB: 2.04), HBM3 (H100: 3.35), HBM3e (H200: 4.8,
# B200: 8).
DEVICES = {d.name: d for d in (
    Device("a100-40gb", 312e12, 40.0, 300, 25, host_gbs=25, host_memory_gib=1024, mem_gbs=1555),
    Device("a100-80gb", 312e12, 80.0, 300, 25, host_gbs=25, host_memory_gib=2048, mem_gbs=2039),
    Device("h100-80gb", 989e12, 79.6, 450, 50, host_gbs=50, host_memory_gib=2048, mem_gbs=3350),
    Device("h200", 989e12, 140.4, 450, 50, host_gbs=50, host_memory_gib=2048, mem_gbs=4800),
    Device("b200", 2250e12, 179.1, 900, 50, host_gbs=50, host_memory_gib=4096, mem_gbs=8000),
)}
RESERVED_GIB = 2.0  # per device, outside the allocator: the CUDA context, NCCL's buffers, the allocator's slack
ALLOCATOR_MARGIN = 0.05  # of the rest, left for fragmentation
DEFAULT_MFU = 0.4  # fraction of the device's peak the model's matmuls reach (the ViT-22B paper reports 0.55)
DEFAULT_MBU = 0.7  # fraction of the memory bandwidth the memory-bound operators reach on a GPU (an assumption)
# Bytes the optimizer step reads and writes per parameter of the rank's partition, fp32: torch's AdamW over the
# flat partition reads and writes 20 values per parameter (weight decay 2, first moment 3, second moment 5, its
# square root, division and epsilon 6, the update 4); ZeRO adds the gradient norm for clipping (1), flattening
# the gradients (2) and copying the updated weights back (2).
OPTIMIZER_BYTES_PER_PARAM = 25 * 4
# ZeRO-Offload's optimizer step on the host: parameters updated per second by one node's CPU Adam, all its ranks
# together. An assumption for a two-socket server (docs/planner.md gives what one core measured here).
HOST_ADAM_PARAMS_PER_S = 2e9
OFFLOAD_TEMPLATE = "ds_configs/zero3_offload.json"


def meta_model(cfg: Config):
    """The model of a run on the meta device: shapes only, nothing allocated, nothing initialised."""
    from transformers import AutoModelForImageClassification

    config = model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size, drop_path=cfg.drop_path)
    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(config)
    add_drop_path(model, cfg.drop_path)  # its masks are saved tensors, which decide where a recompute stops
    return model


def profile(cfg: Config, device_type: str, dtype: torch.dtype = torch.float32):
    """(block profile at the run's micro-batch, parameters, largest block's parameters) from a forward of
    PROFILE_BATCH images on the meta device, in `dtype` (DeepSpeed's bf16 and fp16 run the whole model in it).
    Attention runs as the fused kernel torch's SDPA picks on `device_type` (flash attention), whose saved
    tensors differ from the math fallback meta would take."""
    model = meta_model(cfg).to(dtype)
    images = torch.empty(PROFILE_BATCH, 3, cfg.image_size, cfg.image_size, device="meta", dtype=dtype)
    with compat.sdpa_as_on(device_type):
        prof = profile_blocks(model, images)
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in b.module.parameters()) for b in find_blocks(model))
    return prof.scaled(cfg.micro_batch_size / PROFILE_BATCH), n_params, largest


CALIBRATION_KEYS = ("model", "image_size", "patch_size", "micro_batch_size", "precision")
CALIBRATION_RATES = ("flops_per_s", "bytes_per_s", "stream_gbs", "comm_gbs")  # the rates a plan takes from it


def calibrate(cfg: Config, precision: str, device: torch.device, progress=None) -> dict:
    """What this rank measures for a plan of `cfg` (engine/replay.py): the FLOP rate and bandwidth the model's own
    operators reach at its micro-batch, forward and backward; a streaming add's bandwidth (the optimizer's); and,
    in a process group, the all-gather bandwidth between its ranks. Under torchrun every rank measures at once,
    sharing the node as a run's ranks do."""
    from engine.replay import collective_gbs, record, replay, stream_gbs

    dtype = DTYPES[precision]
    model = meta_model(cfg).to(dtype)
    images = torch.empty(cfg.micro_batch_size, 3, cfg.image_size, cfg.image_size, device="meta", dtype=dtype)
    with compat.sdpa_as_on(device.type):
        counts = record(model, images)
    ops = replay(counts, device, progress=progress)
    return {**{k: getattr(cfg, k) for k in CALIBRATION_KEYS}, "precision": precision, "device": device.type,
            "threads": torch.get_num_threads(), "flops_per_s": ops.flops_per_s, "bytes_per_s": ops.bytes_per_s,
            "stream_gbs": stream_gbs(device), "comm_gbs": collective_gbs(device), "distinct_ops": ops.distinct_ops,
            "replay_seconds": {"compute_forward": ops.compute_forward_s, "compute_backward": ops.compute_backward_s,
                               "memory_forward": ops.memory_forward_s, "memory_backward": ops.memory_backward_s},
            "failed_ops": list(ops.failed)}


def slowest(per_rank: list) -> dict:
    """One calibration from every rank's (a step waits for the slowest rank at every collective): the replay of
    the rank that took longest, the lowest streaming and all-gather bandwidths, and each rank's figures."""
    slow = max(per_rank, key=lambda r: sum(r["replay_seconds"].values()))
    return {**slow, **{k: min(r[k] for r in per_rank) for k in ("stream_gbs", "comm_gbs")}, "ranks": len(per_rank),
            "per_rank": [{k: r[k] for k in (*CALIBRATION_RATES, "replay_seconds")} for r in per_rank]}


def median_calibration(samples: list) -> dict:
    """One calibration from several of the same shape, measured at different times (a suite's repeats): the
    sample whose replay took the median time, whole (its rates belong together), with every sample's rates."""
    ranked = sorted(samples, key=lambda c: sum(c["replay_seconds"].values()))
    return {**ranked[(len(ranked) - 1) // 2], "samples": [{k: c[k] for k in CALIBRATION_RATES} for c in samples]}


def calibrated(device: Device, calibration: dict) -> tuple[Device, dict]:
    """(the device with the calibration's measured bandwidths, the model's operator rates for estimate())."""
    device = replace(device, mem_gbs=calibration["stream_gbs"],
                     intra_gbs=calibration["comm_gbs"] or device.intra_gbs)
    return device, {k: calibration[k] for k in ("flops_per_s", "bytes_per_s")}


def _target(device: "Device") -> str:
    """The device type whose kernels a plan for `device` profiles with."""
    return "cpu" if device.name == "cpu" else "cuda"


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


def estimate(cfg: Config, ds_config: dict, precision: str, world_size: int, ranks_per_node: int, device: Device,
             mfu: float = DEFAULT_MFU, overlap: float = 0.0, measured=None, mbu: float = DEFAULT_MBU,
             rates=None) -> dict:
    """Per-rank peak memory by part and step time of one configuration. `measured`: a profile() result to reuse.

    The step's compute is its matmuls' FLOPs at `mfu` of the device's peak, plus what its memory-bound
    operators (norms, activations, softmax, adds, copies, the optimizer) read and write at `mbu` of its memory
    bandwidth: the forward's traffic as profiled, twice that for the backward (each such operator's backward
    reads the output gradient and its saved inputs and writes the input gradient), the recomputed blocks'
    cheap operators again, and the optimizer step over the rank's partition. `rates`: {"flops_per_s",
    "bytes_per_s"} that this model's operators reached at this micro-batch (calibrate()), in place of `mfu` of the
    device's peak and `mbu` of its bandwidth (the optimizer's stream stays at `mbu` of the device's bandwidth)."""
    prof, n_params, largest = measured or profile(cfg, _target(device), DTYPES[precision])
    fwd_flops, n_ops = prof.forward_flops / cfg.micro_batch_size, prof.ops
    parts = zero_memory_parts(n_params, cfg.zero_stage, world_size, precision, ds_config)
    fixed = zero_memory_bytes(n_params, cfg.zero_stage, world_size, precision, ds_config)
    plan = choose_plan(cfg.ac, _blocks_of(prof), prof, fixed)
    figures = plan_figures(prof, plan, fixed)
    activations = figures["activation_peak_planned"]
    peak = figures["peak_bytes_planned"]
    weight_bytes = 2 if precision in ("bf16", "fp16") else 4
    images = cfg.micro_batch_size * cfg.grad_accum_steps
    recompute = figures["recompute_matmul_flops"] / cfg.micro_batch_size  # per image
    flops = images * (3 * fwd_flops + recompute)
    # memory traffic of a micro-batch: forward, backward, and the recomputed cheap ops (read twice, written once)
    rerun = sum(p.cheap_elems for p, how in zip(prof, plan) if how in ("full", "selective"))
    moved = 3 * prof.moved_bytes + 3 * rerun * weight_bytes
    optimizer_moved = OPTIMIZER_BYTES_PER_PARAM * n_params / world_size if not offloaded(cfg.zero_stage, ds_config)[0] \
        else 0
    bandwidth = device.mem_gbs * 1e9 * mbu
    flop_rate, model_bandwidth = (rates["flops_per_s"], rates["bytes_per_s"]) if rates else (device.flops * mfu,
                                                                                           bandwidth)
    memory_s = moved * cfg.grad_accum_steps / model_bandwidth + optimizer_moved / bandwidth
    # a micro-batch takes its FLOPs' and its memory traffic's time, or, if longer, the host's time to launch its
    # operators (the backward about twice the forward's), which the device cannot outrun
    micro_s = max(flops / cfg.grad_accum_steps / flop_rate + moved / model_bandwidth,
                  3 * n_ops * device.op_overhead_s)
    compute_s = micro_s * cfg.grad_accum_steps + optimizer_moved / bandwidth
    zero = ds_config.get("zero_optimization", {})
    intra, inter = comm_bytes(n_params, cfg.zero_stage, cfg.grad_accum_steps, world_size, ranks_per_node,
                              weight_bytes, zero)
    sent = intra + inter
    comm_s = intra / (device.intra_gbs * 1e9) + inter / (device.inter_gbs * 1e9)
    zeropp = cfg.zero_stage == 3 and bool(zero.get("zero_quantized_weights") or zero.get("zero_quantized_gradients")
                                          or zero.get("zero_hpz_partition_size", 1) > 1)
    # ZeRO-Offload: the gradient partition goes to the host and the updated weights come back every step, the
    # host's CPU Adam updates the node's partitions, and offloaded weights cross PCIe for every gather (forward
    # and backward of each micro-batch); none of it overlapped
    optimizer_off, param_off = offloaded(cfg.zero_stage, ds_config)
    part = n_params / world_size
    host_bytes = (2 * weight_bytes * part if optimizer_off else 0) + (
        2 * weight_bytes * part * cfg.grad_accum_steps if param_off else 0)
    node_ranks = min(ranks_per_node, world_size)
    host_adam_s = part * node_ranks / HOST_ADAM_PARAMS_PER_S if optimizer_off else 0.0
    offload_s = host_bytes / (device.host_gbs * 1e9) + host_adam_s
    step_s = compute_s + (1 - overlap) * comm_s + offload_s
    capacity = (device.memory_gib - RESERVED_GIB) * (1 - ALLOCATOR_MARGIN) * GiB
    host = offloaded_bytes(n_params, cfg.zero_stage, world_size, precision, ds_config)
    host_fits = host * node_ranks <= device.host_memory_gib * GiB * (1 - ALLOCATOR_MARGIN)
    return {
        "model": cfg.model, "params": n_params, "largest_block_params": largest, "image_size": cfg.image_size,
        "precision": precision, "zero_stage": cfg.zero_stage, "micro_batch_size": cfg.micro_batch_size,
        "grad_accum_steps": cfg.grad_accum_steps, "ac": cfg.ac, "plan": {h: plan.count(h) for h in set(plan)},
        "world_size": world_size, "ranks_per_node": ranks_per_node, "device": device.name,
        "global_batch": images * world_size,
        "memory": {**{k: v for k, v in parts.items() if k != "optimizer_step_temporaries"},
                   "activations": activations, "optimizer_step_temporaries": parts["optimizer_step_temporaries"]},
        "peak_bytes": peak, "peak_moment": "backward" if peak > fixed["optimizer_step"] else "optimizer_step",
        "capacity_bytes": int(capacity), "fits": peak <= capacity and host_fits,
        "offload": {"optimizer": optimizer_off, "params": param_off, "host_bytes_per_rank": host,
                    "host_bytes_per_node": host * node_ranks, "pcie_bytes_per_step_per_rank": host_bytes,
                    "host_adam_s": host_adam_s, "offload_s": offload_s},
        "flops_per_step_per_rank": flops, "forward_flops_per_image": fwd_flops,
        "recompute_fraction": figures["recompute_flops_fraction"],
        "comm_bytes_per_step_per_rank": sent, "comm_bytes_between_nodes": inter, "zeropp": bool(zeropp),
        "ds_config_template": cfg.ds_config, "compute_s": compute_s, "memory_bound_s": memory_s, "comm_s": comm_s,
        "step_s": step_s, "memory_bytes_per_step_per_rank": moved * cfg.grad_accum_steps + optimizer_moved,
        "images_per_s": images * world_size / step_s,
        "calibrated": rates,
        "assumptions": {"mfu": mfu, "mbu": mbu, "mem_gbs": device.mem_gbs, "overlap": overlap, "intra_gbs": device.intra_gbs, "inter_gbs": device.inter_gbs,
                        "reserved_gib": RESERVED_GIB, "allocator_margin": ALLOCATOR_MARGIN,
                        "op_overhead_s": device.op_overhead_s, "ops_per_forward": n_ops,
                        "host_gbs": device.host_gbs, "host_adam_params_per_s": HOST_ADAM_PARAMS_PER_S},
    }


def _blocks_of(prof):
    """Stand-ins for the model's blocks where only their profile is known (what choose_plan reads)."""
    return [Block(name=p.name, module=None, index=i, stage=p.stage) for i, p in enumerate(prof)]


def search(cfg: Config, ds_config_for, precision: str, world_size: int, ranks_per_node: int, device: Device,
           global_batch: int, mfu: float = DEFAULT_MFU, overlap: float = 0.0, policies=None,
           mbu: float = DEFAULT_MBU, rates=None) -> list:
    """Every (ZeRO stage, micro-batch, accumulation, ac policy) whose global batch is `global_batch` and whose
    peak fits, fastest first. `ds_config_for(cfg)`: the DeepSpeed config of a candidate. `rates`: a calibration
    of cfg's micro-batch (estimate()), which then is the only micro-batch searched."""
    if global_batch % world_size:
        raise ConfigError(f"global batch {global_batch} is not a multiple of the world size {world_size}")
    per_rank = global_batch // world_size
    micro_batches = [m for m in (2**i for i in range(0, 13)) if per_rank % m == 0] or [1]
    if rates:
        if per_rank % cfg.micro_batch_size:
            raise ConfigError(f"the calibrated micro-batch {cfg.micro_batch_size} does not divide the "
                              f"{per_rank} images per rank of global batch {global_batch}")
        micro_batches = [cfg.micro_batch_size]
    policies = policies or ("none", "selective", "full")
    base = profile(replace(cfg, micro_batch_size=PROFILE_BATCH), _target(device), DTYPES[precision])
    found = []
    # ZeRO-3 also with ZeRO++ (ds_configs/zero3pp.json: hpZ over a node, quantized weights and gradients) when
    # the job spans nodes: within one node hpZ's secondary partition would be the primary one
    # and ZeRO-3 with the optimizer and the weights offloaded to host memory (ds_configs/zero3_offload.json)
    variants = [(1, ""), (2, ""), (3, ""), (3, OFFLOAD_TEMPLATE)] + (
        [(3, ZEROPP_TEMPLATE)] if world_size > ranks_per_node else [])
    for stage, template in variants:
        for micro in micro_batches:
            scaled = (base[0].scaled(micro / PROFILE_BATCH), *base[1:])
            for ac in policies:
                candidate = replace(cfg, zero_stage=stage, micro_batch_size=micro,
                                    grad_accum_steps=per_rank // micro, ac=ac, ds_config=template)
                est = estimate(candidate, ds_config_for(candidate), precision, world_size, ranks_per_node, device,
                               mfu, overlap, scaled, mbu, rates)
                if est["fits"]:
                    found.append(est)
    # equal times (compute-bound either way): fewer accumulation steps, then the lower peak
    return sorted(found, key=lambda e: (round(e["step_s"], 6), e["grad_accum_steps"], e["peak_bytes"]))


def smallest_cluster(cfg: Config, ds_config_for, precision: str, ranks_per_node: int, device: Device,
                     limit: int = 2**20):
    """(the fewest ranks, a power of two, on which ZeRO-3 with full recompute at micro-batch 1 fits, with the
    optimizer and weights offloaded if that is what fits first; whether it is) or (None, False)."""
    base = profile(replace(cfg, micro_batch_size=1), _target(device), DTYPES[precision])
    world = 1
    while world <= limit:
        for template in ("", OFFLOAD_TEMPLATE):
            candidate = replace(cfg, zero_stage=3, micro_batch_size=1, grad_accum_steps=1, ac="full",
                                ds_config=template)
            if estimate(candidate, ds_config_for(candidate), precision, world, ranks_per_node, device,
                        measured=base)["fits"]:
                return world, bool(template)
        world *= 2
    return None, False
