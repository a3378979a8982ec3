"""The masks of masked-image pretraining, a function of (seed, step, slot) alone.

A micro-batch is identified by the optimizer step and its slot in the step (data/loader.py: slot = rank x
grad_accum_steps + micro), so a run resumed at a step, or on another number of ranks with the same slots,
masks the same patches of the same images as the uninterrupted run.

- MAE (He et al. 2022): transformers' ViTMAE keeps the patches of lowest `noise`; `mae_noise` gives it the
  noise, uniform in [0, 1) per patch.
- SimMIM (Xie et al. 2022): square blocks of `mask_patch_size` pixels (a multiple of the model's patch) masked
  at random, exactly round(ratio x blocks) of them per image; `simmim_mask` gives the per-patch boolean mask
  (bool_masked_pos) that transformers' ViT and Swin masked-image models take.
"""
import hashlib

import torch


def _generator(*parts) -> torch.Generator:
    seed = int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") % 2**63
    return torch.Generator().manual_seed(seed)


def mae_noise(seed: int, step: int, slot: int, batch: int, patches: int) -> torch.Tensor:
    """(batch, patches) float32 in [0, 1): MAE's per-patch noise for micro-batch (step, slot), on the CPU."""
    return torch.rand(batch, patches, generator=_generator(seed, "mae", step, slot))


def simmim_mask(seed: int, step: int, slot: int, batch: int, image_size: int, patch_size: int,
                mask_patch_size: int, ratio: float) -> torch.Tensor:
    """(batch, (image_size / patch_size)^2) bool: SimMIM's mask for micro-batch (step, slot), True where a patch is
    masked; blocks of mask_patch_size pixels are masked whole."""
    if mask_patch_size % patch_size or image_size % mask_patch_size:
        raise ValueError(f"mask_patch_size {mask_patch_size} must be a multiple of the patch size {patch_size} and "
                         f"divide image_size {image_size}")
    blocks, scale = image_size // mask_patch_size, mask_patch_size // patch_size
    count = round(ratio * blocks * blocks)
    order = torch.rand(batch, blocks * blocks, generator=_generator(seed, "simmim", step, slot)).argsort(dim=1)
    masked = torch.zeros(batch, blocks * blocks, dtype=torch.bool)
    masked.scatter_(1, order[:, :count], True)
    grid = masked.view(batch, blocks, blocks).repeat_interleave(scale, 1).repeat_interleave(scale, 2)
    return grid.reshape(batch, -1)


def masked_inputs(cfg, config, images: torch.Tensor, step: int, slot: int) -> dict:
    """The model's keyword inputs for `cfg.task` (a train.py config) on `images` (B, 3, H, W): with MAE's noise or
    SimMIM's mask of micro-batch (step, slot), on the images' device. `config`: the model's transformers config."""
    batch, side = len(images), images.shape[-1]
    if cfg.task == "mae":
        noise = mae_noise(cfg.seed, step, slot, batch, (side // config.patch_size) ** 2)
        return {"pixel_values": images, "noise": _to_device(noise, images.device)}
    if cfg.task == "simmim":
        mask = simmim_mask(cfg.seed, step, slot, batch, side, config.patch_size, cfg.mask_patch_size, cfg.mask_ratio)
        return {"pixel_values": images, "bool_masked_pos": _to_device(mask, images.device)}
    return {"pixel_values": images}


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without waiting for it: a copy to a GPU from pageable memory first synchronises the
    stream, one from pinned memory is queued behind the step's kernels."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
