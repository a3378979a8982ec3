"""Wrap an unmodified Hugging Face model for training: the one place that does it.

`build_ds_config` turns a DeepSpeed JSON template plus the run config into the final DeepSpeed
config; `parallelize` hands the model, its parameter groups and the LR schedule to DeepSpeed.
"""
import json
import math
import os
import sys

import torch

from config import Config, ConfigError
from models.blocks import find_blocks
from models.checkpointing import apply_activation_checkpointing, parse_policy

DS_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ds_configs")
# parameters AdamW must not decay besides every 0-/1-d tensor (norms, biases); names as timm lists them
NO_DECAY_NAMES = ("position_embeddings", "cls_token", "mask_token", "absolute_pos_embed", "relative_position_bias_table")


def release_deepspeed_shm(rank: int):
    """Unlink this rank's DeepSpeed shared-memory all-reduce buffer; call after a barrier that follows
    `deepspeed.init_distributed()`.

    DeepSpeed 0.19.8's CPU shared-memory all-reduce creates one ~68 MB /dev/shm buffer per rank and never
    unlinks it: they pile up in RAM-backed tmpfs, run after run, until runs fail (measured here: 316 of
    them, 21 of 24 GB, before this). Once every rank has returned from init, every rank has mapped every
    other's buffer, so the names can go now: the mappings stay valid, and the memory is freed when the
    processes end, even after a crash.
    """
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except FileNotFoundError:  # not all ranks on one host, or not DeepSpeed's CPU accelerator: no buffer
        pass


def exit_distributed(code: int = 0):
    """End a distributed process: a barrier, the process groups destroyed, then exit without Python's finalization.

    Gloo's worker threads free a finished collective's tensors themselves, which takes the GIL; the groups
    themselves outlive `destroy_process_group` (DeepSpeed and FSDP keep references), so their threads stay up.
    A worker that gets to that after interpreter finalization has begun is made to exit by CPython in the middle
    of a C++ destructor, and the process aborts ("terminate called without an active exception", exit -6, after
    all its work is done). Seen 1 run in 4-10 with two jobs on 2 cores; gdb on the core shows
    `~AsyncAllgatherWork` in `ProcessGroupGloo::runLoop` blocked in `take_gil` under `Py_FinalizeEx`.
    So callers close their own files first; this flushes stdio and leaves with `os._exit`.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def resolve_precision(precision: str) -> str:
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


def build_ds_config(cfg: Config, hidden_size: int, world_size: int, precision: str) -> dict:
    """The DeepSpeed config for this run: the template's explicit values win only where they agree."""
    path = cfg.ds_config or os.path.join(DS_CONFIG_DIR, f"zero{cfg.zero_stage}.json")
    try:
        with open(path) as f:
            ds = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read ds_config '{path}': {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"ds_config '{path}' is not valid JSON: {e}") from None
    where = f"ds_config '{os.path.relpath(path)}'"
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
    ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    _fill(ds, "optimizer.params.lr", cfg.lr, where)
    _fill(ds, "optimizer.params.betas", [cfg.beta1, cfg.beta2], where)
    _fill(ds, "optimizer.params.eps", 1e-8, where)
    _fill(ds, "optimizer.params.weight_decay", cfg.weight_decay, where)
    # torch's AdamW, not DeepSpeed's FusedAdam: the same update, the optimizer the FSDP2 baseline runs (so a
    # benchmark compares the sharding, not the optimizer kernels), and no JIT build of a C++/CUDA op at start
    ds["optimizer"]["params"].setdefault("torch_adam", True)

    # DeepSpeed's bucket defaults (5e8 elements, i.e. 2 GB in fp32) are sized for LLMs. Hugging Face's
    # integration derives them from hidden_size; we do the same, with a 1M-element floor so that small
    # models do not pay one collective per tensor.
    zero = ds["zero_optimization"]
    auto_sizes = {
        "reduce_bucket_size": max(hidden_size * hidden_size, 2**20),
        "allgather_bucket_size": max(hidden_size * hidden_size, 2**20),
        "stage3_prefetch_bucket_size": int(0.9 * max(hidden_size * hidden_size, 2**20)),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    # DeepSpeed's defaults (1e9 elements each) keep every gathered parameter alive from its forward to its
    # backward: a full unsharded copy of the model per rank (measured on ViT-S: 82 MiB more activation
    # memory than FSDP2). About one block's worth (~12 h^2 parameters) frees a block's weights after its
    # forward; a checkpointed block's recompute runs inside its backward, after the block's own gather.
    auto_sizes["stage3_max_live_parameters"] = 2 * 12 * hidden_size * hidden_size
    auto_sizes["stage3_max_reuse_distance"] = 12 * hidden_size * hidden_size
    for key, value in auto_sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
    leftover = [k for k, v in _walk(ds) if v == "auto"]
    if leftover:
        raise ConfigError(f"{where} has \"auto\" fields this trainer cannot fill: {', '.join(leftover)}")
    return ds


def _walk(d: dict, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or any(n in name for n in NO_DECAY_NAMES) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_schedule(cfg: Config):
    """Multiplier of the peak lr after `step` optimizer steps: linear warm-up, then cosine to min_lr."""
    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def zero_memory_bytes(n_params: int, zero_stage: int, world_size: int, precision: str, ds_config: dict) -> dict:
    """Per-rank bytes that do not depend on the batch, at the two moments that set a step's peak.

    ZeRO's accounting (Rajbhandari et al. 2020) with what DeepSpeed allocates when, read off the profiler's
    allocation events of ViT-S steps under each stage (fp32, 2 ranks; benchmarks/README.md):
    - `backward`, when the backward starts and the activations peak: the weights (whole under ZeRO-1/2, a
      partition under ZeRO-3), the fp32 master partition (kept in fp32 training too) and AdamW's two fp32
      moments. ZeRO-3 also holds its gradient partition (allocated at initialisation), its prefetch
      bucket and the gathered weights it keeps from the forward for the backward (below). ZeRO-2 holds
      its gradient partition from its first reduction on, and the rank whose partition holds the last
      layers reduces first, at the start of the backward (measured, Swin-T: 54 MiB on rank 1 at its peak,
      none on rank 0). ZeRO-1 reduces at the end of the backward, when activations are freed.
    - `optimizer_step`, which peaks in AdamW's update: the weights and states as above, the flat fp32
      gradient partition DeepSpeed hands the optimizer, AdamW's two temporaries of the partition's size
      (DeepSpeed flattens the partition into one tensor: `sqrt` and the update are whole-partition tensors)
      and, under ZeRO-1, the reduced gradient partition, which ZeRO-2 and 3 hold already (in `backward`).

    ZeRO-3's gathered weights are counted as stage3_max_live_parameters, which is more than the forward
    keeps: DeepSpeed releases a module's weights after its forward unless the module trace uses them again
    within stage3_max_reuse_distance parameters (R), and the trace runs on into the backward in reverse, so
    the forward ends holding about its last R/2 (Swin-T: 279 MiB at a step's start against 320 planned).
    The backward then gathers and reduces on top: at the peak of Swin-T and ViT-S steps, 25-60 MiB more was
    live than the activations, R/2 and the partitions account for (the module in flight's gradients, their
    reduce-scatter copy, small blocks). Counting R/2 alone planned those peaks 3-6% low; max_live covers
    both: -3.9% to +0.3% on the committed cpu suite's ZeRO-3 rows, but Swin-T `full` +14.2% (benchmarks/README.md).
    """
    weight = grad = 2 if precision in ("bf16", "fp16") else 4
    n, part = n_params, n_params / world_size
    zero = ds_config.get("zero_optimization", {})
    states = 12 * part  # fp32 master partition and AdamW's exp_avg, exp_avg_sq
    if zero_stage == 3:
        live = min(zero.get("stage3_max_live_parameters", n), n)
        if zero.get("stage3_max_reuse_distance", 0) >= n:
            live = n
        held = weight * (part + min(zero.get("stage3_prefetch_bucket_size", 0), n) + live) + states + grad * part
    else:
        held = weight * n + states
        if zero_stage == 2:
            held += grad * part
        elif ds_config.get("gradient_accumulation_steps", 1) > 1:  # ZeRO-1 keeps gradients between micro-batches
            held += grad * n
    step_extra = (4 if zero_stage == 1 else 3) * 4 * part  # fp32 gradient partitions and AdamW's temporaries
    return {"backward": int(held), "optimizer_step": int(held + step_extra)}


def parallelize(model: torch.nn.Module, cfg: Config, ds_config: dict, profile_images: torch.Tensor,
                world_size: int, precision: str, device_type: str, log=print):
    """Wrap the model; returns the DeepSpeed engine (its optimizer and LR scheduler inside) and the
    activation-checkpointing plan.

    Order matters and is fixed here: activation checkpointing is applied to the bare blocks first
    (it must see the modules DeepSpeed will hook), then DeepSpeed, so that its ZeRO hooks wrap whatever
    the blocks have become, then torch.compile (`compile`) through the engine.
    """
    import deepspeed  # heavy import, only once we train

    fixed = zero_memory_bytes(sum(p.numel() for p in model.parameters()), cfg.zero_stage, world_size, precision,
                              ds_config)
    ac_plan = apply_activation_checkpointing(model, cfg.ac, device_type, profile_images, fixed, log)
    if cfg.zero_stage == 3:
        _gather_blocks_whole(model)

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg.weight_decay),
        config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(cfg)),
    )
    _make_zero3_linear_out_of_place()
    if engine.zero_optimization_partition_weights():
        _native_linear_in_checkpointed_blocks(model, ac_plan)
    if cfg.compile:
        # DeepSpeed's own entry point: it compiles the module with its ZeRO hooks in place (ZeRO-3's break
        # the graph around each block's gather; the checkpointed blocks trace through)
        engine.compile()
        log("compile: the model is compiled by torch.compile, through DeepSpeed's engine.compile(); the first "
            "steps are slow while it compiles" if engine.is_compiled else "compile: DeepSpeed did not compile the model")
    return engine, ac_plan


def _gather_blocks_whole(model):
    """Make every transformer block one ZeRO-3 unit: its weights gathered in one fetch, released in one.

    DeepSpeed hooks every sub-module by default, and in Python: a Swin-T block has ~17 of them, each with
    a gather before and a release after its forward, and again in its backward. With the block a
    "leaf module" (DeepSpeed's own switch, `set_z3_leaf_module`), its hooks sit on the block alone:
      - fewer hooks: on one rank, a Swin-T step's forward spent 76 ms in Python outside torch's ops
        with hooks on every sub-module, 47 ms with hooks on the blocks (128x128, batch 32);
      - the hooks sit outside the checkpoint: a recomputed block no longer gathers and releases its
        sub-modules' weights a second time (40 ms of Python a step under `selective`), and torch's
        selective checkpointing, which requires the recompute to replay the forward's exact ops, no
        longer sees ZeRO-3's gathers (a weight prefetched in the forward and gathered in the recompute
        failed with "aten.cat.default encountered during backward but not found in storage");
      - `cpu` suite, 2 ranks, three runs: `selective` against `none` under ZeRO-3 +7.1%, +3.6% and +7.7%
        step time on Swin-T (+10.6% to +12.3% in three runs before); plain ZeRO-3 on ViT-S 0.95-0.99x
        FSDP2's images/s (0.89x before), on Swin-T unchanged within the noise.
    What it costs: a block's weights stay gathered as a whole where DeepSpeed keeps them for the backward;
    on Swin-T, 22 MiB more at the forward's end (1072 against 1050 MiB under `none`).
    The gathered weights of a block are live together, as they were: `stage3_max_live_parameters` is
    two blocks' worth (`resolve_ds_config`).
    """
    from deepspeed.utils import set_z3_leaf_module

    for block in find_blocks(model):
        set_z3_leaf_module(block.module, True)


def _native_linear(self, input):
    return torch._C._nn.linear(input, self.weight, self.bias)  # the aten op, not DeepSpeed's F.linear


def _native_linear_in_checkpointed_blocks(model, ac_plan):
    """Under ZeRO-3, let the linears of recomputed blocks use torch's own `linear` again.

    A checkpoint's recompute stops as soon as it has rebuilt every tensor the backward needs. torch's
    addmm saves its inputs *before* it runs, so the recompute of a block stops just short of its last
    matmul (fc2), whose output nothing in the block saves. DeepSpeed's ZeRO-3 linear is an autograd
    function, which saves its inputs only *after* its forward: the recompute had to run fc2's matmul too
    (measured, ViT-S selective: +100 MFLOP per block instead of +20, 4 images at 32x32). DeepSpeed's function
    exists to keep gathered weights from being saved for the backward, and a checkpointed block saves
    nothing but its input and, under `selective`, the matmul outputs, so inside one it is not needed.
    """
    for module in _modules_of_blocks(model, ac_plan, ("full", "selective")):
        if isinstance(module, torch.nn.Linear):
            module.forward = _native_linear.__get__(module)


def _modules_of_blocks(model, ac_plan, policies):
    """Every module inside the blocks whose planned policy is one of `policies`."""
    names = {b["name"] for b in ac_plan["blocks"] if b["policy"] in policies}
    for name, block in model.named_modules():
        if name in names:
            yield from block.modules()


def _zero3_linear(input, weight, bias=None):
    """DeepSpeed's ZeRO-3 linear, always through its fused, out-of-place `addmm` path.

    Under ZeRO-3 DeepSpeed replaces F.linear process-wide with an autograd function that saves the weight
    *parameter* for the backward (which gathers it again) instead of a view of the gathered storage, so the
    gathered weights are freed after each layer's forward. Measured on ViT-S under ZeRO-3 without it: the
    forward kept 82 MiB more per rank, the whole model unsharded. But for inputs of more than 2 dimensions
    its forward adds the bias *in place* into the matmul output; selective checkpointing keeps that output,
    so its recompute added the bias a second time (1.5e-5 relative loss error after 4 steps, debug ViT).
    Flattening the input to 2-D takes DeepSpeed's own `torch.addmm(bias, input, weight.t())` branch instead.
    """
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    if input.dim() == 2 or bias is None:
        return LinearFunctionForZeroStage3.apply(input, weight, bias)
    out = LinearFunctionForZeroStage3.apply(input.reshape(-1, input.shape[-1]), weight, bias)
    return out.view(*input.shape[:-1], out.shape[-1])


def _make_zero3_linear_out_of_place():
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    if torch.nn.functional.linear is zero3_linear_wrap:  # set by deepspeed.initialize for ZeRO-3
        torch.nn.functional.linear = _zero3_linear
