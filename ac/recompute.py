"""The mechanism of `light` and `selective`: tensors a block's backward reads are not kept but rebuilt, when the
backward reads them, from tensors it keeps anyway.

- `light`: a norm's or activation's output is what the next matmul saves (its input), while the norm and the
  activation save their own inputs: rebuilding the output from that input costs one elementwise kernel and
  holds nothing more.
- `selective`: also a residual sum `x + linear(a)` whose `x` (the block's input) and `a` (the linear's input,
  which the linear saves for its weight's gradient) the block keeps: the linear reruns (ViT's attention
  out-projection), and a norm reading the sum rebuilds its output from the rebuilt sum.

How: forward hooks on the block's norms, activations and linear layers record what they produced; the block's
forward runs under saved-tensor hooks, whose pack replaces a saved tensor that such a recipe rebuilds by the
recipe, and whose unpack runs it once, however many ops saved the tensor. Python runs per saved tensor and per
hooked module's forward, not per operator (torch's selective-checkpoint contexts run a dispatch mode around
every operator, forward and recompute). The same kernel on the same input gives the same bits
(tests/integration/test_checkpointing.py holds every policy bitwise equal to `none` under ZeRO 1-3 and FSDP2). An
input changed in place after the forward is refused at the backward rather than recomputed from the changed
value.
"""
import weakref

import torch
from torch import nn

import compat

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
    backward, or itself rebuilt by a `_Residual`: `source`), and dropped with the last saved tensor that refers
    to it."""
    __slots__ = ("module", "input", "version", "source", "value")

    def __init__(self, module: nn.Module, inp: torch.Tensor, source=None):
        self.module, self.source, self.value = module, source, None
        self.input, self.version = (None, None) if source is not None else (inp, inp._version)

    def recompute(self) -> torch.Tensor:
        if self.value is None:
            if self.source is None and self.input._version != self.version:
                raise RuntimeError(f"ac light/selective: the input of a {type(self.module).__name__} was modified "
                                   f"in place after the forward, so its output cannot be recomputed; use ac full")
            inp = self.input if self.source is None else self.source.recompute()
            with torch.no_grad():
                self.value = self.module.forward(inp)  # the module's own code, without its hooks
        return self.value


class _Residual:
    """A residual sum `anchor + linear(input)`, recomputed at most once from the linear's input and the anchor,
    both kept by the block's backward anyway (the linear's own, which reads its input for the weight's gradient,
    and an earlier op's, which reads the anchor: in ViT and Swin the first norm, whose input is the block's)."""
    __slots__ = ("module", "input", "anchor", "versions", "value")

    def __init__(self, module: nn.Module, inp: torch.Tensor, anchor: torch.Tensor):
        self.module, self.input, self.anchor, self.value = module, inp, anchor, None
        self.versions = (inp._version, anchor._version)

    def recompute(self) -> torch.Tensor:
        if self.value is None:
            if (self.input._version, self.anchor._version) != self.versions:
                raise RuntimeError("ac selective: a residual sum's operand was modified in place after the forward, "
                                   "so the sum cannot be recomputed; use ac full")
            with torch.no_grad():  # the module's own code, without its hooks; addition commutes bit for bit
                self.value = self.module.forward(self.input) + self.anchor
        return self.value


def _key(t: torch.Tensor):
    """The autograd edge that produced `t`: how an op's saved output is recognised as an operand of a later op."""
    return t.grad_fn, t.output_nr


class Recorder:
    """What a block's forward running now produced that its backward can rebuild instead of keeping:

    - `light`: a norm's or activation's output, from its input (kept by that module's own backward);
    - `residual` (with light: `selective`): a residual sum `x + linear(a)` whose `x` and `a` the block keeps
      anyway (its input, and the input a linear reads for its weight's gradient), from those two; the linear
      reruns. A sum through anything else (a dropout that drops, stochastic depth, Swin's window reversal and
      roll) is kept: its operand is no recorded linear's output.

    `match` tells, for a tensor an op saves, which recipe rebuilds it (None: kept as it is); ac/profile.py asks
    the same questions of the profiled forward, so the plan's figures are what the policy keeps."""

    def __init__(self, residual: bool):
        self.residual = residual
        self.storage = compat.storage_id_function()
        self.used = set()  # the linear layers whose outputs made a residual sum this recorder rebuilds
        self.saved = False  # whether the forward running now saved anything for a backward
        self.live = None  # storage -> (output, version, recipe) of the cheap outputs; None outside the forward
        self.linears = {}  # autograd edge of a linear's output -> (linear, its input)
        self.anchors = {}  # autograd edge -> tensor: the block's inputs
        self.kept = set()  # storages the block's backward keeps as they are
        self.sums = {}  # storage -> (the sum, its _Residual) of the residual sums being rebuilt

    def start(self, args):
        self.live, self.linears, self.kept, self.sums, self.saved = {}, {}, set(), {}, False
        self.anchors = {_key(a): a for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}

    def stop(self):
        self.live, self.linears, self.anchors, self.kept, self.sums = None, {}, {}, set(), {}

    def record(self, module, args, output):
        """Forward hook of a cheap module."""
        if self.live is None or not isinstance(output, torch.Tensor) or len(args) != 1 \
                or not isinstance(args[0], torch.Tensor):
            return
        # A norm reading a residual sum that is rebuilt rebuilds its output from the rebuilt sum: holding the
        # sum itself for it would keep what `selective` gives up (ViT's second norm and its residual stream).
        inp, rebuilt = args[0], self.sums.get(self.storage(args[0]))
        source = rebuilt[1] if rebuilt is not None and rebuilt[0]() is inp else None
        self.live[self.storage(output)] = (weakref.ref(output), output._version, _Recipe(module, inp, source))

    def record_linear(self, module, args, output):
        """Forward hook of a linear layer."""
        if self.live is not None and isinstance(output, torch.Tensor) and output.grad_fn is not None and args \
                and isinstance(args[0], torch.Tensor):
            self.linears[_key(output)] = (module, args[0])

    def match(self, t: torch.Tensor):
        """The recipe that rebuilds saved tensor `t`, or None; a tensor kept as it is is remembered as kept."""
        if self.live is None:
            return None
        self.saved = True
        storage = self.storage(t)
        entry = self.live.get(storage)
        if entry is not None:
            ref, version, recipe = entry
            out = ref()  # a freed output's storage may hold a later tensor: only a live output matches
            if out is not None and out._version == version == t._version and t.dtype == out.dtype:
                return recipe
        rebuilt = self.sums.get(storage)
        if rebuilt is not None and rebuilt[0]() is t:
            return rebuilt[1]
        recipe = self._residual(t) if self.residual and self.linears else None
        if recipe is None:
            self.kept.add(storage)
        else:
            self.sums[storage] = (weakref.ref(t), recipe)
        return recipe

    def _residual(self, t: torch.Tensor):
        fn = t.grad_fn
        if fn is None or type(fn).__name__ != "AddBackward0" or getattr(fn, "_saved_alpha", 1) != 1 \
                or t._base is not None:
            return None
        edges = fn.next_functions
        if len(edges) != 2:
            return None
        for linear_edge, anchor_edge in (edges, edges[::-1]):
            linear, anchor = self.linears.get(linear_edge), self.anchors.get(anchor_edge)
            if linear is None or anchor is None:
                continue
            module, inp = linear
            if anchor.shape == t.shape and anchor.dtype == t.dtype and \
                    {self.storage(inp), self.storage(anchor)} <= self.kept:
                self.used.add(module)
                return _Residual(module, inp, anchor)
        return None

    def pack(self, t: torch.Tensor):
        recipe = self.match(t)
        if recipe is None:
            return t
        return recipe, t.size(), t.stride(), t.storage_offset()

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        recipe, size, stride, offset = packed
        return recipe.recompute().as_strided(size, stride, offset)


def recomputable_linears(block: nn.Module) -> list[nn.Module]:
    """The block's linear layers whose rerun is local: torch's `nn.Linear`, not a tensor-parallel layer that
    ends in an all-reduce (ac/profile.py's meta model marks its row-split stand-ins `tp_row`)."""
    return [m for m in block.modules() if isinstance(m, nn.Linear) and not getattr(m, "tp_row", False)]


def wrap_recipes(block: nn.Module, residual: bool):
    """Replace `block`'s instance forward by one that rebuilds its cheap outputs (and, with `residual`, its
    residual sums) in the backward instead of keeping them: `light` and `selective`."""
    recorder = Recorder(residual)
    for module in cheap_modules(block):
        module.register_forward_hook(recorder.record)
    # A hook makes every call of its module take torch's slower path. The block runs the same way every step:
    # after the first forward that saves for a backward, the linear layers that made no rebuilt residual sum
    # (all of ViT's but the attention out-projection, all of Swin's) lose theirs.
    linear_hooks = {m: m.register_forward_hook(recorder.record_linear) for m in recomputable_linears(block)} \
        if residual else {}
    original = block.forward

    def forward(*args, **kwargs):
        recorder.start(args)
        try:
            with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
                return original(*args, **kwargs)
        finally:
            if recorder.saved and linear_hooks:
                for module in [m for m in linear_hooks if m not in recorder.used]:
                    linear_hooks.pop(module).remove()
                if not linear_hooks:
                    recorder.residual = False
            recorder.stop()

    block.forward = forward
