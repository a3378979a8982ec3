"""Named ViT, Swin and SegFormer sizes, built from config with random init, or pretrained weights from a local
Hugging Face directory or a hub model id (fetched by transformers into its cache when the hub can be reached).
"""
import contextlib
import copy
import hashlib
import json
import os
import re
import socket
from urllib.parse import urlparse

import torch
from torch import nn
from transformers import (AutoConfig, AutoImageProcessor, AutoModelForImageClassification, SegformerConfig,
                          SegformerForImageClassification, SwinConfig, SwinForImageClassification, ViTConfig,
                          ViTForImageClassification, ViTImageProcessorPil)

import compat

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# name: (hidden, depth, heads, mlp, patch). Sizes follow Dosovitskiy et al. 2021 (Ti/S from DeiT),
# ViT-g/14 from Zhai et al. 2022 and ViT-22B from Dehghani et al. 2023 (its shape only: HF's ViT
# block keeps the serial attention/MLP layout and biases).
VIT_SIZES = {
    "vit-debug": (32, 2, 2, 64, 2),  # the tiny model every integration test uses
    "vit-digits": (96, 6, 4, 192, 2),  # the main job: small enough for 900 CPU steps in minutes
    # ViT-L's depth at a width of 64: a step is almost all Python, dispatch and collectives (the host-overhead
    # benchmark), the per-block work that starves a GPU at ViT-L scale
    "vit-narrow": (64, 24, 2, 256, 4),
    "vit-tiny": (192, 12, 3, 768, 16),
    "vit-small": (384, 12, 6, 1536, 16),
    "vit-base": (768, 12, 12, 3072, 16),
    "vit-large": (1024, 24, 16, 4096, 16),
    "vit-huge": (1280, 32, 16, 5120, 14),
    "vit-giant": (1408, 40, 16, 6144, 14),
    "vit-22b": (6144, 48, 48, 24576, 14),
}
# name: (embed_dim, depths, heads, window, patch), from Liu et al. 2021.
SWIN_SIZES = {
    "swin-debug": (16, (1, 1), (1, 2), 4, 2),
    # two stages of 16x16 and 8x8 tokens on the 32x32 digits-seg canvases: the segmentation default
    "swin-digits": (48, (2, 2), (3, 6), 4, 2),
    "swin-tiny": (96, (2, 2, 6, 2), (3, 6, 12, 24), 7, 4),
    "swin-small": (96, (2, 2, 18, 2), (3, 6, 12, 24), 7, 4),
    "swin-base": (128, (2, 2, 18, 2), (4, 8, 16, 32), 7, 4),
    "swin-large": (192, (2, 2, 18, 2), (6, 12, 24, 48), 7, 4),
    # Swin-T's widths, depths and heads with 4x4 windows: at 128x128 its stages are 32, 16, 8 and 4
    # tokens wide, the CPU-sized Swin-T of the benchmark suite (7x7 windows need 224x224)
    "swin-tiny-w4": (96, (2, 2, 6, 2), (3, 6, 12, 24), 4, 4),
}
# name: (hidden sizes, depths, heads, decoder width): SegFormer's Mix Transformer encoders MiT-B0 to B5 and their
# all-MLP decoder (Xie et al. 2021, Table 6), four stages at 1/4 to 1/32 of the image, each stage's attention on
# keys and values reduced 8, 4, 2 and 1 times
SEGFORMER_SIZES = {
    "segformer-debug": ((8, 16, 24, 32), (1, 1, 1, 1), (1, 1, 1, 2), 32),
    "segformer-b0": ((32, 64, 160, 256), (2, 2, 2, 2), (1, 2, 5, 8), 256),
    "segformer-b1": ((64, 128, 320, 512), (2, 2, 2, 2), (1, 2, 5, 8), 256),
    "segformer-b2": ((64, 128, 320, 512), (3, 4, 6, 3), (1, 2, 5, 8), 768),
    "segformer-b3": ((64, 128, 320, 512), (3, 4, 18, 3), (1, 2, 5, 8), 768),
    "segformer-b4": ((64, 128, 320, 512), (3, 8, 27, 3), (1, 2, 5, 8), 768),
    "segformer-b5": ((64, 128, 320, 512), (3, 6, 40, 3), (1, 2, 5, 8), 768),
}
NAMES = (*VIT_SIZES, *SWIN_SIZES, *SEGFORMER_SIZES)
# generated ViT sizes, `vit-w<hidden>-d<depth>`: 64-wide heads (32 below 64), MLP 4x the width, patch 2 (the
# scaling-law grid of benchmarks/scaling.py; any width divisible by its heads)
GENERATED_VIT = re.compile(r"vit-w(\d+)-d(\d+)$")


def vit_size(name: str):
    """(hidden, depth, heads, mlp, patch) of a ViT registry name or a generated `vit-w<W>-d<D>`; None otherwise."""
    if name in VIT_SIZES:
        return VIT_SIZES[name]
    m = GENERATED_VIT.match(name)
    if not m:
        return None
    hidden, depth = int(m.group(1)), int(m.group(2))
    head_dim = 64 if hidden >= 64 else 32
    if hidden < 8 or depth < 1 or hidden % min(head_dim, hidden):
        raise ValueError(f"model {name}: a generated ViT needs a width of at least 8, a multiple of {head_dim}, and "
                         f"a depth of at least 1")
    return hidden, depth, max(1, hidden // head_dim), 4 * hidden, 2


def is_registry(name: str) -> bool:
    """A registry name: built from the seed, not loaded (the named sizes and the generated ViTs)."""
    return name in NAMES or bool(GENERATED_VIT.match(name))
CLASSIFIERS = {"vit": ViTForImageClassification, "swin": SwinForImageClassification,
               "segformer": SegformerForImageClassification}
HEAD = "classifier"  # the classification head of transformers' ViT and Swin: what `freeze: backbone` trains
HUB_TIMEOUT_S = 5.0  # the hub's reachability probe; transformers itself retries an unreachable hub with back-off


def model_config(name: str, num_labels: int, image_size: int, patch_size: int = 0, class_names=None,
                 drop_path: float = 0.0):
    """The transformers config for a registry name, a local directory or a hub id (no weights touched)."""
    labels = list(class_names) if class_names else [str(i) for i in range(num_labels)]
    label_args = dict(num_labels=num_labels, id2label=dict(enumerate(labels)),
                      label2id={n: i for i, n in enumerate(labels)})
    if vit_size(name):
        hidden, depth, heads, mlp, patch = vit_size(name)
        config = ViTConfig(hidden_size=hidden, num_hidden_layers=depth, num_attention_heads=heads,
                           intermediate_size=mlp, image_size=image_size, patch_size=patch_size or patch,
                           **label_args)
        _check_vit_patches(config)
        return config
    if name in SWIN_SIZES:
        dim, depths, heads, window, patch = SWIN_SIZES[name]
        config = SwinConfig(embed_dim=dim, depths=list(depths), num_heads=list(heads), window_size=window,
                            image_size=image_size, patch_size=patch_size or patch, drop_path_rate=drop_path,
                            **label_args)
        _check_swin_stages(config)
        return config
    if name in SEGFORMER_SIZES:
        if patch_size:
            raise ValueError(f"patch_size {patch_size}: {name}'s patch embeddings are fixed (7x7 at stride 4, then "
                             f"3x3 at stride 2 per stage); leave patch_size 0")
        hidden, depths, heads, decoder = SEGFORMER_SIZES[name]
        config = SegformerConfig(hidden_sizes=list(hidden), depths=list(depths), num_attention_heads=list(heads),
                                 decoder_hidden_size=decoder, drop_path_rate=drop_path, **label_args)
        _check_segformer_stages(config, image_size)
        return config
    overrides = dict(id2label=label_args["id2label"], label2id=label_args["label2id"], image_size=image_size)
    if patch_size:
        overrides["patch_size"] = patch_size
    config = pretrained_config(name, **overrides)
    if config.model_type == "swin":
        config.drop_path_rate = drop_path
        _check_swin_stages(config)
    elif config.model_type == "segformer":
        config.drop_path_rate = drop_path
        _check_segformer_stages(config, image_size)
    elif config.model_type == "vit":
        _check_vit_patches(config)
    return config


def width(config) -> int:
    """A model's hidden size, the widest stage's for SegFormer (whose config lists one per stage): what DeepSpeed's
    bucket sizes are derived from (engine/ds_config.py)."""
    sizes = getattr(config, "hidden_sizes", None)
    return max(sizes) if sizes else config.hidden_size


def check_weight_files(model_dir: str):
    """ValueError naming the first unreadable safetensors file of a local model directory and what is wrong with
    it: a header that does not parse, or tensors past the end of a truncated file. Reads headers only."""
    import struct

    for file in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        path = os.path.join(model_dir, file)
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"its header claims {n} bytes and the file holds {size}")
                header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"model: {path} is not a readable safetensors file ({e}): copy it again") from None
        if 8 + n + end > size:
            raise ValueError(f"model: {path} is truncated: its tensors end at byte {8 + n + end:,} and the file holds "
                             f"{size:,}: copy it again")


def pretrained_config(name: str, **overrides):
    """The config of a local Hugging Face directory, or of a hub model id: from transformers' cache, or fetched
    when the hub answers. Anything else is one ValueError saying what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    if os.path.isfile(os.path.join(name, "config.json")):
        return AutoConfig.from_pretrained(name, **overrides)
    unknown = f"unknown model '{name}': not a registry name ({', '.join(NAMES)}, or a generated vit-w<W>-d<D>), nor a local directory holding " \
              f"config.json"
    if os.path.exists(name):
        raise ValueError(f"{unknown}: '{name}' exists but holds no config.json")
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True, **overrides)  # cached by an earlier run
    except HFValidationError:
        raise ValueError(f"{unknown}, nor a valid hub id") from None
    except OSError:
        pass
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=HUB_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(f"{unknown}; as a hub id it is not in the local cache and {endpoint.hostname} cannot be "
                         f"reached ({e.strerror or e}): download it where there is network (`hf download {name} "
                         f"--local-dir DIR`) and set model to DIR") from None
    try:
        return AutoConfig.from_pretrained(name, **overrides)
    except OSError as e:
        raise ValueError(f"{unknown}, and the hub has no model '{name}' ({str(e).splitlines()[0]})") from None


def _check_vit_patches(config):
    """ViT's patch embedding is a strided convolution: it silently drops the pixels past the last whole patch."""
    left = config.image_size % config.patch_size
    if left:
        lower = config.image_size - left
        raise ValueError(f"image_size {config.image_size} is not a multiple of patch_size {config.patch_size}: the "
                         f"last {left} pixel row(s) and column(s) would be dropped; use image_size {lower} or "
                         f"{lower + config.patch_size}")


def _check_swin_stages(config):
    """transformers 5.24's Swin shrinks the window of a stage smaller than it, but keeps the relative
    position table of the full window, and the forward fails with a shape error: refuse it here."""
    sides = [config.image_size // config.patch_size // 2**i for i in range(len(config.depths))]
    if min(sides) < config.window_size:
        raise ValueError(f"Swin with image_size {config.image_size}, patch_size {config.patch_size} has stages "
                         f"{'/'.join(map(str, sides))} tokens wide, and the last is narrower than its "
                         f"{config.window_size}x{config.window_size} window: use image_size >= "
                         f"{config.patch_size * 2 ** (len(config.depths) - 1) * config.window_size}")


def _check_segformer_stages(config, image_size: int):
    """SegFormer's attention reduces a stage's keys and values with a convolution of kernel and stride
    sr_ratios[i]: a stage fewer tokens wide than that fails inside the forward."""
    side = image_size
    for i, (stride, ratio) in enumerate(zip(config.strides, config.sr_ratios)):
        side = -(-side // stride)  # the overlapping patch embedding pads: ceil(side / stride)
        if side < ratio:
            raise ValueError(f"image_size {image_size}: SegFormer's stage {i + 1} is {side} tokens wide, narrower "
                             f"than the {ratio}x{ratio} reduction of its attention; use image_size >= 32")


def module_seed(seed: int, name: str) -> int:
    """The RNG seed of one module's initial weights: the run's seed and the module's name, nothing else."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") % 2**63


def init_weights(model, seed: int, gathered=None):
    """Initialise every module with Hugging Face's own scheme, each from a generator seeded by `module_seed`.

    The weights then depend on the seed alone: not on the order modules are built in, the RNG's state, the
    world size, or whether the parameters are partitioned. `gathered(params)`: a context in which a module's
    parameters are whole (ZeRO-3's partitioned ones are gathered there; every rank computes the same values).
    A module with parameters of its own is initialised with its children's gathered too: some initialise them
    (ViTMAE's embeddings set their patch projection).
    """
    gathered = gathered or (lambda params: contextlib.nullcontext())
    for name, module in model.named_modules():
        if not list(module.parameters(recurse=False)):
            continue
        with gathered(list(module.parameters())), torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(seed, name))
            compat.hf_init_module(model, module)


class DropPath(nn.Module):
    """A ViT block's residual-branch dropout followed by stochastic depth (Huang et al. 2016): in training, each
    sample's branch is dropped with probability `rate` and the kept ones are scaled by 1 / (1 - rate).
    transformers' ViT block applies its `dropout` to both branches just before each residual add, so this
    module in its place drops each branch on its own draw, as timm's DropPath does."""

    def __init__(self, dropout: nn.Dropout, rate: float):
        super().__init__()
        self.dropout, self.rate = dropout, rate

    def forward(self, x):
        x = self.dropout(x)
        if not self.training or self.rate == 0:
            return x
        keep = 1 - self.rate
        mask = torch.empty((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self):
        return f"rate={self.rate:g}"


def add_drop_path(model, rate: float):
    """Stochastic depth for transformers' ViT, which has none: block i of L drops at rate * i / (L - 1), the
    linear rule of DeiT and of transformers' own Swin (which `model_config` sets through its config)."""
    from models.blocks import find_blocks

    if not rate or model.config.model_type != "vit":
        return
    blocks = find_blocks(model)
    for block in blocks:
        if not isinstance(getattr(block.module, "dropout", None), nn.Dropout):
            raise ValueError(f"drop_path: {type(block.module).__name__} has no residual dropout to extend")
        block.module.dropout = DropPath(block.module.dropout, rate * block.index / max(1, len(blocks) - 1))


def registry_processor(name: str, image_size: int, segmentation: bool = False):
    """The image processor of a registry model: resize to `image_size`, then mean 0.5 and std 0.5 for a ViT (as
    Google's checkpoints), ImageNet's mean and std for a Swin and a SegFormer (as their authors').
    `segmentation`: SegFormer's processor, the one transformers' UperNet checkpoints use, whose post-processing
    turns logits into label maps (pipeline("image-segmentation"))."""
    mean, std = ((0.5,) * 3, (0.5,) * 3) if vit_size(name) else (IMAGENET_MEAN, IMAGENET_STD)
    if segmentation:
        from transformers import SegformerImageProcessorPil

        return SegformerImageProcessorPil(size={"height": image_size, "width": image_size}, image_mean=list(mean),
                                          image_std=list(std), do_reduce_labels=False)
    return ViTImageProcessorPil(size={"height": image_size, "width": image_size}, image_mean=list(mean),
                                image_std=list(std))


def _side(config) -> int:
    size = config.image_size
    return size if isinstance(size, int) else size[0]


def resample_position_embeddings(table: torch.Tensor, side: int) -> torch.Tensor:
    """A ViT's (1, 1 + n*n, dim) position embeddings (the class token's first) for a side x side grid of patches:
    the grid resized bicubically (align_corners False, as transformers' `interpolate_pos_encoding` and MAE's and
    DeiT's fine-tuning code do), the class token's entry kept."""
    old = round((table.shape[1] - 1) ** 0.5)
    if old * old != table.shape[1] - 1:
        raise ValueError(f"position embeddings of {table.shape[1] - 1} patches are not a square grid")
    if old == side:
        return table
    dim = table.shape[-1]
    grid = table[:, 1:].float().reshape(1, old, old, dim).permute(0, 3, 1, 2)
    grid = torch.nn.functional.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False)
    return torch.cat([table[:, :1].float(), grid.permute(0, 2, 3, 1).reshape(1, side * side, dim)],
                     dim=1).to(table.dtype)


def resampled_weights(name: str, side: int) -> dict:
    """A pretrained ViT's weights (a local directory, or a hub id's cached copy; safetensors) with every position
    embedding table resampled to side x side patches: what transformers loads into a model built at the new image
    size (under ZeRO-3 too, partitioned as it loads)."""
    import glob

    from safetensors.torch import load_file

    folder = name if os.path.isdir(name) else None
    if folder is None:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name, local_files_only=True)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"model '{name}': fine-tuning at another image size reads its safetensors weights, and "
                         f"{folder} holds none (convert it with save_pretrained)")
    weights = {}
    for file in files:
        weights.update(load_file(file))
    for key in [k for k in weights if k.endswith("embeddings.position_embeddings")]:
        weights[key] = resample_position_embeddings(weights[key], side)
    return weights


def build_model(name: str, num_labels: int, image_size: int, patch_size: int = 0, class_names=None, seed: int = 0,
                gathered=None, partitioned=None, drop_path: float = 0.0, log=None):
    """(model, image_processor). Registry names: initial weights from `seed` alone (`init_weights`); local
    directories and hub ids: their weights, with a new classifier head (from `seed`, logged) when the label count
    differs or the directory holds a backbone without one. Built through transformers' `_from_config` /
    `from_pretrained`, which create every parameter partitioned when a ZeRO-3 `HfDeepSpeedConfig` is alive
    (engine/parallelize.py); `partitioned()`: the context that does the same for a module created here (a new
    head). transformers' ZeRO-3 loader cannot skip a head
    of another shape, so a pretrained model loads with its own head, which is then replaced."""
    config = model_config(name, num_labels, image_size, patch_size, class_names, drop_path)
    if is_registry(name):
        model = CLASSIFIERS[config.model_type]._from_config(config)
        init_weights(model, seed, gathered)
        processor = registry_processor(name, image_size)
    else:
        before = pretrained_config(name)  # the directory's own labels, or the cached hub copy's
        # a backbone (a ViTModel, such as train.py's MAE encoder/) has no classifier: transformers adds one, replaced
        backbone = bool(before.architectures) and not any(a.endswith("ForImageClassification")
                                                          for a in before.architectures)
        load_config = config
        if before.num_labels != num_labels:  # loaded with its own head, which is then replaced
            load_config = copy.deepcopy(config)
            load_config.update(dict(id2label=before.id2label, label2id=before.label2id))
        weights = {}
        if before.model_type == "vit" and _side(before) != _side(config):  # fine-tuning at another resolution
            weights = dict(state_dict=resampled_weights(name, _side(config) // config.patch_size))
            if log:
                log(f"model: {name} was trained at {_side(before)}px; its position embeddings are resampled "
                    f"(bicubic) to {_side(config)}px's {_side(config) // config.patch_size}x"
                    f"{_side(config) // config.patch_size} patches")
        if weights:
            model = ViTForImageClassification.from_pretrained(None, config=load_config, dtype=torch.float32, **weights)
        else:
            model = AutoModelForImageClassification.from_pretrained(name, config=load_config, dtype=torch.float32)
        if before.num_labels != num_labels or backbone:
            old = model.get_submodule(HEAD)
            with (partitioned or contextlib.nullcontext)():  # under ZeRO-3, created partitioned
                head = nn.Linear(old.in_features, num_labels)
            setattr(model, HEAD, head)
            model.config.update(dict(id2label=config.id2label, label2id=config.label2id))
            model.num_labels = num_labels
            with (gathered or (lambda p: contextlib.nullcontext()))(list(head.parameters())), torch.no_grad(), \
                    torch.random.fork_rng(devices=[]):  # from the seed, as a registry model's weights are
                torch.manual_seed(module_seed(seed, HEAD))
                compat.hf_init_module(model, head)
            if log:
                log(f"model: {name} is a {before.architectures[0]} without a classifier; its head is initialised for "
                    f"{num_labels} classes" if backbone else f"model: {name} has {before.num_labels} classes; its "
                    f"classifier head is re-initialised for {num_labels}")
        try:
            processor = AutoImageProcessor.from_pretrained(name)
            processor.size = {"height": image_size, "width": image_size}
        except OSError:
            processor = ViTImageProcessorPil(size={"height": image_size, "width": image_size})
    add_drop_path(model, drop_path)
    return model, processor
