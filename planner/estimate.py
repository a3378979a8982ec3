"""Per-rank peak memory by part and the step time of one configuration on a cluster."""
import math
from dataclasses import replace

from ac.budget import plan_figures, recompute_elems
from ac.policies import choose_plan
from ac.profile import profile_model
from config import Config
from engine.base import Sizes
from engine.ds_config import DTYPES
from engine.memory import offloaded, offloaded_bytes
from engine.registry import engine_class
from models.blocks import Block
from parallel import pipeline, sequence
from planner.devices import ALLOCATOR_MARGIN, DEFAULT_MBU, DEFAULT_MFU, RESERVED_GIB, Device, target
from planner.host import host_seconds, probed_engine


GiB = 2**30
# Bytes the optimizer step reads and writes per parameter of the rank's partition, fp32: torch's AdamW over the
# flat partition reads and writes 20 values per parameter (weight decay 2, first moment 3, second moment 5, its
# square root, division and epsilon 6, the update 4); ZeRO adds the gradient norm for clipping (1), flattening
# the gradients (2) and copying the updated weights back (2).
OPTIMIZER_BYTES_PER_PARAM = 25 * 4
# ZeRO-Offload's optimizer step on the host: parameters updated per second by one node's CPU Adam, all its ranks
# together. An assumption for a two-socket server (docs/planner.md gives what one core measured here).
HOST_ADAM_PARAMS_PER_S = 2e9


def tp_allreduce_bytes(prof, plan, tp_size: int) -> float:
    """Bytes a rank sends per micro-batch in its tensor group's all-reduces (Megatron's count, Shoeybi et al.
    2019): each block's output, the size of its input, is all-reduced twice in the forward (after the attention
    output and after the MLP) and twice in the backward (the gradients of the inputs of the column-split
    layers), twice more in a block recomputed whole; a ring all-reduce sends 2(N-1)/N of the tensor."""
    if tp_size == 1:
        return 0.0
    passes = sum((4 + 2 * (how == "full")) * p.bytes_full for p, how in zip(prof, plan))
    return passes * 2 * (tp_size - 1) / tp_size


def sp_alltoall_bytes(prof, plan, sp_size: int, split: set | None = None) -> float:
    """Bytes a rank sends per micro-batch in its sequence group's all-to-alls (parallel/sequence.py): four per
    split block (`split`: block names, default all; Q, K, V and the attention's output), each of the rank's share
    of the block's input, in the forward, four more in the backward and four more in a block recomputed whole; an
    all-to-all sends (N-1)/N of it."""
    if sp_size == 1:
        return 0.0
    passes = sum(4 * (2 + (how == "full")) * p.bytes_full for p, how in zip(prof, plan)
                 if split is None or p.name in split)
    return passes * (sp_size - 1) / sp_size


def _blocks_of(prof):
    """Stand-ins for the model's blocks where only their profile is known (what choose_plan reads)."""
    return [Block(name=p.name, module=None, index=i, stage=p.stage) for i, p in enumerate(prof)]


def estimate(cfg: Config, ds_config: dict, precision: str, world_size: int, ranks_per_node: int, device: Device,
             mfu: float = DEFAULT_MFU, overlap: float = 0.0, measured=None, mbu: float = DEFAULT_MBU,
             rates=None, held: float = 1.0) -> dict:
    """Per-rank peak memory by part and step time of one configuration. `measured`: a profile_model() result to reuse.
    `held`: the share of the micro-batch whose activations are held at once (a pipeline stage's pieces in flight,
    pipeline_estimate); the plan and the peak are computed on it, the time on the whole micro-batch.

    The step's compute is its matmuls' FLOPs at `mfu` of the device's peak, plus what its memory-bound
    operators (norms, activations, softmax, adds, copies, the optimizer) read and write at `mbu` of its memory
    bandwidth: the forward's traffic as profiled, twice that for the backward (each such operator's backward
    reads the output gradient and its saved inputs and writes the input gradient), the recomputed blocks'
    cheap operators again, and the optimizer step over the rank's partition. `rates`: {"flops_per_s",
    "bytes_per_s"} that this model's operators reached at this micro-batch (calibrate()), in place of `mfu` of the
    device's peak and `mbu` of its bandwidth (the optimizer's stream stays at `mbu` of the device's bandwidth),
    and "host", the engine's host seconds probed by the calibration (planner/host.py): charged per micro-batch
    after the operators on a CPU, beside them (the longer of the two) on a GPU. Without it the host is a launch
    cost per operator, `device.op_overhead_s`.

    Under tensor parallelism (`cfg.tp_size`) the profile is one rank's share of the model (ac/profile.py), ZeRO
    partitions that share over the world_size / tp_size data-parallel ranks, and the tensor group's all-reduces
    (tp_allreduce_bytes) run over the node's links between the operators that need them: not overlapped. Under
    sequence parallelism (`cfg.sp_size`) the blocks' profile is a rank's share of the tokens
    (Profile.sequence_share), ZeRO still partitions over every rank, the sp_size ranks of a group read one
    micro-batch, and the all-to-alls (sp_alltoall_bytes) run over the node's links, not overlapped."""
    if cfg.pp_size > 1:
        return pipeline_estimate(cfg, ds_config, precision, world_size, ranks_per_node, device, mfu, overlap,
                                 measured, mbu, rates)
    prof, n_params, largest = measured or profile_model(cfg, target(device), DTYPES[precision])
    sp = cfg.sp_size
    split = sequence.split_blocks(p.name for p in prof)  # MAE's decoder runs whole on every rank
    prof = prof.sequence_share(sp, split)  # a rank's share of the split blocks' tokens
    fwd_flops, n_ops = prof.forward_flops / cfg.micro_batch_size, prof.ops
    tp = cfg.tp_size
    data_ranks = world_size // tp  # ZeRO's partitions and the data-parallel collectives: over these
    batch_ranks = data_ranks // sp  # the ranks that read different micro-batches (a sequence group reads one)
    engine = engine_class(cfg.engine)
    # the stem, the final norm and the head: the parameters outside the blocks
    sizes = Sizes(n_params, n_params - sum(p.params for p in prof), largest)
    parts, fixed = engine.memory(cfg, sizes, data_ranks, precision, ds_config, target(device) != "cpu")
    prof_held = prof.scaled(held) if held != 1 else prof  # what the peak holds
    plan = choose_plan(cfg.ac, _blocks_of(prof), prof_held, fixed)
    figures = plan_figures(prof_held, plan, fixed)
    activations = figures["activation_peak_planned"]
    peak = figures["peak_bytes_planned"]
    weight_bytes = 2 if precision in ("bf16", "fp16") else 4
    images = cfg.micro_batch_size * cfg.grad_accum_steps
    recompute = (figures if held == 1 else plan_figures(prof, plan, fixed))["recompute_matmul_flops"] \
        / cfg.micro_batch_size  # per image
    flops = images * (3 * fwd_flops + recompute)
    # memory traffic of a micro-batch: forward, backward, and the recomputed cheap ops (read twice, written once)
    rerun = sum(recompute_elems(p, how) for p, how in zip(prof, plan))
    moved = 3 * prof.moved_bytes + 3 * rerun * weight_bytes
    holders = engine.optimizer_holders(cfg, data_ranks)  # ranks sharing AdamW's states
    optimizer_moved = OPTIMIZER_BYTES_PER_PARAM * n_params / holders if not offloaded(cfg.zero_stage, ds_config)[0] \
        else 0
    bandwidth = device.mem_gbs * 1e9 * mbu
    flop_rate, model_bandwidth = (rates["flops_per_s"], rates["bytes_per_s"]) if rates else (device.flops * mfu,
                                                                                           bandwidth)
    memory_s = moved * cfg.grad_accum_steps / model_bandwidth + optimizer_moved / bandwidth
    device_micro_s = flops / cfg.grad_accum_steps / flop_rate + moved / model_bandwidth
    optimizer_s = optimizer_moved / bandwidth
    probed = (rates or {}).get("host")
    if probed and (str(cfg.zero_stage) not in probed["stages"] or probed_engine(probed) != cfg.engine):
        probed = None  # probed under other ZeRO stages only, or another engine's host time
    if probed:  # the engine's host seconds, measured (planner/host.py)
        serial = target(device) == "cpu"
        host = host_seconds(probed, cfg.zero_stage, plan, serial)
        host_micro_s = host["micro_s"]
        if serial:  # the CPU runs the host's work and the operators one after the other
            micro_s, optimizer_s = device_micro_s + host_micro_s, optimizer_s + host["step_s"]
        else:  # the device runs what the host queued while the host goes on: the slower of the two
            micro_s, optimizer_s = max(device_micro_s, host_micro_s), max(optimizer_s, host["step_s"])
    else:
        # the host's time to launch the operators (the backward about twice the forward's), which the device
        # cannot outrun
        host_micro_s = 3 * n_ops * device.op_overhead_s
        micro_s = max(device_micro_s, host_micro_s)
    # the micro-batch whose operators take as long as the host's share: below it the step is host-bound
    per_image_s = device_micro_s / cfg.micro_batch_size
    saturating = math.ceil(host_micro_s / per_image_s) if per_image_s > 0 and host_micro_s > 0 else 1
    compute_s = micro_s * cfg.grad_accum_steps + optimizer_s
    zero = ds_config.get("zero_optimization", {})
    intra, inter = engine.comm_bytes(cfg, n_params, data_ranks, ranks_per_node, weight_bytes, ds_config)
    sent = intra + inter
    comm_s = intra / (device.intra_gbs * 1e9) + inter / (device.inter_gbs * 1e9)
    tp_bytes = tp_allreduce_bytes(prof, plan, tp) * cfg.grad_accum_steps
    tp_s = tp_bytes / (device.intra_gbs * 1e9)
    sp_bytes = sp_alltoall_bytes(prof, plan, sp, split) * cfg.grad_accum_steps
    sp_s = sp_bytes / (device.intra_gbs * 1e9)  # a sequence group within a node, between the operators
    zeropp = cfg.zero_stage == 3 and bool(zero.get("zero_quantized_weights") or zero.get("zero_quantized_gradients")
                                          or zero.get("zero_hpz_partition_size", 1) > 1)
    # ZeRO-Offload: the gradient partition goes to the host and the updated weights come back every step, the
    # host's CPU Adam updates the node's partitions, and offloaded weights cross PCIe for every gather (forward
    # and backward of each micro-batch); none of it overlapped
    optimizer_off, param_off = offloaded(cfg.zero_stage, ds_config)
    part = n_params / data_ranks
    host_bytes = (2 * weight_bytes * part if optimizer_off else 0) + (
        2 * weight_bytes * part * cfg.grad_accum_steps if param_off else 0)
    node_ranks = min(ranks_per_node, world_size)
    host_adam_s = part * node_ranks / HOST_ADAM_PARAMS_PER_S if optimizer_off else 0.0
    offload_s = host_bytes / (device.host_gbs * 1e9) + host_adam_s
    step_s = compute_s + (1 - overlap) * comm_s + tp_s + sp_s + offload_s
    capacity = (device.memory_gib - RESERVED_GIB) * (1 - ALLOCATOR_MARGIN) * GiB
    host = offloaded_bytes(n_params, cfg.zero_stage, data_ranks, precision, ds_config)
    host_fits = host * node_ranks <= device.host_memory_gib * GiB * (1 - ALLOCATOR_MARGIN)
    return {
        "model": cfg.model, "params": n_params, "largest_block_params": largest, "image_size": cfg.image_size,
        "engine": cfg.engine, "precision": precision, "zero_stage": cfg.zero_stage,
        "replicate_degree": cfg.replicate_degree,
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum_steps": cfg.grad_accum_steps, "ac": cfg.ac, "plan": {h: plan.count(h) for h in set(plan)},
        "world_size": world_size, "ranks_per_node": ranks_per_node, "device": device.name, "tp_size": tp,
        "sp_size": sp, "pp_size": 1, "global_batch": images * batch_ranks,
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
        "numerics": engine.numerics(cfg, ds_config),
        "tp_comm_bytes_per_step_per_rank": tp_bytes, "tp_comm_s": tp_s,
        "sp_comm_bytes_per_step_per_rank": sp_bytes, "sp_comm_s": sp_s,
        "ds_config_template": cfg.ds_config, "compute_s": compute_s, "memory_bound_s": memory_s, "comm_s": comm_s,
        "step_s": step_s, "micro_s": micro_s, "optimizer_s": optimizer_s, "memory_bytes_per_step_per_rank": moved * cfg.grad_accum_steps + optimizer_moved,
        "images_per_s": images * batch_ranks / step_s,
        "calibrated": {k: v for k, v in rates.items() if k != "host"} if rates else None,
        "host": {"micro_s": host_micro_s, "device_micro_s": device_micro_s, "bound": host_micro_s > device_micro_s,
                 "saturating_micro_batch": saturating, "measured": bool(probed)},
        "assumptions": {"mfu": mfu, "mbu": mbu, "mem_gbs": device.mem_gbs, "overlap": overlap, "intra_gbs": device.intra_gbs, "inter_gbs": device.inter_gbs,
                        "reserved_gib": RESERVED_GIB, "allocator_margin": ALLOCATOR_MARGIN,
                        "op_overhead_s": device.op_overhead_s, "ops_per_forward": n_ops,
                        "host_gbs": device.host_gbs, "host_adam_params_per_s": HOST_ADAM_PARAMS_PER_S},
    }


def pipeline_estimate(cfg: Config, ds_config: dict, precision: str, world_size: int, ranks_per_node: int,
                      device: Device, mfu: float = DEFAULT_MFU, overlap: float = 0.0, measured=None,
                      mbu: float = DEFAULT_MBU, rates=None) -> dict:
    """estimate() of a pipeline (`cfg.pp_size` stages, parallel/pipeline.py): each stage estimated as a model of
    its own blocks on world_size / pp_size data-parallel ranks (ranks_per_node / pp_size of them on a node, since
    consecutive ranks form a pipeline), the stem's and the head's parameters, activations and work shared by the
    first and last stages, its peak with the activations of the pieces it holds at once (`in_flight`: 1F1B's
    first stage the most). The step: the slowest stage's micro-batch stretched by the bubble, (M + P - 1) / M,
    plus the activations and their gradients sent between stages (each boundary's tensor is a block's input,
    `bytes_full`; within a node when a pipeline fits in one, else between nodes; not overlapped), plus the
    slowest stage's optimizer step and data-parallel collectives. The peak is the largest stage's."""
    prof, n_params, largest = measured or profile_model(cfg, target(device), DTYPES[precision])
    stages = cfg.pp_size
    pieces = pipeline.microbatches(stages, cfg.pp_microbatches, cfg.micro_batch_size)
    names = [p.name for p in prof]
    outside = {"params": n_params - sum(p.params for p in prof),
               "forward_flops": prof.forward_flops - sum(p.flops for p in prof),
               "ops": prof.ops - sum(p.ops for p in prof), "moved_bytes": prof.moved_bytes - sum(p.moved for p in prof),
               "bytes_outside": prof.bytes_outside, "grad_outside": prof.grad_outside}
    per_stage, cuts = [], pipeline.stage_blocks(len(prof), stages, cfg.pp_split)
    # consecutive ranks form a pipeline: a stage's data-parallel ranks, one per pipeline, are this many a node
    stage_per_node = ranks_per_node // stages if ranks_per_node % stages == 0 else 1
    for s, blocks in enumerate(cuts):
        work = prof.stage_share(names[blocks.start:blocks.stop])
        share = ((s == 0) + (s == stages - 1)) / 2  # the stem on the first stage, the norm and head on the last
        work.forward_flops = sum(p.flops for p in work) + round(outside["forward_flops"] * share)
        work.ops = sum(p.ops for p in work) + round(outside["ops"] * share)
        work.moved_bytes = sum(p.moved for p in work) + round(outside["moved_bytes"] * share)
        work.bytes_outside = round(outside["bytes_outside"] * share)
        work.grad_outside = round(outside["grad_outside"] * share)
        params = sum(p.params for p in work) + round(outside["params"] * share)
        held = pipeline.in_flight(cfg.pp_schedule, s, stages, pieces) / pieces
        per_stage.append(estimate(replace(cfg, pp_size=1), ds_config, precision, world_size // stages,
                                  stage_per_node, device, mfu, overlap, (work, params, largest), mbu, rates, held))
    accum = cfg.grad_accum_steps
    stretched = max(e["micro_s"] for e in per_stage) * (pieces + stages - 1) / pieces
    within = stages <= ranks_per_node and ranks_per_node % stages == 0
    pp_bytes = 2 * prof[0].bytes_full * accum  # a middle stage's: the activations on, their gradients back
    pp_s = pp_bytes / ((device.intra_gbs if within else device.inter_gbs) * 1e9)
    rest = max(e["step_s"] - e["micro_s"] * accum for e in per_stage)  # optimizer, collectives, offload
    step_s = rest + stretched * accum + pp_s
    highest = max(per_stage, key=lambda e: e["peak_bytes"])  # the stage that sets the peak
    images = cfg.micro_batch_size * accum * world_size // (cfg.tp_size * cfg.sp_size * stages)
    return {**highest, "params": n_params, "world_size": world_size, "ranks_per_node": ranks_per_node,
            "pp_size": stages, "pp_split": cfg.pp_split,
            "pp_schedule": cfg.pp_schedule, "pp_microbatches": pieces,
            "bubble": pipeline.bubble(stages, pieces), "global_batch": images,
            "stages": [{"blocks": f"{r.start}-{r.stop - 1}", "peak_bytes": e["peak_bytes"], "micro_s": e["micro_s"],
                        "plan": e["plan"], "held": pipeline.in_flight(cfg.pp_schedule, s, stages, pieces)}
                       for s, (r, e) in enumerate(zip(cuts, per_stage))],
            "peak_bytes": highest["peak_bytes"], "fits": all(e["fits"] for e in per_stage),
            "plan": {h: sum(e["plan"].get(h, 0) for e in per_stage) for h in {h for e in per_stage for h in e["plan"]}},
            "pp_comm_bytes_per_step_per_rank": pp_bytes, "pp_comm_s": pp_s,
            "compute_s": stretched * accum + max(e["optimizer_s"] for e in per_stage),
            "step_s": step_s, "images_per_s": images / step_s}
