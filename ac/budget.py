"""Plans from a profile: the activation bytes and recompute of each block under none, selective and full, the step's
activation peak under a plan, and the plan with the least recompute that fits a budget (`auto`)."""
from ac.profile import BlockProfile
from config import ConfigError


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
    return {"selective": p.bytes_selective, "full": p.bytes_full, "light": p.bytes_light}.get(how, p.bytes_none)


def recompute_flops(p: BlockProfile, how: str) -> int:
    """Matmul and attention FLOPs the backward repeats for block `p` under `how` (what torch's counter sees)."""
    return {"selective": p.flops_selective, "full": p.flops_full}.get(how, 0)


def recompute_elems(p: BlockProfile, how: str) -> int:
    """Elements the backward's recompute of block `p` produces outside the matmuls under `how`."""
    return {"full": p.cheap_elems, "selective": p.selective_elems, "light": p.light_elems}.get(how, 0)


def recompute_cost(p: BlockProfile, how: str) -> int:
    """Work the backward repeats for block `p` under `how`: FLOPs, plus one per element of the cheap ops."""
    return recompute_flops(p, how) + recompute_elems(p, how)


def activation_peak(profile: list[BlockProfile], plan: list, released: list | None = None) -> int:
    """Activation bytes at the step's highest point under `plan`: the end of the forward (every block's kept
    bytes), or some block's backward, which holds its gradients and, if the block is recomputed, all it
    would have saved, while the blocks before it still hold theirs (the blocks after it are done and freed);
    under `light` and `selective` the recipes rebuild one tensor at a time, as each backward op reads it, and the
    block holds what it kept.
    `released[i]`: other bytes freed by the time block i's backward runs, taken off that moment. The backward
    begins outside the blocks (the head's), with every block's kept bytes held (Profile.grad_outside)."""
    kept = [kept_bytes(p, how) for p, how in zip(profile, plan)]
    peak, before = sum(kept) + getattr(profile, "grad_outside", 0), 0
    for i, (p, how, k) in enumerate(zip(profile, plan, kept)):
        held = p.bytes_none if how == "full" else k
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
