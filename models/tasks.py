"""The model of each task, built from the registry's ViT and Swin sizes with transformers' own classes.

    classification  ViTForImageClassification / SwinForImageClassification (models/registry.py)
    mae             ViTMAEForPreTraining (He et al. 2022): the encoder sees the kept patches only, a light
                    decoder predicts the masked ones' normalised pixels; ViT only
    simmim          ViTForMaskedImageModeling / SwinForMaskedImageModeling (Xie et al. 2022): masked patches
                    replaced by a learned token, a linear decoder predicts their pixels
    segmentation    UperNetForSemanticSegmentation over a Swin backbone (Xiao et al. 2018; Liu et al. 2021), or
                    SegformerForSemanticSegmentation (Xie et al. 2021): its own encoder and all-MLP decoder

Every model's blocks are found by structure (models/blocks.py), so the checkpointing policies and the ZeRO
wrapping treat them as a classifier's.
"""
import contextlib
import copy

import torch
import torch.nn.functional as F

from config import ConfigError
from data.masking import masked_inputs
import compat
from models.registry import (NAMES, add_drop_path, init_weights, is_registry, model_config, module_seed,
                             registry_processor)

TASKS = ("classification", "mae", "simmim", "segmentation")
# MAE's decoder for ViT-B and larger (He et al. 2022, Table 1: 8 blocks of width 512, 16 heads); a narrower
# encoder gets a decoder of its own width and heads, half its depth
MAE_DECODER = {"hidden": 512, "depth": 8, "heads": 16}
UPERNET_CHANNELS = 512  # UperNet's pyramid pooling and FPN width in the Swin papers' ADE20K setup


def task_config(name: str, task: str, num_labels: int, image_size: int, patch_size: int = 0, class_names=None,
                drop_path: float = 0.0, mask_ratio: float = 0.75, mask_patch_size: int = 0):
    """(transformers config, model class) of `task` on the registry model `name`; ConfigError for a task the
    model's family does not support, or SimMIM's `mask_patch_size` (0: not checked) that the patches or the
    image do not fit."""
    from transformers import (SwinForImageClassification, SwinForMaskedImageModeling, UperNetConfig,
                              UperNetForSemanticSegmentation, ViTForImageClassification, ViTForMaskedImageModeling,
                              ViTMAEConfig, ViTMAEForPreTraining)

    if task not in TASKS:
        raise ConfigError(f"unknown task '{task}' (one of: {', '.join(TASKS)})")
    if task != "classification" and not is_registry(name):
        raise ConfigError(f"task {task}: a registry model is needed ({', '.join(NAMES)}); '{name}' is not one")
    base = model_config(name, num_labels, image_size, patch_size, class_names, drop_path)
    vit = base.model_type == "vit"
    if task == "classification":
        return base, ViTForImageClassification if vit else SwinForImageClassification
    if task == "mae":
        if not vit:
            raise ConfigError(f"task mae needs a ViT ({name} is a {base.model_type}): MAE's encoder drops the masked "
                              f"patches, which a Swin's windows cannot; pretrain a Swin with task simmim")
        if not 0 < mask_ratio < 1:
            raise ConfigError(f"mask_ratio {mask_ratio} must lie in (0, 1)")
        wide = base.hidden_size >= MAE_DECODER["hidden"]
        hidden = MAE_DECODER["hidden"] if wide else base.hidden_size
        config = ViTMAEConfig(
            hidden_size=base.hidden_size, num_hidden_layers=base.num_hidden_layers,
            num_attention_heads=base.num_attention_heads, intermediate_size=base.intermediate_size,
            image_size=image_size, patch_size=base.patch_size, mask_ratio=mask_ratio, norm_pix_loss=True,
            decoder_hidden_size=hidden, decoder_intermediate_size=4 * hidden,
            decoder_num_hidden_layers=MAE_DECODER["depth"] if wide else max(1, base.num_hidden_layers // 2),
            decoder_num_attention_heads=MAE_DECODER["heads"] if wide else base.num_attention_heads)
        return config, ViTMAEForPreTraining
    if task == "simmim":
        if base.model_type not in ("vit", "swin"):
            raise ConfigError(f"task simmim needs a ViT or a Swin ({name} is a {base.model_type}): transformers has "
                              f"no masked-image model of it")
        if mask_patch_size and (mask_patch_size % base.patch_size or image_size % mask_patch_size):
            raise ConfigError(f"mask_patch_size {mask_patch_size} must be a multiple of the patch size "
                              f"{base.patch_size} and divide image_size {image_size}")
        config = copy.deepcopy(base)
        # the decoder upsamples the last feature map back to pixels by this stride
        config.encoder_stride = base.patch_size if vit else base.patch_size * 2 ** (len(base.depths) - 1)
        return config, ViTForMaskedImageModeling if vit else SwinForMaskedImageModeling
    if vit:
        raise ConfigError(f"task segmentation needs a Swin backbone or a SegFormer ({name} is a ViT, whose "
                          f"single-scale features UperNet cannot use)")
    if base.model_type == "segformer":  # its decoder reads the four stages itself; pixels at 255 are ignored
        from transformers import SegformerForSemanticSegmentation

        return copy.deepcopy(base), SegformerForSemanticSegmentation
    backbone = copy.deepcopy(base)
    backbone.out_features = [f"stage{i + 1}" for i in range(len(base.depths))]
    config = UperNetConfig(backbone_config=backbone.to_dict(), num_labels=num_labels, id2label=base.id2label,
                           label2id=base.label2id, hidden_size=min(UPERNET_CHANNELS, 4 * base.embed_dim),
                           use_auxiliary_head=False)
    return config, UperNetForSemanticSegmentation


def build_task_model(name: str, task: str, num_labels: int, image_size: int, patch_size: int = 0, seed: int = 0,
                     gathered=None, drop_path: float = 0.0, **kwargs):
    """(model, image processor) of `task` on a registry name, its weights from `seed` alone
    (models/registry.init_weights). Under a live ZeRO-3 `HfDeepSpeedConfig` transformers' `_from_config` creates
    every parameter partitioned; `gathered(params)` makes a module's whole while it is initialised."""
    config, cls = task_config(name, task, num_labels, image_size, patch_size, drop_path=drop_path, **kwargs)
    model = cls._from_config(config)
    init_weights(model, seed, gathered)
    if task == "mae":  # the frozen sin-cos tables, which transformers' init leaves at zero
        fixed = [*model.vit.embeddings.parameters(), model.decoder.decoder_pos_embed]
        with (gathered or (lambda params: contextlib.nullcontext()))(fixed), torch.no_grad(), \
                torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, "vit.embeddings"))
            compat.mae_fixed_position_embeddings(model)
    add_drop_path(model, drop_path)
    return model, registry_processor(name, image_size, segmentation=task == "segmentation")


def run_config(cfg):
    """(transformers config, its model's constructor) of a run (a train.py config): a classifier on a registry
    name, a local directory or a hub id, or another task's model on a registry name."""
    from transformers import AutoModelForImageClassification

    if cfg.task == "classification":
        return model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size, drop_path=cfg.drop_path), \
            AutoModelForImageClassification.from_config
    config, cls = task_config(cfg.model, cfg.task, cfg.num_labels, cfg.image_size, cfg.patch_size,
                              drop_path=cfg.drop_path, mask_ratio=cfg.mask_ratio, mask_patch_size=cfg.mask_patch_size)
    return config, cls._from_config


def meta_model(cfg):
    """The model of a run (a train.py config) on the meta device: shapes only, nothing allocated or initialised."""
    config, construct = run_config(cfg)
    with torch.device("meta"):
        model = construct(config)
    add_drop_path(model, cfg.drop_path)  # its masks are saved tensors, which decide where a recompute stops
    return model


def task_loss(model, cfg, images: torch.Tensor, targets: torch.Tensor, step: int, slot: int) -> torch.Tensor:
    """The fp32 loss of `cfg.task` (a train.py config) on one micro-batch, `model` the task's model (or the engine
    wrapping it), `images` in the model's dtype. `targets`: class indices or soft labels (classification), masks
    (segmentation), unused by the pretraining tasks, whose masks come from (seed, step, slot) (data/masking.py).

    - classification: cross-entropy with label smoothing;
    - segmentation: UperNet's own pixel cross-entropy at full size, pixels at IGNORE_INDEX left out;
    - mae, simmim: the model's own loss, MAE's on normalised pixels, SimMIM's L1, on the masked patches only."""
    if cfg.task == "classification":
        return F.cross_entropy(model(images).logits.float(), targets, label_smoothing=cfg.label_smoothing)
    if cfg.task == "segmentation":
        return model(images, labels=targets).loss.float()
    config = model.module.config if hasattr(model, "module") else model.config
    return model(**masked_inputs(cfg, config, images, step, slot)).loss.float()
