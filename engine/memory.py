"""Per-rank memory: what ZeRO holds beside the activations (the planner's accounting), and how much a step
allocated on CPU, where torch keeps no allocator statistics (the profiler's memory events)."""
import contextlib
import json
import os
import resource
import sys
import tempfile

import torch

# kineto logs a line at every profiler start and stop unless its log level is above them
KINETO_QUIET_LEVEL = "6"
# c10's CPU allocator warns (once per process) when a block allocated before the profiler started is freed
# under it; a profiled training step always frees such blocks, and the peak counts only what it allocates
ALLOCATOR_WARNING = "Memory block of unknown size was allocated before the profiling started"


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


def peak_memory_bytes() -> int:
    """GPU: the allocator's peak. CPU: the process's peak resident set (no allocator statistics there)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def _stderr_without(text: str):
    """Hold what C++ code writes to file descriptor 2 and pass on every line but those containing `text` at the
    end. Python's own writes (sys.stderr: an error line, a preemption's message) go straight through, so that a
    process that ends inside (`os._exit`) loses none of them."""
    sys.stderr.flush()
    saved, python_stderr = os.dup(2), sys.stderr
    with tempfile.TemporaryFile() as held:
        sys.stderr = open(saved, "w", buffering=1, encoding=python_stderr.encoding, errors="backslashreplace",
                          closefd=False)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if text not in line:
                    sys.stderr.write(line)
            sys.stderr.flush()


@contextlib.contextmanager
def memory_profiler():
    """torch's CPU profiler recording memory events, without the log lines it prints at every start and stop
    and the allocator's warning about blocks allocated before it."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)  # read when the profiler first starts
    with _stderr_without(ALLOCATOR_WARNING), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


def trace_events(prof) -> list:
    """The events of a finished profiler run, as its chrome trace lists them."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            return json.load(trace)["traceEvents"]


def allocation_curve(events: list) -> list[tuple[float, int]]:
    """(time, bytes allocated) before the first and after each of a CPU profiler run's "[memory]" events, in
    time order: the CPU counterpart of torch.cuda.memory_allocated().

    The events' own running "Total Allocated" is not used: a free on a thread the profiler is not active on
    is neither recorded nor taken off that count, and gloo's worker threads drop the last reference to a
    finished asynchronous collective's tensors (ZeRO-3's gathers, FSDP2's all-gathers). A block the trace still
    holds whose address is allocated again was freed unseen, so it is dropped then, the latest moment it can
    have been freed; a block freed unseen and never reused stays counted, so the curve is never below the
    real one (docs/benchmarks.md).
    """
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return []
    allocated = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]  # from before the profiler
    live, curve = {}, [(memory[0]["ts"], allocated)]
    for e in memory:
        address, size = e["args"]["Addr"], e["args"]["Bytes"]
        if size > 0:
            allocated += size - live.pop(address, 0)
            live[address] = size
        else:
            allocated -= live.pop(address, -size)
        curve.append((e["ts"], allocated))
    return curve


def memory_trace(prof) -> tuple[int, int, int]:
    """(allocated before, peak, allocated after) from a CPU profiler run with profile_memory=True."""
    curve = allocation_curve(trace_events(prof))
    if not curve:
        return 0, 0, 0
    return curve[0][1], max(v for _, v in curve), curve[-1][1]


def measure_activation_bytes(model, images: torch.Tensor) -> int:
    """Bytes a training forward leaves allocated for the backward (activations plus the logits), measured:
    the caching allocator's count on GPU, the profiler's memory events on CPU."""
    if images.is_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(images).logits
        torch.cuda.synchronize()
        retained = torch.cuda.memory_allocated() - before
        del out
        return retained
    with memory_profiler() as prof:
        out = model(images).logits
    before, _, after = memory_trace(prof)
    del out
    return after - before
