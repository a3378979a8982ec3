"""Pipeline parallelism for ViT classifiers (`pp_size`): the ranks of a pipeline (`pp_size` consecutive ranks, which
read the same micro-batches) each hold a stage, a run of consecutive blocks; the first also holds the embeddings,
the last the final norm and the head. Each micro-batch of `micro_batch_size` images is cut into `pp_microbatches`
pieces that flow through the stages under one of torch.distributed.pipelining's schedules (`pp_schedule`):

- `1f1b`: after a warm-up of forwards, each stage alternates one forward and one backward, so stage s of P holds the
  activations of at most P - s pieces at a time (the first stage the most);
- `gpipe`: every piece's forward, then every backward: each stage holds all of them.

Either way a step leaves each stage idle for (P - 1) / (M + P - 1) of it (the bubble, M pieces), which is why
`pp_microbatches` defaults to the fewest pieces that keep it at or under 20%.

The Hugging Face model stays itself: every rank builds the whole model from the seed (the same weights as without
a pipeline), then `split` keeps its stage's modules under their own names and drops the rest (a dropped block
becomes an empty `Dropped`, the embeddings, norm or head `None`), and gives the model a forward of its stage alone.
So the blocks found for activation checkpointing and FSDP2 are the stage's, every parameter keeps the name it has
in the whole model, and a DCP checkpoint written by a pipeline loads on any other `pp_size` (DCP matches by name).

FSDP2 shards each stage over the data-parallel ranks that hold it (the 'dp' dimension of a (dp, pp) mesh); the
gradient norm sums every rank's squares, each parameter being on one stage only. The loss is computed on the last
stage, per piece, divided by the accumulation steps, and the schedule averages the pieces' gradients; the last stage
sends the micro-batch's loss to the others. Evaluation runs the stages one after the other (`forward`): the logits
reach every rank of the pipeline.
"""
import contextlib
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.blocks import find_blocks

MODEL_TYPES = ("vit",)  # models whose blocks form one ModuleList between an embedding and a norm and head
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}  # pp_schedule -> torch.distributed.pipelining's
MAX_BUBBLE = 0.2  # pp_microbatches 0: the fewest pieces that keep the bubble at or under this
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the hidden states evaluation sends, by index


class Dropped(nn.Module):
    """A block that another stage holds: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a block of another pipeline stage was called")


def bubble(stages: int, pieces: int) -> float:
    """The share of a step each stage is idle under 1F1B or GPipe: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (pieces + stages - 1)


def microbatches(pp_size: int, pp_microbatches: int, micro_batch_size: int) -> int:
    """The pieces a micro-batch is cut into: `pp_microbatches`, or with 0 the fewest that divide the micro-batch
    and keep the bubble at or under MAX_BUBBLE (else one image each)."""
    if pp_microbatches:
        return pp_microbatches
    divisors = [m for m in range(1, micro_batch_size + 1) if micro_batch_size % m == 0]
    return next((m for m in divisors if bubble(pp_size, m) <= MAX_BUBBLE), micro_batch_size)


def in_flight(schedule: str, stage: int, stages: int, pieces: int) -> int:
    """The pieces whose activations stage `stage` holds at once: under 1F1B its warm-up forwards, min(M, P - s)
    (torch's Schedule1F1B runs a backward before each later forward), under GPipe all M."""
    return pieces if schedule == "gpipe" else min(pieces, stages - stage)


def stage_profile(profile, names: list[str], cfg, stage: int):
    """ac/profile.py's `Profile` of the whole model at the micro-batch -> what stage `stage` holds at its peak:
    its blocks (`names`), each with the activations of the pieces in flight (`in_flight` of M pieces of
    micro_batch_size / M images), which `auto` budgets and the planner counts."""
    pieces = microbatches(cfg.pp_size, cfg.pp_microbatches, cfg.micro_batch_size)
    held = in_flight(cfg.pp_schedule, stage, cfg.pp_size, pieces)
    return profile.stage_share(names).scaled(held / pieces)


def parse_split(split: str) -> list[int]:
    """`pp_split` as block counts ([] when unset); ValueError for what is not a list of positive integers."""
    if not split.strip():
        return []
    try:
        sizes = [int(part) for part in split.split(",")]
    except ValueError:
        sizes = [0]
    if min(sizes) < 1:
        raise ValueError(f"pp_split '{split}': comma-separated block counts, each at least 1 (e.g. 5,7,7,5)")
    return sizes


def stage_blocks(blocks: int, stages: int, split: str = "") -> list[range]:
    """The blocks each stage holds, in order: `split`'s counts (`pp_split`, checked by `check`), else as even as
    they divide, the remainder to the later stages, which hold fewer pieces' activations under 1F1B (and the first
    also holds the embeddings)."""
    sizes = parse_split(split)
    if not sizes:
        base, extra = divmod(blocks, stages)
        sizes = [base + (s >= stages - extra) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def candidate_splits(blocks: int, stages: int, shifts: int = 2) -> list[str]:
    """The cuts the planner tries (as `pp_split` values; "" is the even one): the even cut, and the even cut with
    1 to `shifts` blocks moved off each end stage (which also run the embeddings and the head, and under 1F1B the
    first holds the most pieces) onto the middle ones; with two stages, blocks moved either way."""
    base = [r.stop - r.start for r in stage_blocks(blocks, stages)]
    found = []
    for k in range(1, shifts + 1):
        if stages == 2:
            moves = [[base[0] - k, base[1] + k], [base[0] + k, base[1] - k]]
        else:
            sizes = [base[0] - k, *base[1:-1], base[-1] - k]
            for i in range(2 * k):
                sizes[1 + i % (stages - 2)] += 1
            moves = [sizes]
        found += [",".join(map(str, m)) for m in moves if min(m) >= 1]
    return ["", *dict.fromkeys(found)]


def mesh(device_type: str, pp_size: int):
    """A (dp, pp) device mesh: consecutive ranks form a pipeline ('pp'); the ranks holding the same stage, one per
    pipeline, form its data-parallel group ('dp')."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size() // pp_size, pp_size), mesh_dim_names=("dp", "pp"))


def describe(cfg, blocks: int) -> str:
    """The start-up line: which blocks each stage holds, the schedule, its pieces and bubble."""
    pieces = microbatches(cfg.pp_size, cfg.pp_microbatches, cfg.micro_batch_size)
    stages = " | ".join(f"{r.start}-{r.stop - 1}" for r in stage_blocks(blocks, cfg.pp_size, cfg.pp_split))
    return (f"pipeline: {cfg.pp_size} stages of blocks {stages} | {cfg.pp_schedule}, {pieces} pieces of "
            f"{cfg.micro_batch_size // pieces} images per micro-batch | bubble {bubble(cfg.pp_size, pieces):.0%}")


def check(model_config, cfg, world_size: int) -> str | None:
    """One line for what pipeline parallelism cannot do here (ConfigError's message), or None."""
    pp = cfg.pp_size
    if pp == 1:
        return "pp_split needs pp_size > 1" if cfg.pp_split.strip() else None
    if world_size % pp:
        return f"pp_size {pp} does not divide the world size ({world_size})"
    if cfg.tp_size > 1 or cfg.sp_size > 1:
        return "pp_size > 1 with tp_size or sp_size > 1: the pipeline does not compose with tensor or sequence " \
               "parallelism here yet; use one of them"
    if cfg.task != "classification":
        return f"pp_size > 1 with task {cfg.task}: the pipeline splits the classifiers' ViTs only so far"
    kind = getattr(model_config, "model_type", "?")
    if kind not in MODEL_TYPES:
        return (f"pp_size > 1 with a {kind} model: the pipeline splits models whose blocks form one list between "
                f"the embeddings and the head ({', '.join(MODEL_TYPES)}) so far; Swin's stages change the tokens' "
                f"shape between them")
    blocks = model_config.num_hidden_layers
    if pp > blocks:
        return f"pp_size {pp} is more stages than the model's {blocks} blocks"
    try:
        sizes = parse_split(cfg.pp_split)
    except ValueError as e:
        return str(e)
    if sizes and (len(sizes) != pp or sum(sizes) != blocks):
        return (f"pp_split '{cfg.pp_split}' gives {len(sizes)} stages {sum(sizes)} blocks; the model has {blocks} "
                f"blocks over pp_size {pp} stages")
    pieces = microbatches(pp, cfg.pp_microbatches, cfg.micro_batch_size)
    if cfg.micro_batch_size % pieces:
        return f"pp_microbatches {pieces} does not divide micro_batch_size {cfg.micro_batch_size}"
    if cfg.replicate_degree > 1:
        return "pp_size > 1 with replicate_degree > 1: each stage is sharded over its data-parallel ranks (a " \
               "1-D shard group); use replicate_degree 1"
    return None


def split(model: nn.Module, stage: int, stages: int, sizes: str = "") -> range:
    """Keep stage `stage` of `stages` of a ViT classifier in place (see the module's docstring); its blocks.
    `sizes`: pp_split's block counts ("" = as even as they divide)."""
    blocks = find_blocks(model)
    parent = model.get_submodule(blocks[0].name.rsplit(".", 1)[0])  # the ModuleList every ViT block sits in
    keep = stage_blocks(len(blocks), stages, sizes)[stage]
    for i in range(len(parent)):
        if i not in keep:
            parent[i] = Dropped()
    base = model.base_model
    first, last = stage == 0, stage == stages - 1
    if not first:
        base.embeddings = None
    if not last:
        base.layernorm = None
        model.classifier = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> hidden states (first stage), hidden states -> hidden states, or -> logits (last)."""
        if first:
            x = base.embeddings(x)
        for i in keep:
            out = parent[i](x)
            x = out[0] if isinstance(out, tuple) else out  # a tuple in older transformers
        if last:
            x = model.classifier(base.layernorm(x)[:, 0])  # the CLS token's
        return x

    model.forward = types.MethodType(forward, model)  # called through the module: FSDP2's root hooks run
    return keep


class Pipeline:
    """This rank's stage under its schedule, and the stages' forward for evaluation."""

    def __init__(self, module: nn.Module, stage: int, stages: int, group, device: torch.device, cfg,
                 wrapped: nn.Module | None = None, autocast=None):
        """`module`: the stage (its forward, for evaluation); `wrapped`: what the schedule runs (DDP's wrapper of
        it), else `module`; `autocast`: a context the schedule's forwards run in (DDP's bf16)."""
        from torch.distributed import pipelining

        self.module, self.stage, self.stages, self.group = module, stage, stages, group
        self.first, self.last = stage == 0, stage == stages - 1
        self.ranks = dist.get_process_group_ranks(group)
        self.device, self.accum = device, cfg.grad_accum_steps
        self.autocast = autocast or contextlib.nullcontext
        self.pieces = microbatches(stages, cfg.pp_microbatches, cfg.micro_batch_size)
        smoothing = cfg.label_smoothing

        def loss_fn(logits, targets):  # models/tasks.py's classification loss, per piece
            loss = F.cross_entropy(logits.float(), targets, label_smoothing=smoothing)
            return loss / self.accum if self.accum > 1 else loss

        self.pp_stage = pipelining.PipelineStage(wrapped or module, stage, stages, device, group=group)
        self.schedule = getattr(pipelining, SCHEDULES[cfg.pp_schedule])(self.pp_stage, n_microbatches=self.pieces,
                                                                        loss_fn=loss_fn, scale_grads=True)

    def step(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch over every stage: its loss (undivided), on every rank."""
        losses = []
        args = (images,) if self.first else ()
        kwargs = dict(target=targets, losses=losses) if self.last else {}
        with self.autocast():
            self.schedule.step(*args, **kwargs)
        if self.last:
            loss = torch.stack([piece.detach().float() for piece in losses]).mean() * self.accum
        else:
            loss = torch.empty((), dtype=torch.float32, device=self.device)
        dist.broadcast(loss, src=self.ranks[-1], group=self.group)
        return loss

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> types.SimpleNamespace:
        """The logits of `images` (on every rank of the pipeline), the stages run one after the other."""
        if self.first:
            x = images
        else:  # (dims, shape, dtype) first: an evaluation batch's size varies
            head = torch.empty(5, dtype=torch.int64, device=self.device)
            dist.recv(head, src=self.ranks[self.stage - 1], group=self.group)
            ndim, *shape, dtype = head.tolist()
            x = torch.empty(*shape[:ndim], dtype=DTYPES[dtype], device=self.device)
            dist.recv(x, src=self.ranks[self.stage - 1], group=self.group)
        with self.autocast():
            x = self.module(x)
        if not self.last:
            head = [x.ndim, *x.shape, *[1] * (3 - x.ndim), DTYPES.index(x.dtype)]
            dist.send(torch.tensor(head, dtype=torch.int64, device=self.device), dst=self.ranks[self.stage + 1],
                      group=self.group)
            dist.send(x.contiguous(), dst=self.ranks[self.stage + 1], group=self.group)
            x = None
        sizes = torch.tensor(x.shape if self.last else (0, 0), dtype=torch.int64, device=self.device)
        dist.broadcast(sizes, src=self.ranks[-1], group=self.group)
        logits = x.float().contiguous() if self.last else \
            torch.empty(*sizes.tolist(), dtype=torch.float32, device=self.device)
        dist.broadcast(logits, src=self.ranks[-1], group=self.group)
        return types.SimpleNamespace(logits=logits)
