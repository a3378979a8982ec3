"""What each transformer block saves for the backward and computes, from one forward under a dispatch-mode
recorder and saved-tensor hooks (on the meta device for a plan, or on the real model): the figures every
checkpointing plan and the planner's memory and step time are read from."""
from dataclasses import dataclass, replace

import torch

from ac.recompute import Recorder, _Residual, cheap_modules, recomputable_linears
import compat
from parallel.tensor import shard_like_autotp
from models.blocks import find_blocks
from models.tasks import meta_model

aten = torch.ops.aten
UNSAFE_VIEW = compat.internal_copy_and_view_ops()[1]
# outputs worth keeping: the ops that hold the FLOPs
COMPUTE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
               *compat.attention_kernels()}
LINEAR_OPS = (aten.mm.default, aten.addmm.default)  # what an nn.Linear reaches the dispatcher as
PROFILE_BATCH = 2  # images the one-batch profile runs; its figures are scaled to the micro-batch


@dataclass
class BlockProfile:
    name: str
    stage: int
    bytes_none: int  # saved-for-backward bytes with every activation kept
    bytes_selective: int  # `light`'s, without the residual sums `selective` rebuilds (ac/recompute.py)
    bytes_full: int  # the block input only
    flops: int  # forward FLOPs (matmuls, attention)
    # What `full`'s recompute repeats. It stops at the block's last saved tensor (non-reentrant checkpointing's
    # early stop), so the ops after it (the MLP's last matmul, its residual add) never rerun.
    flops_full: int  # compute-op FLOPs before the last saved tensor
    flops_selective: int  # the FLOPs of the linear layers `selective` reruns to rebuild residual sums
    cheap_elems: int  # elements produced by the other ops before the last saved tensor: rerun by `full`
    # what the block's backward holds beside the saved activations: the gradients of its largest matmul output
    # and of its input
    bytes_grad: int = 0
    params: int = 0  # the block's own parameters (not scaled with the batch)
    # `light`: the saved bytes without the norms' and activations' outputs, and those outputs' elements, which
    # its backward recomputes (ac/recompute.py)
    bytes_light: int = 0
    light_elems: int = 0
    selective_elems: int = 0  # elements `selective` recomputes: `light`'s and the residual sums'
    ops: int = 0  # operators the block's forward dispatches, views excepted (not scaled with the batch)
    moved: int = 0  # bytes its memory-bound operators read and write
    # the positions, among the mm/addmm operators of the block's forward in order, of the linear layers whose
    # residual sums `selective` rebuilds: its operator policy under torch.compile (ac/policies.py)
    rerun_linears: tuple = ()

    def scaled(self, factor: float) -> "BlockProfile":
        """The profile of a batch `factor` times larger: every saved activation, FLOP and element of a ViT
        or Swin block is proportional to the batch (the weights, which are not, are not counted)."""
        return BlockProfile(self.name, self.stage, round(self.bytes_none * factor), round(self.bytes_selective * factor),
                            round(self.bytes_full * factor), round(self.flops * factor), round(self.flops_full * factor),
                            round(self.flops_selective * factor), round(self.cheap_elems * factor),
                            round(self.bytes_grad * factor), self.params, round(self.bytes_light * factor),
                            round(self.light_elems * factor), round(self.selective_elems * factor), self.ops,
                            round(self.moved * factor), self.rerun_linears)


# ops that move no data: a view, or metadata only
VIEW_OPS = (aten.view, UNSAFE_VIEW, aten.t, aten.transpose, aten.permute, aten.expand, aten.reshape, aten.detach,
            aten.slice, aten.select)


class _OpRecorder(compat.dispatch_mode_class()):
    """Bytes of compute-op outputs and element counts of the other ops, per active block."""

    def __init__(self):
        super().__init__()
        self.block, self.compute_outputs, self.cheap_ops, self.packs, self.ops = None, {}, {}, {}, 0
        self.moved = 0  # bytes the memory-bound ops (all but the compute ops and views) read and write
        self.ops_in, self.moved_in = {}, {}  # the same two, per block
        self.linear_ops = {}  # block -> the storages of its mm/addmm outputs, in forward order
        # Outputs are matched to saved tensors by storage; holding them for the profile's forward keeps a freed
        # output's storage from being reused by a later saved tensor, which would mark an unsaved output as saved.
        self.alive = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += not func.is_view
        self.ops_in[self.block] = self.ops_in.get(self.block, 0) + (not func.is_view)
        moves_data = not func.is_view and compat.op_packet(func) not in VIEW_OPS
        if func not in COMPUTE_OPS and moves_data:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            ins = [a for arg in args for a in (arg if isinstance(arg, (tuple, list)) else (arg,))]
            moved = sum(t.numel() * t.element_size() for t in (*ins, *outs) if isinstance(t, torch.Tensor))
            self.moved += moved
            self.moved_in[self.block] = self.moved_in.get(self.block, 0) + moved
        if self.block is not None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            tensors = [t for t in outs if isinstance(t, torch.Tensor)]
            packs = self.packs.get(self.block, 0)  # tensors the block saved before this op ran
            if func in LINEAR_OPS:
                self.linear_ops.setdefault(self.block, []).append(compat.storage_id(tensors[0]))
            if func in COMPUTE_OPS:
                storage = tensors[0].untyped_storage()
                flops = compat.flop_count(func, args, kwargs or {}, out)
                self.compute_outputs.setdefault(self.block, []).append((storage.nbytes(), flops, packs))
            elif compat.op_packet(func) not in VIEW_OPS:
                self.cheap_ops.setdefault(self.block, []).append((sum(t.numel() for t in tensors), packs))
        return out


class Profile(list):
    """The blocks' profiles, in forward order, and the activation bytes saved outside any block (the stem,
    Swin's patch merging, the final norm and head), which no policy changes; the whole forward's FLOPs, and the
    operators it dispatches (views excepted: each of the others is at least one kernel launch on a GPU), and the
    bytes its memory-bound operators (norms, activations, softmax, adds, copies) read and write. `grad_outside`:
    what the backward of the layers outside the blocks (the head's, first in the backward) holds beside the
    activations, counted as one gradient the size of the largest tensor saved there (a segmentation decoder's
    fused features): an approximation, checked against measured steps by benchmarks/task_memory.py."""
    bytes_outside: int = 0
    grad_outside: int = 0
    forward_flops: int = 0
    ops: int = 0
    moved_bytes: int = 0

    def scaled(self, factor: float) -> "Profile":
        out = Profile(p.scaled(factor) for p in self)
        out.bytes_outside = round(self.bytes_outside * factor)
        out.grad_outside = round(self.grad_outside * factor)
        out.forward_flops, out.ops = round(self.forward_flops * factor), self.ops
        out.moved_bytes = round(self.moved_bytes * factor)
        return out

    def stage_share(self, names: list[str]) -> "Profile":
        """The blocks `names` of a pipeline stage (parallel/pipeline.py), at the micro-batch; what sits outside
        the blocks is kept whole (the stem is the first stage's, the norm and head the last's)."""
        out = Profile(p for p in self if p.name in set(names))
        out.bytes_outside, out.grad_outside = self.bytes_outside, self.grad_outside
        out.forward_flops, out.ops, out.moved_bytes = self.forward_flops, self.ops, self.moved_bytes
        return out

    def sequence_share(self, sp_size: int, split: set | None = None) -> "Profile":
        """One rank's share under sequence parallelism (parallel/sequence.py): each block's activations, FLOPs and
        traffic an sp_size-th (its tokens through the norms, MLP and residuals, its heads through attention); the
        stem, the final norm and the head whole on every rank of the group, and so the blocks not in `split` (block
        names; default: all), MAE's decoder. A split block also keeps the attention's output as it comes back
        from its all-to-all: a copy the size of a rank's block input (`bytes_full` / sp_size), where the unsplit
        kernel's output is the output projection's input itself. The padding of a token count that sp_size does
        not divide is not counted."""
        if sp_size == 1:
            return self
        split = {p.name for p in self} if split is None else split

        def share(p: BlockProfile) -> BlockProfile:
            out, copy = p.scaled(1 / sp_size), round(p.bytes_full / sp_size)
            return replace(out, bytes_none=out.bytes_none + copy, bytes_selective=out.bytes_selective + copy,
                           bytes_light=out.bytes_light + copy)

        out = Profile(share(p) if p.name in split else p for p in self)
        out.bytes_outside, out.grad_outside, out.ops = self.bytes_outside, self.grad_outside, self.ops
        flops = sum(p.flops for p in self if p.name in split)
        moved = sum(p.moved for p in self if p.name in split)
        out.forward_flops = round(self.forward_flops - flops + flops / sp_size)
        out.moved_bytes = round(self.moved_bytes - moved + moved / sp_size)
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
    cheap_outputs = {}  # block -> {storage of a norm's or activation's output: its elements}
    # block -> {storage of a residual sum `selective` rebuilds: (its elements, the FLOPs of the linear it reruns)}
    residuals = {b.name: {} for b in blocks}
    recipes = {b.name: Recorder(residual=True) for b in blocks}  # what `selective`'s own recorder would match
    linear_outputs = {b.name: {} for b in blocks}  # block -> {linear layer: the storage of its output}
    handles = []
    recorder = _OpRecorder()
    for b in blocks:
        def pre(module, args, name=b.name):
            recorder.block = name
            inputs[name] = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
            recipes[name].start(args)

        def post(module, args, output, name=b.name):
            recorder.block = None
            recipes[name].stop()
        handles += [b.module.register_forward_pre_hook(pre), b.module.register_forward_hook(post)]

        def cheap(module, args, output, name=b.name):  # what `light` recomputes, if the backward reads it
            recorder.alive.append(output)
            cheap_outputs.setdefault(name, {})[compat.storage_id(output)] = output.numel()
        handles += [m.register_forward_hook(cheap) for m in cheap_modules(b.module)]
        handles += [m.register_forward_hook(recipes[b.name].record) for m in cheap_modules(b.module)]
        handles += [m.register_forward_hook(recipes[b.name].record_linear) for m in recomputable_linears(b.module)]

        def linear(module, args, output, name=b.name):  # held: a freed output's storage may name a later one
            recorder.alive.append(output)
            linear_outputs[name][module] = compat.storage_id(output)
        handles += [m.register_forward_hook(linear) for m in recomputable_linears(b.module)]

    def pack(t):
        if recorder.block is not None:  # weights count as saved tensors for the early stop, not as bytes
            recorder.packs[recorder.block] = recorder.packs.get(recorder.block, 0) + 1
        if compat.storage_id(t) in weights or _is_parameter(t):
            # Nothing kept: this forward never runs a backward, and a partitioned model's weights are gathered
            # only while their module runs (engine/parallelize.py), which holding them here would undo.
            return None
        storage = t.untyped_storage()
        saved.setdefault(recorder.block, {})[compat.storage_id(t)] = storage.nbytes()
        if recorder.block is not None:
            recipe = recipes[recorder.block].match(t)
            if isinstance(recipe, _Residual):
                recorder.alive.append(t)
                residuals[recorder.block][compat.storage_id(t)] = (
                    t.numel(), 2 * t.numel() * recipe.module.in_features)
        # Detached: a saved output returned as itself closes a cycle through its own grad_fn that Python's
        # collector cannot see, and the profiled forward would stay allocated for good.
        return t.detach()

    flops = compat.flop_counter()
    # torch's own linear, which checkpointed blocks run under every ZeRO stage (engine/parallelize.py); the
    # fork_rng: the profile must not move the RNG that dropout and stochastic depth draw from
    try:
        with torch.random.fork_rng(devices=[]), compat.functional_linear_is_torchs(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flops, recorder:
            out = model(images)
            if getattr(out, "logits", None) is not None:  # (a masked-image model's output has none)
                out.logits.sum()
    finally:
        for h in handles:
            h.remove()
        recorder.alive.clear()
    per_module = flops.get_flop_counts()
    out = Profile()
    out.forward_flops, out.ops, out.moved_bytes = flops.get_total_flops(), recorder.ops, recorder.moved
    in_blocks = {ptr for b in blocks for ptr in saved[b.name]}
    outside = [n for ptr, n in saved.get(None, {}).items() if ptr not in in_blocks]
    out.bytes_outside, out.grad_outside = sum(outside), max(outside, default=0)
    for b in blocks:
        f = sum(per_module.get(f"{type(model).__name__}.{b.name}", {}).values())
        none = sum(saved[b.name].values())
        outputs = recorder.compute_outputs.get(b.name, [])
        last = recorder.packs.get(b.name, 0)
        rerun = [flops for _, flops, packs in outputs if packs < last]
        light = {ptr: n for ptr, n in cheap_outputs.get(b.name, {}).items() if ptr in saved[b.name]}
        bytes_light = none - sum(saved[b.name][ptr] for ptr in light)
        sums = {ptr: v for ptr, v in residuals[b.name].items() if ptr not in light}
        out.append(BlockProfile(b.name, b.stage, none, bytes_light - sum(saved[b.name][ptr] for ptr in sums),
                                inputs[b.name], int(f), sum(rerun), sum(fl for _, fl in sums.values()),
                                sum(n for n, packs in recorder.cheap_ops.get(b.name, []) if packs < last),
                                max((nbytes for nbytes, *_ in outputs), default=0) + inputs[b.name],
                                sum(compat.param_numel(p) for p in b.module.parameters()), bytes_light,
                                sum(light.values()), sum(light.values()) + sum(n for n, _ in sums.values()),
                                recorder.ops_in.get(b.name, 0), recorder.moved_in.get(b.name, 0),
                                _positions(recorder.linear_ops.get(b.name, []),
                                           {linear_outputs[b.name][m] for m in recipes[b.name].used})))
    return out


def _positions(storages: list, rerun: set) -> tuple:
    """The positions in `storages` (a block's mm/addmm outputs in order) of the rerun linears' outputs; none when
    one of those outputs came from no mm/addmm (the operator policy could not name it)."""
    found = tuple(i for i, s in enumerate(storages) if s in rerun)
    return found if len(found) == len(rerun) else ()


def _signature(block: torch.nn.Module) -> str:
    """What decides a block's profile on the meta device, where only shapes and the operators run matter: its
    modules' types and plain attributes (Swin's shift, a dropout's rate by whether it is zero: a rate changes no
    shape, only whether its operator runs) and its parameters' and buffers' shapes and dtypes."""
    parts = []
    for name, m in block.named_modules():
        attrs = sorted((k, bool(v) if isinstance(v, float) else v) for k, v in vars(m).items()
                       if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple)))
        parts.append((name, type(m).__qualname__, attrs))
    for name, t in (*block.named_parameters(), *block.named_buffers()):
        parts.append((name, tuple(t.shape), str(t.dtype)))
    return repr(parts)


def _distinct_blocks(model) -> dict:
    """Leaves in each of the model's block lists only the first block of each signature (the blocks of a list
    take and return the same shape, so the others can go without changing the rest of the forward).
    {name of every block before: name of the block that stands for it after}."""
    blocks = find_blocks(model)
    lists = {}
    for b in blocks:
        if "." not in b.name:  # the model is a block list itself: nothing to shorten
            return {b.name: b.name for b in blocks}
        lists.setdefault(b.name.rsplit(".", 1)[0], []).append(b)
    stands_for = {}
    for path, members in lists.items():
        signatures = [_signature(b.module) for b in members]
        first = {}  # signature -> the first block that has it
        for b, sig in zip(members, signatures):
            first.setdefault(sig, b)
        position = {sig: i for i, sig in enumerate(first)}
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, torch.nn.ModuleList(b.module for b in first.values()))
        for b, sig in zip(members, signatures):
            stands_for[b.name] = f"{path}.{position[sig]}"
    return stands_for


def profile_model(cfg, device_type: str, dtype: torch.dtype = torch.float32, every_block: bool = False):
    """(block profile at the run's micro-batch, parameters, largest block's parameters) from a forward of
    PROFILE_BATCH images on the meta device, in `dtype` (DeepSpeed's bf16 and fp16 run the whole model in it).
    Attention runs as the fused kernel torch's SDPA picks on `device_type` (flash attention), whose saved
    tensors differ from the math fallback meta would take. Under tensor parallelism (`cfg.tp_size`) the model is
    one rank's share of it, as AutoTP splits it: the figures are a rank's. The forward runs one block of each
    kind (`_distinct_blocks`: one of ViT-22B's 48, two of each Swin stage's) and the profile repeats it for the
    others; `every_block` runs them all (the figures are the same: tests/unit/test_profile.py)."""
    model = meta_model(cfg).to(dtype)
    if cfg.tp_size > 1:
        shard_like_autotp(model, cfg.tp_size)
    images = torch.empty(PROFILE_BATCH, 3, cfg.image_size, cfg.image_size, device="meta", dtype=dtype)
    blocks = find_blocks(model)
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in b.module.parameters()) for b in blocks)
    stands_for = {b.name: b.name for b in blocks} if every_block else _distinct_blocks(model)
    with compat.sdpa_as_on(device_type):
        run = profile_blocks(model, images)
    by_name = {p.name: p for p in run}
    prof = Profile(replace(by_name[stands_for[b.name]], name=b.name, stage=b.stage) for b in blocks)
    prof.bytes_outside, prof.grad_outside = run.bytes_outside, run.grad_outside
    # the whole forward's figures with the blocks that did not run added
    prof.forward_flops = run.forward_flops + sum(p.flops for p in prof) - sum(p.flops for p in run)
    prof.ops = run.ops + sum(p.ops for p in prof) - sum(p.ops for p in run)
    prof.moved_bytes = run.moved_bytes + sum(p.moved for p in prof) - sum(p.moved for p in run)
    return prof.scaled(cfg.micro_batch_size / PROFILE_BATCH), n_params, largest
