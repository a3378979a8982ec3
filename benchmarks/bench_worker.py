"""One benchmark configuration as one distributed job: DeepSpeed through train.py's own wrapping, or FSDP2.

    torchrun --nproc_per_node 2 -m benchmarks.bench_worker --spec '{"engine": "deepspeed", "zero": 3, ...}' \
        --out result.json

`train_bench.py` launches it; every field of the spec is listed in `Spec`. The job:
  1. starts the profiler (only its memory events matter) before the model exists, builds the model from
     the seed and wraps it (DeepSpeed: as train.py does, `build_training_model`, partitioned under ZeRO-3, and
     `build_engine`), and runs `profiled_steps` steps under it. The peak allocation of those steps
     (checkpointing.allocation_curve) is the rank's peak memory, weights, gradients, optimizer states,
     buffers and activations included; the setup's peak (building and wrapping) is reported beside it. The
     activations are what the last profiled forward left allocated for its backward, less the whole weights
     among it (ZeRO-3's gathered parameters, FSDP2's unsharded ones: the engine's, counted beside them). On
     GPUs, torch.cuda's allocator counters;
  2. stops the profiler, runs `warmup_steps` untimed steps, then times `timed_steps` further steps, each ended
     by an all-reduce of the loss and read on engine.timing's clock (on GPUs, after the device has finished
     the step);
  3. with `count_flops`, runs one last step under torch's FLOP counter (the FLOPs the hardware executes,
     recompute included), after the timed ones (`step_schedule`).
Every engine sees the same initial weights and the same batches (random images drawn from the seed, the
rank and the step), so the losses agree across engines up to fp32 summation order.
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.suites import DEEPSPEED
from config import Config
import compat
from loop.distributed import cap_device_memory, exit_distributed, flush_cpu_denormals, init_distributed
from loop.peak_memory import allocation_curve, trace_events
from loop.optim import lr_schedule, param_groups
from engine.fsdp2 import shard
from engine.memory import fsdp2_memory_bytes
from engine.build import build_engine, build_training_model, engine_config
from engine.parallelize import apply_ac
from parallel import sequence
from parallel.tensor import layout
from loop.timing import clock
from models import build_model, find_blocks, model_config, width
from models.tasks import build_task_model, task_loss


@dataclass
class Spec:
    engine: str = "deepspeed"  # deepspeed | fsdp2
    model: str = "vit-debug"
    image_size: int = 16
    patch_size: int = 0
    micro_batch_size: int = 8
    grad_accum_steps: int = 1  # micro-batches per optimizer step (a step is what is profiled, counted and timed)
    zero: int = 3  # deepspeed: ZeRO stage
    ac: str = "none"  # this project's policy; fsdp2 also hf:full | hf:every_n:K (Hugging Face's own)
    reshard: bool = True  # fsdp2: reshard_after_forward (True ~ ZeRO-3, False ~ ZeRO-2)
    profiled_steps: int = 2  # the first steps, under the memory profiler (they also warm up)
    # untimed steps before the timed ones: on CPU the process heap grows to the step's working set over the
    # first steps, and fresh pages are slow (train_bench.CPU_ALLOCATOR_ENV)
    warmup_steps: int = 0
    timed_steps: int = 3
    count_flops: bool = True  # one extra, untimed last step under torch's FLOP counter (recompute included)
    seed: int = 0
    num_labels: int = 10
    ds_config: str = ""  # deepspeed: a DeepSpeed JSON template (run config key ds_config); "" = ds_configs/zero{zero}.json
    compile: bool = False  # torch.compile: DeepSpeed's engine.compile() (train.py's); FSDP2 each block in place
    tp_size: int = 1  # deepspeed: tensor parallelism (train.py's tp_size); a tensor group's ranks see one batch
    sp_size: int = 1  # sequence parallelism (train.py's sp_size): a sequence group's ranks see one batch
    task: str = "classification"  # train.py's task: classification | mae | simmim | segmentation
    mask_ratio: float = 0.75  # mae, simmim
    mask_patch_size: int = 32  # simmim
    device_memory_gb: float = 0.0  # train.py's: each rank's GPU memory capped (a smaller device's), 0 = all


def batch(spec: Spec, rank: int, step: int):
    """The rank's images and targets of one optimizer step, micro-batches together: a step's draws depend on
    the seed, the data-parallel rank and the step, not on how the step is cut into micro-batches. Targets: a
    class per image, or for segmentation a class per pixel."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + layout(rank, spec.tp_size * spec.sp_size)[0] * 1009 + step)
    n = spec.micro_batch_size * spec.grad_accum_steps
    images = torch.randn(n, 3, spec.image_size, spec.image_size, generator=g)
    shape = (n, spec.image_size, spec.image_size) if spec.task == "segmentation" else (n,)
    return images, torch.randint(0, spec.num_labels, shape, generator=g)


def run_config(spec: Spec) -> Config:
    """The run config every engine trains with: train.py's defaults (AdamW, lr 2e-3, weight decay 0.05 off
    norms and biases, clipping at 1.0, label smoothing 0.1, precision `auto`: fp32 on CPU, bf16 on GPUs), the
    spec's shape, and a warm-up that lasts past the few steps of a job."""
    return Config(model=spec.model, num_labels=spec.num_labels, image_size=spec.image_size,
                  patch_size=spec.patch_size, zero_stage=spec.zero, ac="none" if spec.ac.startswith("hf:") else spec.ac,
                  micro_batch_size=spec.micro_batch_size, grad_accum_steps=spec.grad_accum_steps, warmup_steps=20, max_steps=100, seed=spec.seed,
                  ds_config=spec.ds_config, compile=spec.compile, tp_size=spec.tp_size, sp_size=spec.sp_size,
                  task=spec.task,
                  mask_ratio=spec.mask_ratio, mask_patch_size=spec.mask_patch_size)


class FSDP2Step:
    """PyTorch FSDP2: `fully_shard` per block and on the root, torch's fused AdamW (one kernel per parameter
    list on CPU and GPU: the fastest update torch offers), and either this project's checkpointing, wrapped by
    the same `apply_ac` DeepSpeed's blocks go through, or Hugging Face's own (`hf:full`, `hf:every_n:K`): plain
    FSDP2 as its users run it. `compile` compiles each block in place after its checkpointing and before
    `fully_shard` (torchtitan's order), so FSDP2's hooks stay outside the compiled code."""

    def __init__(self, model, cfg: Config, spec: Spec):
        cuda = torch.cuda.is_available()
        precision = "bf16" if cuda else "fp32"
        blocks = find_blocks(model)
        self.plan = None
        if spec.ac.startswith("hf:"):
            how = spec.ac[3:]
            if how != "full" and not how.startswith("every_n:"):
                raise ValueError(f"fsdp2: Hugging Face's checkpointing is hf:full or hf:every_n:K, not {spec.ac}")
            model.activation_checkpointing_enable(every_n_layers=int(how.split(":")[1]) if ":" in how else 1)
        else:
            n = sum(p.numel() for p in model.parameters())
            sizes = [sum(p.numel() for p in b.module.parameters()) for b in blocks]
            fixed = fsdp2_memory_bytes(n, n - sum(sizes), max(sizes), dist.get_world_size(), precision, spec.reshard,
                                       fused_adamw=True)
            self.plan = apply_ac(model, cfg, fixed, precision, "cuda" if cuda else "cpu", log=lambda *a: None)
        # GPUs: bf16 compute, fp32 gradient reduction and master weights, as DeepSpeed's bf16 mode
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        shard(model, precision, device, reshard=spec.reshard, compile_blocks=spec.compile)
        self.model, self.cfg, self.accum = model, cfg, spec.grad_accum_steps
        self.opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     eps=1e-8, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_schedule(cfg))

    def forward(self, images, targets, step: int, slot: int):
        return task_loss(self.model, self.cfg, images, targets, step, slot)

    def compiled(self) -> bool:
        return all(compat.is_compiled_in_place(b.module) for b in find_blocks(self.model))

    def gathered_weight_bytes(self) -> int:
        """Bytes of unsharded parameters: FSDP2 swaps a module's sharded DTensor parameters for plain,
        whole ones while they are unsharded (the root's, from its forward to its backward, and every
        block's without resharding)."""
        from torch.distributed.tensor import DTensor

        return sum(p.numel() * p.element_size() for p in self.model.parameters() if not isinstance(p, DTensor))

    def backward_step(self, loss, last: bool = True):
        """One micro-batch's backward; the optimizer steps after the `last` of a step's micro-batches, with
        FSDP2's default of reducing every micro-batch's gradients into the shards."""
        (loss / self.accum if self.accum > 1 else loss).backward()
        if not last:
            return
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)


class DeepSpeedStep:
    """train.py's path: `build_engine` (activation checkpointing, ZeRO, compile) and its loop body."""

    def __init__(self, model, cfg: Config, world_size: int):
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        built = build_engine(model, cfg, world_size, device_type, log=lambda *a: None)
        self.engine, self.plan, self.dtype, self.cfg = built.engine, built.ac_plan, built.dtype, cfg
        self.ds_config = built.engine_config

    def forward(self, images, targets, step: int, slot: int):
        return task_loss(self.engine, self.cfg, images.to(self.dtype), targets, step, slot)

    def compiled(self) -> bool:
        return self.engine.is_compiled

    def gathered_weight_bytes(self) -> int:
        """Bytes of ZeRO-3 parameters gathered whole (or being gathered) on this rank; 0 under ZeRO 1 and 2,
        whose weights are never partitioned. The forward ends with some still gathered: those the backward
        reads first, which ZeRO-3's prefetch and reuse distance keep."""
        return compat.zero3_gathered_bytes(self.engine.module)

    def backward_step(self, loss, last: bool = True):
        """DeepSpeed scales the loss by the accumulation steps and steps the optimizer at their boundary."""
        self.engine.backward(loss)
        self.engine.step()


def trace_name(spec: Spec) -> str:
    """A configuration's prefix for its trace files: engine, stage or resharding, policy."""
    how = f"zero{spec.zero}" if spec.engine == DEEPSPEED else "reshard" if spec.reshard else "noreshard"
    return f"{spec.engine}-{how}-{spec.ac.replace(':', '_')}"


def memory_phases(profiler, name: str) -> dict:
    """Per marked phase ("bench/..." record_function ranges): bytes allocated when it starts, its peak, and
    what it leaves allocated, from the profiler's "[memory]" events (checkpointing.allocation_curve: every
    allocation since the profiler started, i.e. before the model existed, less the frees)."""
    events = trace_events(profiler)
    if os.environ.get("BENCH_TRACE_DIR"):  # keep the rank's trace, to see what holds the memory
        with open(os.path.join(os.environ["BENCH_TRACE_DIR"], f"{name}-memory_rank{dist.get_rank()}.json"),
                  "w") as f:
            json.dump(events, f)
    memory = allocation_curve(events)
    phases = {}
    for e in events:
        if e.get("name", "").startswith("bench/") and e.get("ph") == "X":
            start, end = e["ts"], e["ts"] + e["dur"]
            inside = [v for t, v in memory if start <= t <= end]
            before = [v for t, v in memory if t < start]
            at_start = before[-1] if before else 0
            phases[e["name"][6:]] = {"start": at_start, "peak": max(inside + [at_start]),
                                     "end": inside[-1] if inside else at_start}
    return phases


def step_schedule(spec: Spec) -> tuple[range, range, int]:
    """A job's steps, its timed steps (numbered from 1) and its FLOP-counted step (0: none).

    The profiled steps come first, then the warm-up ones, then the timed ones. The FLOP-counted step is the last
    of all: its dispatch mode changes what stays allocated (so not under the memory profiler), and torch.compile
    skips a frame it is asked to compile while a dispatch mode is active and then keeps skipping its code outside
    the mode (pytorch/pytorch#190286, in torch 2.11 and 2.13): a compiled checkpointed block reached under the
    counter runs eagerly for the rest of the job.
    """
    first = spec.profiled_steps + spec.warmup_steps + 1
    timed = range(first, first + spec.timed_steps)
    flop_step = timed.stop if spec.count_flops else 0
    return range(1, max(timed.stop, flop_step + 1)), timed, flop_step


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="JSON object with the fields of Spec")
    parser.add_argument("--out", required=True, help="rank 0 writes the result JSON here")
    args = parser.parse_args(argv)
    spec = Spec(**json.loads(args.spec))
    if spec.profiled_steps < 1 or spec.timed_steps < 1:  # the profiler stops when the first timed step starts
        sys.exit(f"error: a job needs at least one profiled and one timed step (got {spec.profiled_steps} and "
                 f"{spec.timed_steps})")
    # a diagnostic, not a figure: BENCH_TRACE_STEP=K[,K2...] traces the op times of those steps (warm ones when
    # past the warm-up), on every rank, into BENCH_TRACE_DIR; the profiler slows the steps it traces
    traced_steps = {int(k) for k in os.environ.get("BENCH_TRACE_STEP", "").split(",") if k}
    if traced_steps and not os.environ.get("BENCH_TRACE_DIR"):
        sys.exit("error: BENCH_TRACE_STEP needs BENCH_TRACE_DIR, the folder its traces go to")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if spec.engine == DEEPSPEED:
        device = init_distributed(local_rank)  # as train.py
    else:
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        if not cuda:
            flush_cpu_denormals()  # as init_distributed does for DeepSpeed
    cap_device_memory(device, spec.device_memory_gb)
    cfg = run_config(spec)

    # CPU: the profiler's memory events are the only allocator record; GPU: the caching allocator's counters
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if not cuda \
        else contextlib.nullcontext()
    profiler.__enter__()
    with record_function("bench/build"):  # DeepSpeed: as train.py builds it (partitioned under ZeRO-3)
        if spec.engine == DEEPSPEED:
            model, _ = build_training_model(cfg, engine_config(cfg, width(model_config(
                spec.model, spec.num_labels, spec.image_size, spec.patch_size)), world_size)[1])
        elif spec.task == "classification":
            model, _ = build_model(spec.model, spec.num_labels, spec.image_size, spec.patch_size, seed=spec.seed)
            sequence.apply(model, spec.sp_size, rank, world_size)  # as build_training_model does
        else:
            model, _ = build_task_model(spec.model, spec.task, spec.num_labels, spec.image_size, spec.patch_size,
                                        seed=spec.seed, mask_ratio=spec.mask_ratio,
                                        mask_patch_size=spec.mask_patch_size)
    torch.manual_seed(spec.seed)  # dropout and stochastic depth: the same draws under every engine
    with record_function("bench/wrap"):
        step_fn = DeepSpeedStep(model, cfg, world_size) if spec.engine == DEEPSPEED \
            else FSDP2Step(model, cfg, spec)
    losses, times, hardware_flops = [], [], 0
    steps, timed_steps, flop_step = step_schedule(spec)
    for step in steps:
        images, labels = (t.to(device).chunk(spec.grad_accum_steps) for t in batch(spec, rank, step))
        if step == 1 and cuda:
            setup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if step == spec.profiled_steps + 1:  # profiling done: stop it before the timed steps
            profiler.__exit__(None, None, None)
            dist.barrier()
            if cuda:
                step_peak = torch.cuda.max_memory_allocated()
                reserved = torch.cuda.max_memory_reserved()
        counter = compat.flop_counter() if step == flop_step else contextlib.nullcontext()
        traced = step in traced_steps and step > spec.profiled_steps  # not under the memory profiler
        timeline = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) if traced \
            else contextlib.nullcontext()
        start = clock(device)
        step_loss = torch.zeros((), device=device)
        with timeline, counter, record_function(f"bench/step{step}"):
            for i, (x, y) in enumerate(zip(images, labels)):
                marked = step == spec.profiled_steps and i == 0  # the forward the activations are read from
                if marked:
                    weights_before = step_fn.gathered_weight_bytes()
                with record_function("bench/forward" if marked else f"bench/forward{step}.{i}"):
                    loss = step_fn.forward(x, y, step, rank * spec.grad_accum_steps + i)
                if marked:  # whole weights the forward left for the backward, not activations
                    forward_weights = step_fn.gathered_weight_bytes() - weights_before
                step_fn.backward_step(loss, last=i == spec.grad_accum_steps - 1)
                step_loss += loss.detach() / spec.grad_accum_steps
        if traced:
            timeline.export_chrome_trace(os.path.join(os.environ["BENCH_TRACE_DIR"],
                                                      f"{trace_name(spec)}-step{step}_rank{dist.get_rank()}.json"))
        if step == flop_step:
            hardware_flops = counter.get_total_flops()
        dist.all_reduce(step_loss)  # also the end of the step on every rank
        times.append(clock(device) - start)  # on GPUs, once the step's kernels and the all-reduce are done
        losses.append(step_loss.item() / world_size)

    if cuda:  # activation and per-step figures need the CPU profiler's timeline: not measured on GPU
        figures = [step_peak, setup_peak, reserved, math.nan, math.nan]
    else:
        phases = memory_phases(profiler, trace_name(spec))
        steps = [phases[f"step{i}"] for i in range(1, spec.profiled_steps + 1)]
        last = steps[-1]
        # activations: what the forward left allocated for the backward, less the whole weights among it
        figures = [max(p["peak"] for p in steps), max(phases["build"]["peak"], phases["wrap"]["peak"]), 0,
                   last["peak"] - last["start"],
                   phases["forward"]["end"] - phases["forward"]["start"] - forward_weights]
    figures = torch.tensor(figures + [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, hardware_flops,
                                      forward_weights],
                           dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(figures) for _ in range(world_size)]
    dist.all_gather(gathered, figures)
    if rank == 0:
        timed = times[timed_steps.start - 1:timed_steps.stop - 1]
        global_batch = spec.micro_batch_size * spec.grad_accum_steps * world_size // (spec.tp_size * spec.sp_size)
        # one figure, every rank (None: not measured)
        column = lambda i: [int(g[i]) if math.isfinite(g[i]) else None for g in gathered]  # noqa: E731
        result = {"spec": dataclasses.asdict(spec), "world_size": world_size, "device": device.type,
                  "threads_per_rank": torch.get_num_threads(), "step_seconds": timed,
                  "images_per_sec": global_batch * len(timed) / sum(timed), "losses": losses,
                  # the training steps' peak allocation (weights, gradients, optimizer states, buffers and
                  # activations); the setup's (building and wrapping the model) is reported beside it
                  "peak_alloc_bytes": column(0), "setup_peak_bytes": column(1), "peak_reserved_bytes": column(2),
                  # the last profiled step's peak above what was allocated when it began, and what its forward
                  # left allocated for the backward (CPU only): activations, and beside them the whole
                  # weights (ZeRO-3's gathered, FSDP2's unsharded) it left
                  "step_peak_bytes": column(3), "activation_bytes": column(4), "max_rss_bytes": column(5),
                  "hardware_flops_per_step": sum(float(g[6]) for g in gathered),
                  "forward_weight_bytes": column(7)}
        if spec.engine == DEEPSPEED:  # what DeepSpeed ran with: benchmarks.validate predicts from it
            result["ds_config"] = step_fn.ds_config
        result["compiled"] = step_fn.compiled()
        plan = step_fn.plan
        if plan is not None:
            result["ac_plan"] = {k: plan.get(k) for k in ("activation_bytes_planned", "activation_bytes_none",
                                                         "activation_peak_planned", "recompute_flops_fraction",
                                                         "fixed_bytes_estimate", "peak_bytes_planned", "traced")}
            result["ac_plan"]["blocks"] = [b["policy"] for b in plan["blocks"]]
        with open(args.out, "w") as f:
            json.dump(result, f)
    exit_distributed(0)  # result written and closed; avoids gloo's abort at interpreter exit


if __name__ == "__main__":
    main()
