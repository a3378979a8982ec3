"""Sequence parallelism for ViTs, DeepSpeed-Ulysses style (arXiv 2309.14509): the ranks of a sequence group (`sp_size`
consecutive ranks, which read the same micro-batches) each hold a slice of the tokens from the patch embedding to
the encoder's end, through every norm, MLP and residual; attention moves the heads instead: an all-to-all turns
Q, K and V from a slice of the tokens with every head into every token with a slice of the heads, attention runs
over the whole sequence, and a second all-to-all turns the output back.

Plugged into a Hugging Face ViT without forking it:

- a forward hook on the embeddings pads the tokens (CLS included) to a multiple of `sp_size` and keeps this rank's
  slice; the padded keys are masked out of every softmax, and the padded queries are dropped at the end;
- the attention is a function registered with transformers' `AttentionInterface` and chosen through the model's
  config (`_attn_implementation`), so the model's own attention module calls it with its Q, K and V;
- a forward pre-hook on the final norm gathers the slices back (an autograd all-gather: the gradient of the
  whole sequence is summed back to each slice) and drops the padding, so the final norm, the pooling and the
  head run on the whole sequence, the same on every rank of the group.

MAE (ViTMAEForPreTraining): its encoder is split the same way over the patches its masking keeps (the embeddings
return them with the mask and the order to restore, passed on whole); its decoder runs on the whole sequence, the
same on every rank of the group, as the classifier's head does. SimMIM on a ViT (ViTForMaskedImageModeling): the
embeddings put the mask token in place of the masked patches before the split, and its one-layer decoder runs on
the whole feature map after the gather, as a classifier's head does.

Every rank of a group computes the same loss; its backward sums the group's gradients of each token, so the
engines' gradient average over all ranks is the data-parallel average (their sum over a group is sp_size x the
group's gradient, their mean over world = data ranks x sp_size ranks is the mean over the data ranks). The
engines need nothing else: ZeRO, FSDP2 and DDP reduce over every rank as without sequence parallelism.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import compat

ATTENTION = "sequence_parallel"  # the name of the attention function in transformers' AttentionInterface
MODEL_TYPES = ("vit", "vit_mae")  # models whose every block attends globally over one sequence with a CLS token
TASKS = ("classification", "mae", "simmim")
BACKBONE = "vit."  # the blocks split: the backbone's (ViT's and ViTMAE's base_model_prefix); MAE's decoder runs whole


def split_blocks(names) -> set:
    """Of a model's block names (models/blocks.py), those whose tokens the split divides."""
    return {n for n in names if n.startswith(BACKBONE)}


def layout(rank: int, sp_size: int, tp_size: int = 1) -> tuple[list[int], int]:
    """(the ranks of `rank`'s sequence group, its index there). A model-parallel block of tp_size x sp_size
    consecutive ranks reads one micro-batch; within it the tensor groups are consecutive (DeepSpeed's AutoTP:
    parallel/tensor.py) and a sequence group takes one rank of each, the ranks of the same tensor rank, so that
    the ranks of a tensor group hold the same tokens."""
    block, within = divmod(rank, tp_size * sp_size)
    index, tensor_rank = divmod(within, tp_size)
    first = block * tp_size * sp_size + tensor_rank
    return [first + j * tp_size for j in range(sp_size)], index


class SequenceGroup:
    """This rank's sequence group and where the tokens of the current forward stand (set by the embedding hook)."""

    def __init__(self, sp_size: int, rank: int, world_size: int, tp_size: int = 1):
        self.size = sp_size
        self.group = None
        mine, self.index = layout(rank, sp_size, tp_size)
        # every rank creates every group, in the same order
        for other in range(world_size):
            ranks, index = layout(other, sp_size, tp_size)
            if index == 0:
                group = dist.new_group(ranks)
                if ranks == mine:
                    self.group = group
        self.tokens = 0  # the sequence's length before padding
        self.padded = 0  # its length padded to a multiple of size

    def key_mask(self, device) -> torch.Tensor | None:
        """The padded keys left out of the softmax (True: attend), or None without padding."""
        if self.padded == self.tokens:
            return None
        return (torch.arange(self.padded, device=device) < self.tokens)[None, None, None, :]


def check(model_config, sp_size: int, world_size: int, tp_size: int = 1, task: str = "classification"):
    """One line for what sequence parallelism cannot do here (ConfigError's message), or None."""
    if sp_size == 1:
        return None
    if world_size % (sp_size * tp_size):
        return (f"sp_size {sp_size} does not divide the world size ({world_size})" if tp_size == 1 else
                f"sp_size {sp_size} x tp_size {tp_size} does not divide the world size ({world_size})")
    if task not in TASKS:
        return (f"sp_size > 1 with task {task}: sequence parallelism splits the ViTs of {' and '.join(TASKS)} so far "
                f"(segmentation's backbones are windowed or pyramidal)")
    kind = getattr(model_config, "model_type", "?")
    if kind not in MODEL_TYPES:
        return (f"sp_size > 1 with a {kind} model: sequence parallelism splits models whose every block attends "
                f"over the whole sequence ({', '.join(MODEL_TYPES)}); Swin's windows and SegFormer's reduced "
                f"attention are local")
    heads = model_config.num_attention_heads
    if heads % (sp_size * tp_size):
        return (f"sp_size {sp_size} does not divide the model's {heads} attention heads (Ulysses splits the heads)"
                if tp_size == 1 else f"sp_size {sp_size} x tp_size {tp_size} does not divide the model's {heads} "
                f"attention heads (each tensor rank's heads are split over its sequence group)")
    if getattr(model_config, "attention_probs_dropout_prob", 0.0):
        return ("sp_size > 1 with attention dropout: each rank would draw the dropout of its heads alone; set the "
                "model's attention_probs_dropout_prob to 0")
    return None


def _heads_to_tokens(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """(B, H, S/P, D), every head over this rank's tokens -> (B, H/P, S, D), this rank's heads over every token."""
    b, h, s, d = x.shape
    p = sp.size
    send = x.reshape(b, p, h // p, s, d).transpose(0, 1).contiguous()  # chunk r: the heads rank r keeps
    got = compat.all_to_all_autograd(send, sp.group)  # chunk r: rank r's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def _tokens_to_heads(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """The inverse: (B, H/P, S, D) -> (B, H, S/P, D)."""
    b, hp, s, d = x.shape
    p = sp.size
    send = x.reshape(b, hp, p, s // p, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk r: rank r's tokens
    got = compat.all_to_all_autograd(send, sp.group)  # chunk r: head group r
    return got.transpose(0, 1).reshape(b, hp * p, s // p, d)


def attention(sp: SequenceGroup):
    """The attention function (transformers' AttentionInterface signature) of a model under `sp`."""

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            raise ValueError("sequence parallelism: an attention mask from the model is not supported")
        q, k, v = (_heads_to_tokens(t, sp) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=sp.key_mask(q.device), dropout_p=dropout,
                                             scale=scaling)
        return _tokens_to_heads(out, sp).transpose(1, 2).contiguous(), None  # (B, S/P, H, D), as eager's

    return forward


def _shard(sp: SequenceGroup):
    def hook(module, args, out):
        tokens, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)  # MAE: (tokens, mask, order)
        sp.tokens = tokens.shape[1]
        sp.padded = -(-sp.tokens // sp.size) * sp.size
        if sp.padded != sp.tokens:
            tokens = F.pad(tokens, (0, 0, 0, sp.padded - sp.tokens))
        local = sp.padded // sp.size
        tokens = tokens[:, sp.index * local:(sp.index + 1) * local]
        return tokens if rest is None else (tokens, *rest)

    return hook


def _gather(sp: SequenceGroup):
    def hook(module, args):
        whole = compat.all_gather_autograd(args[0], 1, sp.group)
        return (whole[:, :sp.tokens], *args[1:])

    return hook


def apply(model: torch.nn.Module, sp_size: int, rank: int, world_size: int, tp_size: int = 1) -> SequenceGroup | None:
    """Split `model`'s tokens over sequence groups of `sp_size` ranks (module docstring; with tensor parallelism
    `layout`'s groups); None at sp_size 1."""
    if sp_size == 1:
        return None
    from transformers import AttentionInterface

    sp = SequenceGroup(sp_size, rank, world_size, tp_size)
    backbone = model.base_model  # ViTModel, ViTMAEModel: embeddings -> blocks -> layernorm (-> pooler)
    AttentionInterface.register(ATTENTION, attention(sp))
    model.config._attn_implementation = ATTENTION
    for module in backbone.modules():  # the blocks' attention modules read the config they were built with
        config = getattr(module, "config", None)
        if config is not None and config is not model.config:
            config._attn_implementation = ATTENTION
    backbone.embeddings.register_forward_hook(_shard(sp))
    backbone.layernorm.register_forward_pre_hook(_gather(sp))
    return sp


def restore_attention(config) -> None:
    """An exported config's attention as transformers' default (the hooks and the group stay with the run)."""
    if getattr(config, "_attn_implementation", None) == ATTENTION:
        config._attn_implementation = "sdpa"
