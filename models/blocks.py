"""Find the transformer blocks of a model by its structure, not by attribute paths.

Attribute paths move between transformers versions (`vit.encoder.layer`, `swin.encoder.layers[i].blocks`,
...). A block is what every model of this family repeats: an element of an `nn.ModuleList` that holds
an attention module and holds no smaller such element itself. Wrapping and activation checkpointing
find blocks through here only.
"""
from dataclasses import dataclass

from torch import nn


@dataclass
class Block:
    name: str  # qualified module name, e.g. "vit.encoder.layer.3"
    module: nn.Module
    stage: int  # index of the ModuleList the block sits in: 0 for ViT, the stage for Swin
    index: int  # position in forward order over the whole model


def _has_attention(module: nn.Module) -> bool:
    return any("attention" in type(m).__name__.lower() or name.rsplit(".", 1)[-1] in ("attn", "attention")
               for name, m in module.named_modules())


def find_blocks(model: nn.Module) -> list[Block]:
    candidates = []  # (name, module, list name) in registration order, which is forward order here
    for list_name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            for i, child in enumerate(mod):
                if _has_attention(child):
                    candidates.append((f"{list_name}.{i}" if list_name else str(i), child, list_name))
    names = [c[0] for c in candidates]
    # keep the innermost: a Swin stage holds blocks, so the stage itself is not a block
    inner = [c for c in candidates if not any(n.startswith(c[0] + ".") for n in names)]
    stages = list(dict.fromkeys(c[2] for c in inner))
    return [Block(name, module, stages.index(list_name), i) for i, (name, module, list_name) in enumerate(inner)]
