"""Activation checkpointing per transformer block: what to recompute, chosen per block, never changing numbers.

Policies (run-config key `ac`):
  none            keep every activation
  full            recompute every block in the backward pass (keep only its input)
  every_n:K       recompute blocks 0, K, 2K, ...
  selective       keep the outputs of the compute-heavy ops (matmuls, attention kernels), recompute the
                  cheap, memory-heavy ones (norms, GELU, softmax, dropout, residual adds); Korthikanti et
                  al. 2022, with PyTorch's selective checkpoint contexts
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
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from config import ConfigError
from engine import compat
from models.blocks import Block, find_blocks

aten = torch.ops.aten
TO_COPY, UNSAFE_VIEW = compat.internal_copy_and_view_ops()
# outputs worth keeping: the ops that hold the FLOPs
COMPUTE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
               *compat.attention_kernels()}
PROFILE_BATCH = 2  # images the one-batch profile runs; its figures are scaled to the micro-batch
POLICIES = ("none", "full", "every_n:K", "selective", "hierarchical[:K]", "offload", "auto:BUDGET_GB")


def _selective_policy(keep):
    """Keep the i-th compute op's output when keep[i] (all of them when keep is None); recompute the rest.

    A fresh policy per checkpointed call, with separate op counters for the forward and the recompute,
    which replay the same ops in the same order and so take the same decisions.
    """
    seen = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op not in COMPUTE_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        i = seen[ctx.is_recompute]
        seen[ctx.is_recompute] += 1
        save = keep is None or i >= len(keep) or keep[i]
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _wrap(block: Block, how: str, keep=None):
    original = block.module.forward
    if how == "full":
        def forward(*args, **kwargs):
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
    elif how == "selective":
        def context():
            return create_selective_checkpoint_contexts(_selective_policy(keep))

        def forward(*args, **kwargs):
            return checkpoint(original, *args, use_reentrant=False, context_fn=context, **kwargs)
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
        if name in ("none", "full", "selective", "offload") and not arg:
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


@dataclass
class BlockProfile:
    name: str
    stage: int
    bytes_none: int  # saved-for-backward bytes with every activation kept
    bytes_selective: int  # the kept compute-op outputs plus the block input
    bytes_full: int  # the block input only
    flops: int  # forward FLOPs (matmuls, attention)
    # What the recompute repeats. It stops at the block's last saved tensor (non-reentrant checkpointing's
    # early stop), so the ops after it (the MLP's last matmul, its residual add) never rerun.
    flops_full: int  # compute-op FLOPs before the last saved tensor: rerun under `full`
    flops_selective: int  # those of them whose outputs `selective` does not keep (see `keep`): rerun under it
    cheap_elems: int  # elements produced by the other ops before the last saved tensor: rerun by both
    keep: list  # per compute op in forward order: does the backward read its output, itself or as a copy?
    # what the block's backward holds beside the saved activations: the gradients of its largest matmul output
    # and of its input
    bytes_grad: int = 0
    params: int = 0  # the block's own parameters (not scaled with the batch)

    def scaled(self, factor: float) -> "BlockProfile":
        """The profile of a batch `factor` times larger: every saved activation, FLOP and element of a ViT
        or Swin block is proportional to the batch (the weights, which are not, are not counted)."""
        return BlockProfile(self.name, self.stage, round(self.bytes_none * factor), round(self.bytes_selective * factor),
                            round(self.bytes_full * factor), round(self.flops * factor), round(self.flops_full * factor),
                            round(self.flops_selective * factor), round(self.cheap_elems * factor), self.keep,
                            round(self.bytes_grad * factor), self.params)


# ops that only copy or rescale one tensor: a saved tensor made from a compute output by these alone is that
# output in another layout (transformers' eager and math-SDPA attention save `(q * scale).contiguous()`)
# (`contiguous` reaches the dispatcher as `clone`; `mul`/`div` count only with a scalar, one tensor argument)
COPY_OPS = {aten.clone, TO_COPY, aten.mul, aten.div}


# ops that move no data: a view, or metadata only
VIEW_OPS = (aten.view, UNSAFE_VIEW, aten.t, aten.transpose, aten.permute, aten.expand, aten.reshape, aten.detach,
            aten.slice, aten.select)


class _OpRecorder(compat.dispatch_mode_class()):
    """Bytes of compute-op outputs and element counts of the other ops, per active block."""

    def __init__(self):
        super().__init__()
        self.block, self.compute_outputs, self.cheap_ops, self.packs, self.ops = None, {}, {}, {}, 0
        self.moved = 0  # bytes the memory-bound ops (all but the compute ops and views) read and write
        # storage address -> (block, index of the compute op) it was copied or rescaled from
        self.copied_from = {}
        # Compute outputs (and copies of them) are matched to saved tensors by storage address; holding them
        # for the profile's forward keeps a freed output's address from being reused by a later saved tensor,
        # which would mark an unsaved output as kept.
        self.alive = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += not func.is_view
        moves_data = not func.is_view and compat.op_packet(func) not in VIEW_OPS
        if func not in COMPUTE_OPS and moves_data:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            ins = [a for arg in args for a in (arg if isinstance(arg, (tuple, list)) else (arg,))]
            self.moved += sum(t.numel() * t.element_size() for t in (*ins, *outs) if isinstance(t, torch.Tensor))
        if self.block is not None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            tensors = [t for t in outs if isinstance(t, torch.Tensor)]
            packs = self.packs.get(self.block, 0)  # tensors the block saved before this op ran
            if func in COMPUTE_OPS:
                self.alive.append(tensors[0])
                storage = tensors[0].untyped_storage()
                flops = compat.flop_count(func, args, kwargs or {}, out)
                ops = self.compute_outputs.setdefault(self.block, [])
                self.copied_from[compat.storage_id(tensors[0])] = (self.block, len(ops))
                ops.append((compat.storage_id(tensors[0]), storage.nbytes(), flops, packs))
            elif compat.op_packet(func) not in VIEW_OPS:
                self.cheap_ops.setdefault(self.block, []).append((sum(t.numel() for t in tensors), packs))
                sources = [a for a in args if isinstance(a, torch.Tensor)]
                if compat.op_packet(func) in COPY_OPS and len(sources) == 1 and tensors:
                    origin = self.copied_from.get(compat.storage_id(sources[0]))
                    if origin is not None:
                        self.alive.append(tensors[0])
                        self.copied_from[compat.storage_id(tensors[0])] = origin
        return out


class Profile(list):
    """The blocks' profiles, in forward order, and the activation bytes saved outside any block (the stem,
    Swin's patch merging, the final norm and head), which no policy changes; the whole forward's FLOPs, and the
    operators it dispatches (views excepted: each of the others is at least one kernel launch on a GPU), and the
    bytes its memory-bound operators (norms, activations, softmax, adds, copies) read and write."""
    bytes_outside: int = 0
    forward_flops: int = 0
    ops: int = 0
    moved_bytes: int = 0

    def scaled(self, factor: float) -> "Profile":
        out = Profile(p.scaled(factor) for p in self)
        out.bytes_outside = round(self.bytes_outside * factor)
        out.forward_flops, out.ops = round(self.forward_flops * factor), self.ops
        out.moved_bytes = round(self.moved_bytes * factor)
        return out


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear saves its weight transposed), whatever storage it has now."""
    return isinstance(compat.view_base(t), torch.nn.Parameter)


def profile_blocks(model, images: torch.Tensor) -> Profile:
    """One forward of the unwrapped model: saved-tensor bytes (unique storages; activations only, not the
    weights the matmuls also save), FLOPs and cheap-op work per block."""
    weights = {compat.storage_id(t) for t in (*model.parameters(), *model.buffers())}

    blocks = find_blocks(model)
    saved = {b.name: {} for b in blocks}
    inputs = {}
    handles = []
    recorder = _OpRecorder()
    for b in blocks:
        def pre(module, args, name=b.name):
            recorder.block = name
            inputs[name] = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

        def post(module, args, output):
            recorder.block = None
        handles += [b.module.register_forward_pre_hook(pre), b.module.register_forward_hook(post)]

    def pack(t):
        if recorder.block is not None:  # weights count as saved tensors for the early stop, not as bytes
            recorder.packs[recorder.block] = recorder.packs.get(recorder.block, 0) + 1
        if compat.storage_id(t) in weights or _is_parameter(t):
            # Nothing kept: this forward never runs a backward, and a partitioned model's weights are gathered
            # only while their module runs (engine/parallelize.py), which holding them here would undo.
            return None
        storage = t.untyped_storage()
        saved.setdefault(recorder.block, {})[compat.storage_id(t)] = storage.nbytes()
        # Detached: a saved output returned as itself closes a cycle through its own grad_fn that Python's
        # collector cannot see, and the profiled forward would stay allocated for good.
        return t.detach()

    flops = compat.flop_counter()
    # torch's own linear, which checkpointed blocks run under every ZeRO stage (engine/parallelize.py); the
    # fork_rng: the profile must not move the RNG that dropout and stochastic depth draw from
    try:
        with torch.random.fork_rng(devices=[]), compat.functional_linear_is_torchs(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flops, recorder:
            model(images).logits.sum()
    finally:
        for h in handles:
            h.remove()
        recorder.alive.clear()
    per_module = flops.get_flop_counts()
    out = Profile()
    out.forward_flops, out.ops, out.moved_bytes = flops.get_total_flops(), recorder.ops, recorder.moved
    in_blocks = {ptr for b in blocks for ptr in saved[b.name]}
    out.bytes_outside = sum(n for ptr, n in saved.get(None, {}).items() if ptr not in in_blocks)
    for b in blocks:
        f = sum(per_module.get(f"{type(model).__name__}.{b.name}", {}).values())
        none = sum(saved[b.name].values())
        # `selective` keeps the outputs the backward reads, itself or as a copy (keeping the output costs the
        # copy's bytes and saves rerunning its matmul: Swin's q, k and v). One that only feeds other cheap ops
        # is not kept: after the last saved tensor (the MLP's last matmul) it is never recomputed; before it
        # (the attention out-projection, whose residual sum the next norm saves) its matmul reruns, counted
        # below.
        outputs = recorder.compute_outputs.get(b.name, [])
        read = {recorder.copied_from.get(ptr) for ptr in saved[b.name]}
        keep = [ptr in saved[b.name] or (b.name, i) in read for i, (ptr, *_) in enumerate(outputs)]
        kept = sum(nbytes for (ptr, nbytes, *_), k in zip(outputs, keep) if k)
        last = recorder.packs.get(b.name, 0)
        rerun = [(flops, k) for (_, _, flops, packs), k in zip(outputs, keep) if packs < last]
        out.append(BlockProfile(b.name, b.stage, none, min(none, kept + inputs[b.name]), inputs[b.name], int(f),
                                sum(fl for fl, _ in rerun), sum(fl for fl, k in rerun if not k),
                                sum(n for n, packs in recorder.cheap_ops.get(b.name, []) if packs < last), keep,
                                max((nbytes for _, nbytes, *_ in outputs), default=0) + inputs[b.name],
                                sum(compat.param_numel(p) for p in b.module.parameters())))
    return out


def default_hierarchical_k(profile: list[BlockProfile], by_stage: bool) -> int:
    """Smallest K whose first K blocks (or stages) hold at least half of all kept activation bytes."""
    units = {}
    for p in profile:
        key = p.stage if by_stage else profile.index(p)
        units[key] = units.get(key, 0) + p.bytes_none
    total, running = sum(units.values()), 0
    for k, key in enumerate(sorted(units), start=1):
        running += units[key]
        if running >= total / 2:
            return k
    return len(units)


def kept_bytes(p: BlockProfile, how: str) -> int:
    """Activation bytes block `p` keeps for the backward under `how` (offload keeps all, on the host)."""
    return {"selective": p.bytes_selective, "full": p.bytes_full}.get(how, p.bytes_none)


def recompute_flops(p: BlockProfile, how: str) -> int:
    """Matmul and attention FLOPs the backward repeats for block `p` under `how` (what torch's counter sees)."""
    return {"selective": p.flops_selective, "full": p.flops_full}.get(how, 0)


def recompute_cost(p: BlockProfile, how: str) -> int:
    """Work the backward repeats for block `p` under `how`: FLOPs, plus one per element of the cheap ops."""
    return recompute_flops(p, how) + (p.cheap_elems if how in ("selective", "full") else 0)


def activation_peak(profile: list[BlockProfile], plan: list, released: list | None = None) -> int:
    """Activation bytes at the step's highest point under `plan`: the end of the forward (every block's kept
    bytes), or some block's backward, which holds its gradients and, if the block is recomputed, all it
    would have saved, while the blocks before it still hold theirs (the blocks after it are done and freed).
    `released[i]`: other bytes freed by the time block i's backward runs, taken off that moment."""
    kept = [kept_bytes(p, how) for p, how in zip(profile, plan)]
    peak, before = sum(kept), 0
    for i, (p, how, k) in enumerate(zip(profile, plan, kept)):
        held = p.bytes_none if how in ("selective", "full") else k
        peak = max(peak, before + held + p.bytes_grad - (released[i] if released else 0))
        before += k
    return peak


def plan_for_budget(profile: list[BlockProfile], activation_budget: int):
    """Per-block choice of none/selective/full with the least recompute whose activation peak fits the budget.

    Greedy on bytes saved per recomputed FLOP: a block moves none -> selective -> full, the cheapest
    saving first. A level costs the matmul FLOPs its recompute reruns plus its cheap ops (one FLOP per
    element produced).
    Returns (plan, activation peak, recompute FLOPs) or raises when even `full` everywhere does not fit.
    """
    levels = ("none", "selective", "full")
    plan = ["none"] * len(profile)
    floor = activation_peak(profile, ["full"] * len(profile))
    if floor > activation_budget:
        raise ConfigError(f"activation budget {activation_budget / 2**30:.3f} GiB is below what full recompute "
                          f"still keeps ({floor / 2**30:.3f} GiB)")
    while activation_peak(profile, plan) > activation_budget:
        best = None
        for i, p in enumerate(profile):
            if plan[i] == "full":
                continue
            nxt = levels[levels.index(plan[i]) + 1]
            saved = kept_bytes(p, plan[i]) - kept_bytes(p, nxt)
            extra = recompute_cost(p, nxt) - recompute_cost(p, plan[i])
            ratio = saved / max(extra, 1)
            if saved > 0 and (best is None or ratio > best[0]):
                best = (ratio, i, nxt)
        if best is None:
            break
        _, i, nxt = best
        plan[i] = nxt
    return plan, activation_peak(profile, plan), sum(recompute_cost(p, how) for p, how in zip(profile, plan))


def choose_plan(ac: str, blocks: list[Block], profile, fixed: dict) -> list:
    """Per block: none, selective, full or offload, as policy `ac` says (a valid one). `hierarchical` and `auto`
    read the profile; `auto` fits the step's peak (`fixed` + activations) into its budget."""
    name, arg = parse_policy(ac)
    if name == "none":
        return ["none"] * len(blocks)
    if name in ("full", "selective", "offload"):
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


def plan_figures(profile, plan: list, fixed: dict) -> dict:
    """A plan's activation bytes, the step's planned peak and its recompute, from the profile.

    ZeRO-3's gathered weights (`fixed["zero3_gathered"]`, counted in `fixed["backward"]`) are held whole at the
    end of the forward and the start of the backward; as the backward proceeds, the blocks it has finished
    release theirs. At block i's backward the planner counts the share of them that belongs to blocks 0..i,
    which matters where the activations peak late in the backward (a recomputed wide first block: Swin's)."""
    kept = [kept_bytes(p, how) for p, how in zip(profile, plan)]
    gathered, total, so_far, released = fixed.get("zero3_gathered", 0), sum(p.params for p in profile), 0, []
    for p in profile:
        so_far += p.params
        released.append(gathered * (1 - so_far / total) if total else 0)
    result = {"activation_bytes_planned": sum(kept),
              "activation_bytes_none": sum(p.bytes_none for p in profile),
              "activation_bytes_outside_blocks": profile.bytes_outside,
              "activation_peak_planned": activation_peak(profile, plan) + profile.bytes_outside,
              # the step's peak: the activations' on top of what the backward holds, or the optimizer step's
              "fixed_bytes_estimate": fixed["backward"]}
    result["peak_bytes_planned"] = max(fixed["backward"] + activation_peak(profile, plan, released)
                                       + profile.bytes_outside, fixed["optimizer_step"])
    fwd = sum(p.flops for p in profile)
    recompute = sum(recompute_cost(p, how) for p, how in zip(profile, plan))
    result["recompute_flops_fraction"] = recompute / (3 * fwd) if fwd else 0.0  # of forward + backward
    result["recompute_matmul_flops"] = sum(recompute_flops(p, how) for p, how in zip(profile, plan))
    return result


def apply_activation_checkpointing(model, ac: str, device_type: str, profile_images=None, fixed: dict = None,
                                   log=print, profile: Profile = None) -> dict:
    """Wrap the model's blocks per policy `ac`; returns the plan that was applied (for the run directory).

    `profile`: the blocks' profile at the micro-batch, if made already (engine/planner.py, on the meta device);
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
            _wrap(block, how, profile[i].keep if profile is not None else None)
    result = {"ac": ac, "blocks": [{"name": b.name, "stage": b.stage, "policy": how} for b, how in zip(blocks, plan)]}
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
