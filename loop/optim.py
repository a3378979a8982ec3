"""What is trained and how: frozen parameters, AdamW's parameter groups (weight decay, layer-wise lr decay) and the
learning-rate schedule."""
import fnmatch
import math

import torch

from config import Config, ConfigError
import compat
from models.blocks import find_blocks
from models.registry import HEAD

# parameters AdamW must not decay besides every 0-/1-d tensor (norms, biases); names as timm lists them
NO_DECAY_NAMES = ("position_embeddings", "cls_token", "mask_token", "absolute_pos_embed", "relative_position_bias_table")


def frozen_names(names: list[str], spec: str) -> set[str]:
    """The parameter names `freeze` selects: "backbone" is every parameter outside the classifier head; otherwise
    comma-separated fnmatch patterns, each of which must match some parameter."""
    if not spec:
        return set()
    if spec == "backbone":
        frozen = {n for n in names if not n.startswith(HEAD + ".")}
        if len(frozen) == len(names):
            raise ConfigError(f"freeze: backbone: the model has no '{HEAD}' head to train")
        return frozen
    frozen = set()
    for pattern in (p.strip() for p in spec.split(",")):
        hits = fnmatch.filter(names, pattern)
        if not hits:
            raise ConfigError(f"freeze: the pattern '{pattern}' names no parameter (they are named like "
                              f"'{names[0]}' and '{names[-1]}')")
        frozen.update(hits)
    if len(frozen) == len(names):
        raise ConfigError(f"freeze: '{spec}' freezes every parameter: nothing would train")
    return frozen


def freeze(model: torch.nn.Module, spec: str) -> int:
    """Stop the gradients of what `spec` selects (`frozen_names`); the number of parameters frozen."""
    frozen = frozen_names([n for n, _ in model.named_parameters()], spec)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return sum(compat.param_numel(p) for n, p in model.named_parameters() if n in frozen)


def layer_ids(model: torch.nn.Module) -> tuple[dict[str, int], int]:
    """({parameter name: layer id}, number of blocks L) for layer-wise lr decay, in forward order: what comes before
    the first block (embeddings) is 0, block i is i + 1, what sits between blocks (Swin's patch merging) goes with
    the next block, and what follows the last block (the final norm, the head) is L + 1."""
    blocks = find_blocks(model)
    ids, current = {}, 0
    owner = {block.name: block.index + 1 for block in blocks}
    for name, _ in model.named_parameters():
        block = next((b for b in owner if name.startswith(b + ".")), None)
        if block is not None:
            current = owner[block]
            ids[name] = current
        else:  # not in a block: 0 before the first, else with the next block, or L + 1 after the last
            ids[name] = 0 if current == 0 else current + 1
    return ids, len(blocks)


def param_groups(model: torch.nn.Module, weight_decay: float, layer_decay: float = 1.0, lr: float = 0.0,
                 layers: tuple[dict, int] | None = None) -> list[dict]:
    """AdamW's groups: decay or not and, with `layer_decay` < 1, one pair per layer whose "lr" is
    lr x layer_decay^(L + 1 - layer id) (`layer_ids`, or `layers`: the whole model's, of which `model` holds a
    pipeline stage), the head's group first (its lr is the one logged)."""
    ids, depth = (layers or layer_ids(model)) if layer_decay < 1 else ({}, 0)
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decays = not (compat.param_ndim(p) <= 1 or any(n in name for n in NO_DECAY_NAMES))
        groups.setdefault((ids.get(name, 0), decays), []).append(p)
    out = []
    for (layer, decays), params in sorted(groups.items(), key=lambda kv: (-kv[0][0], not kv[0][1])):
        group = {"params": params, "weight_decay": weight_decay if decays else 0.0}
        if layer_decay < 1:
            group["lr"] = lr * layer_decay ** (depth + 1 - layer)
        out.append(group)
    return out


def lr_schedule(cfg: Config):
    """Multiplier of the peak lr after `step` optimizer steps: linear warm-up, then cosine to min_lr."""
    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
