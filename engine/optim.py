"""AdamW's parameter groups and the learning-rate schedule."""
import math

import torch

from config import Config
from engine import compat

# parameters AdamW must not decay besides every 0-/1-d tensor (norms, biases); names as timm lists them
NO_DECAY_NAMES = ("position_embeddings", "cls_token", "mask_token", "absolute_pos_embed", "relative_position_bias_table")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if compat.param_ndim(p) <= 1 or any(n in name for n in NO_DECAY_NAMES) else decay).append(p)
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
