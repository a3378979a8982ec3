"""Activation checkpointing per transformer block: what to recompute, chosen per block, never changing numbers.

Policies (run-config key `ac`):
  none            keep every activation
  full            recompute every block in the backward pass (keep only its input)
  every_n:K       recompute blocks 0, K, 2K, ...
  light           recompute only the norms' and activations' outputs, from their inputs, when the backward
                  reads them (ac/recompute.py): the matmuls never rerun, and no per-operator dispatch mode
  selective       `light`, and the residual sums whose operands the block keeps anyway (its input and a
                  linear layer's input), rebuilt by rerunning that linear (ViT's attention out-projection):
                  the memory-heavy outputs recomputed, the matmuls that produce the kept ones never rerun
                  (Korthikanti et al. 2022), by the block's structure (ac/recompute.py): a Python call per
                  saved tensor and per norm, activation and linear, no per-operator dispatch
  hierarchical[:K]  the first K blocks full, the rest selective (ViT); for Swin, K counts stages. By
                  default K covers the largest-activation blocks holding half of all activation bytes, read
                  off the profile
  offload         keep every block's saved activations in pinned host memory (GPU only)
  auto:BUDGET_GB  per-block plan (none | selective | full) from a one-batch profile of the real model,
                  the least recompute that fits BUDGET_GB per rank

A block is wrapped by replacing its instance `forward` with a checkpointed call of the original: module
hooks (DeepSpeed ZeRO-3's parameter gather and release, on whole blocks: engine/parallelize.py) stay outside
the checkpoint; parameter names and `state_dict` keys do not change. How plans are made and why they are exact:
docs/activation_checkpointing.md.
"""
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ac.budget import default_hierarchical_k, plan_figures, plan_for_budget
from ac.recompute import wrap_recipes
from ac.profile import COMPUTE_OPS, LINEAR_OPS, PROFILE_BATCH, Profile, profile_blocks
from config import ConfigError
from models.blocks import Block, find_blocks

POLICIES = ("none", "light", "full", "every_n:K", "selective", "hierarchical[:K]", "offload", "auto:BUDGET_GB")


def traced_policy(rerun: tuple = ()):
    """`light` and `selective` as an operator policy, for blocks torch.compile traces: the outputs of the
    matmuls and attention kernels are saved (the partitioner keeps those the backward reads), every other
    operator's output is recomputed in the backward, inside the compiled backward's fused kernels; with `rerun`
    (`selective`: the positions among the block's mm/addmm of the linear layers whose residual sums its recipes
    rebuild, ac/profile.py) those linears rerun too. Applied when the graph is traced, it costs no Python per
    step. A fresh policy per checkpointed call, with separate counters for the forward and an eager recompute,
    which replay the same operators in the same order."""
    seen = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in LINEAR_OPS:
            i = seen[ctx.is_recompute]
            seen[ctx.is_recompute] += 1
            return CheckpointPolicy.PREFER_RECOMPUTE if i in rerun else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if op in COMPUTE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _wrap(block: Block, how: str, compiled: bool = False, rerun: tuple = ()):
    original = block.module.forward
    if how == "full":
        def forward(*args, **kwargs):
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
    elif how in ("light", "selective") and compiled:
        # The recipes' saved-tensor and module hooks would cut the compiled block where they sit: the same
        # recomputation, decided when torch.compile traces the block
        rerun = rerun if how == "selective" else ()

        def context():
            return create_selective_checkpoint_contexts(traced_policy(rerun))

        def forward(*args, **kwargs):
            return checkpoint(original, *args, use_reentrant=False, context_fn=context, **kwargs)
    elif how in ("light", "selective"):
        wrap_recipes(block.module, residual=how == "selective")
        return
    elif how == "offload":
        def forward(*args, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return original(*args, **kwargs)
    else:
        raise ValueError(how)
    block.module.forward = forward


def parse_policy(ac: str):
    """(name, argument) of a policy string, or ConfigError listing the policies."""
    name, _, arg = ac.partition(":")
    try:
        if name in ("none", "light", "full", "selective", "offload") and not arg:
            return name, None
        if name == "every_n" and int(arg) >= 1:
            return name, int(arg)
        if name == "hierarchical":
            return name, int(arg) if arg else None
        if name == "auto" and float(arg) > 0:
            return name, float(arg)
    except ValueError:
        pass
    raise ConfigError(f"unknown activation checkpointing policy '{ac}' (one of: {', '.join(POLICIES)})")


def check_policy(ac: str, device_type: str):
    """(name, argument) of a policy this device can run, or ConfigError."""
    name, arg = parse_policy(ac)
    if name == "offload" and device_type != "cuda":
        raise ConfigError("ac 'offload' keeps activations in pinned host memory, which needs a GPU; on CPU they "
                          "are already in host memory")
    return name, arg


def hf_checkpointing_is_on(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def choose_plan(ac: str, blocks: list[Block], profile, fixed: dict) -> list:
    """Per block: none, selective, full or offload, as policy `ac` says (a valid one). `hierarchical` and `auto`
    read the profile; `auto` fits the step's peak (`fixed` + activations) into its budget."""
    name, arg = parse_policy(ac)
    if name == "none":
        return ["none"] * len(blocks)
    if name in ("full", "selective", "offload", "light"):
        return [name] * len(blocks)
    if name == "every_n":
        return ["full" if i % arg == 0 else "none" for i in range(len(blocks))]
    if name == "hierarchical":
        by_stage = len({b.stage for b in blocks}) > 1
        k = arg if arg is not None else default_hierarchical_k(profile, by_stage)
        return ["full" if (b.stage if by_stage else b.index) < k else "selective" for b in blocks]
    if fixed["optimizer_step"] > arg * 2**30:
        raise ConfigError(f"ac '{ac}': the optimizer step alone needs {fixed['optimizer_step'] / 2**30:.3f} GiB "
                          "per rank (weights, gradients, AdamW states and temporaries), more than the budget")
    plan, _, _ = plan_for_budget(profile, int(arg * 2**30) - fixed["backward"] - profile.bytes_outside)
    return plan


def apply_activation_checkpointing(model, ac: str, device_type: str, profile_images=None, fixed: dict = None,
                                   log=print, profile: Profile = None, compiled: bool = False) -> dict:
    """Wrap the model's blocks per policy `ac`; returns the plan that was applied (for the run directory).

    `compiled`: the blocks will be traced by torch.compile, so `light` and `selective` are applied as an operator
    policy at trace time (`traced_policy`; `selective`'s linears from the profile) instead of the recipes' hooks.

    `profile`: the blocks' profile at the micro-batch, if made already (ac.profile.profile_model, on the meta device);
    otherwise one forward of `profile_images` makes it. `fixed`: the bytes that do not depend on the batch when the backward starts and at the optimizer step
    (engine.memory.zero_memory_bytes); `auto` budgets the activations against them."""
    fixed = fixed or {"backward": 0, "optimizer_step": 0}
    name, arg = check_policy(ac, device_type)
    if name != "none" and hf_checkpointing_is_on(model):
        raise ConfigError("the model already has Hugging Face activation checkpointing on; nesting it with "
                          f"ac '{ac}' would recompute twice: disable one of them")
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(f"ac '{ac}': no transformer blocks found in {type(model).__name__}")
    if profile is None and (name in ("hierarchical", "auto") or profile_images is not None):
        # Profile a small slice of the batch and scale: bytes and FLOPs are exact (tested), and the profile's
        # own activations (and the compute outputs it holds) stay far below the step's peak memory.
        # A copy, not a view: a view's storage is the whole batch, and the patch embedding saves its input,
        # which would be counted at the whole batch's size and then scaled again.
        small = profile_images[:PROFILE_BATCH].clone()
        profile = profile_blocks(model, small).scaled(len(profile_images) / len(small))
    if profile is not None and [p.name for p in profile] != [b.name for b in blocks]:
        raise RuntimeError(f"the profile's blocks ({len(profile)}) are not the model's ({len(blocks)})")
    plan = choose_plan(ac, blocks, profile, fixed)
    for i, (block, how) in enumerate(zip(blocks, plan)):
        if how != "none":
            _wrap(block, how, compiled, profile[i].rerun_linears if profile is not None else ())
    result = {"ac": ac, "blocks": [{"name": b.name, "stage": b.stage, "policy": how} for b, how in zip(blocks, plan)]}
    if compiled and {"light", "selective"} & set(plan):
        result["traced"] = True  # light/selective as an operator policy at trace time
        log(f"ac {ac}: light and selective applied by torch.compile when it traces each block (matmul and attention "
            "outputs kept, the other operators recomputed in the compiled backward)")
    if profile is not None:
        result["profile"] = [p.__dict__ for p in profile]
        result.update(plan_figures(profile, plan, fixed))
        if name in ("auto", "hierarchical"):
            counts = {h: plan.count(h) for h in ("none", "selective", "full")}
            mib = {k: result[f"activation_{k}"] / 2**20 for k in ("bytes_planned", "bytes_none", "peak_planned")}
            log(f"ac {ac}: {counts} | activations {mib['bytes_planned']:.1f} MiB of {mib['bytes_none']:.1f} MiB, "
                f"{mib['peak_planned']:.1f} MiB at the peak | recompute {result['recompute_flops_fraction']:.1%} "
                f"of the step's FLOPs")
    return result
