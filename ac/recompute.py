"""The `light` policy's mechanism: a block's norm and activation outputs are not kept for the backward but
recomputed from their inputs when the backward reads them.

A norm's or activation's output is what the next matmul saves (its input), while the norm and the activation
save their own inputs anyway: recomputing the output from that input costs one elementwise kernel and holds
nothing more. Unlike `selective` (torch's selective-checkpoint contexts, a Python dispatch mode around every
operator of the block, forward and recompute), this runs Python once per saved tensor of the block and per
cheap module's forward, and the block's matmuls never rerun.

How: forward hooks on the block's cheap modules record each output with the module and its input; the
block's forward runs under saved-tensor hooks, whose pack replaces a saved tensor that is (a view of) such
an output by a recipe, and whose unpack reruns the module's own forward on the same input, once per output
however many ops saved it. The same kernel on the same input gives the same bits (tests/integration/test_checkpointing.py
holds every policy bitwise equal to `none` under ZeRO 1-3). An input or output changed in place after the
forward is refused at the backward rather than recomputed from the changed value.
"""
import weakref

import torch
from torch import nn

from engine import compat

# modules whose output is one elementwise (or per-row) function of their one input, and whose own backward
# saves that input (ReLU and Tanh save their output: recomputing it would hold the input instead, no gain)
CHEAP_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.GELU, nn.SiLU)

HF_ACTIVATIONS = ("GELUActivation", "FastGELUActivation", "NewGELUActivation", "QuickGELUActivation",
                  "SiLUActivation", "PytorchGELUTanh", "GELUTanh")  # transformers.activations (ViT, Swin, SegFormer)


def cheap_modules(block: nn.Module) -> list[nn.Module]:
    """The block's norms and activations (torch's, and transformers' activation classes)."""
    return [m for m in block.modules() if isinstance(m, CHEAP_TYPES) or type(m).__name__ in HF_ACTIVATIONS]


class _Recipe:
    """A cheap module's output, recomputed at most once from its input (kept alive by the module's own
    backward), and dropped with the last saved tensor that refers to it."""
    __slots__ = ("module", "input", "version", "value")

    def __init__(self, module: nn.Module, inp: torch.Tensor):
        self.module, self.input, self.version, self.value = module, inp, inp._version, None

    def recompute(self) -> torch.Tensor:
        if self.value is None:
            if self.input._version != self.version:
                raise RuntimeError(f"ac light: the input of a {type(self.module).__name__} was modified in place "
                                   f"after the forward, so its output cannot be recomputed; use ac selective")
            with torch.no_grad():
                self.value = self.module.forward(self.input)  # the module's own code, without its hooks
        return self.value


class _Outputs:
    """The cheap outputs of the block's forward running now, by storage: (output, its version, recipe)."""

    def __init__(self):
        self.live = None  # None outside the block's forward

    def record(self, module, args, output):
        if self.live is None or not isinstance(output, torch.Tensor) or len(args) != 1 \
                or not isinstance(args[0], torch.Tensor):
            return
        self.live[compat.storage_id(output)] = (weakref.ref(output), output._version, _Recipe(module, args[0]))

    def pack(self, t: torch.Tensor):
        entry = self.live.get(compat.storage_id(t)) if self.live is not None else None
        if entry is None:
            return t
        ref, version, recipe = entry
        out = ref()  # a freed output's storage may hold a later tensor: only a live output matches
        if out is None or out._version != version or t._version != version or t.dtype != out.dtype:
            return t
        return recipe, t.size(), t.stride(), t.storage_offset()

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        recipe, size, stride, offset = packed
        return recipe.recompute().as_strided(size, stride, offset)


def wrap_light(block: nn.Module):
    """Replace `block`'s instance forward by one that recomputes its cheap outputs in the backward."""
    outputs = _Outputs()
    for module in cheap_modules(block):
        module.register_forward_hook(outputs.record)
    original = block.forward

    def forward(*args, **kwargs):
        outputs.live = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(outputs.pack, outputs.unpack):
                return original(*args, **kwargs)
        finally:
            outputs.live = None

    block.forward = forward
