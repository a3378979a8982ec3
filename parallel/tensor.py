"""Tensor parallelism (`tp_size`): each block's matrices split over the ranks of a tensor group, through
DeepSpeed's AutoTP, with data parallelism (and ZeRO) over the tensor groups.

Megatron's split of a transformer block (Shoeybi et al. 2019): query, key and value, and the MLP's first linear
column-wise (each rank computes its heads and its share of the hidden units), the attention output and the MLP's
second linear row-wise (each rank multiplies its share and one all-reduce sums them). A block costs two
all-reduces of its activations in the forward and two in the backward. Everything else is replicated on every
rank of a tensor group: the patch embedding, the position embeddings and class token, the norms, Swin's patch
merging and the classifier head; they see the same (all-reduced) activations on every rank, so their gradients
agree without communication. Swin's relative position bias holds one column per head: every rank keeps the
whole table, adds its own heads' columns to its attention scores, and its gradient is summed over the tensor
group (DeepSpeed's `grad_allreduce`), which makes it whole and the same on every rank.

Ranks are laid out as DeepSpeed's AutoTP lays them out: rank = data-parallel rank x tp_size + tensor rank, so
that the ranks of a tensor group are consecutive and, with tp_size dividing the ranks per node, on one node.
The partition config names each parameter found by structure (models/blocks.py), not by transformers' attribute
names, which change between versions.
"""
import re

import torch

from config import ConfigError
import compat
from models.blocks import find_blocks

# the linear layers of a block, in the order a ViT or Swin block registers them, and how each is split
SPLIT = ("column", "column", "column", "row", "column", "row")  # query, key, value, attention output, fc1, fc2


def layout(rank: int, tp_size: int) -> tuple[int, int]:
    """(data-parallel rank, rank in the tensor group) of a global rank."""
    return rank // tp_size, rank % tp_size


def head_counts(model_config) -> list[tuple[str, int]]:
    """(where, attention heads) of every stage: one for a ViT, one per stage for a Swin."""
    heads = getattr(model_config, "num_heads", None)
    if isinstance(heads, (list, tuple)):
        return [(f"stage {i + 1}", h) for i, h in enumerate(heads)]
    return [("every block", model_config.num_attention_heads)]


def check_tp(model_config, tp_size: int, world_size: int, ranks_per_node: int):
    """ConfigError unless `tp_size` splits this model's heads and MLP and this launch's nodes."""
    if tp_size == 1:
        return
    if model_config.model_type not in ("vit", "swin"):
        raise ConfigError(f"tp_size {tp_size}: tensor parallelism splits ViT and Swin blocks, not "
                          f"{model_config.model_type}'s; use tp_size 1")
    for where, heads in head_counts(model_config):
        if heads % tp_size:
            raise ConfigError(f"tp_size {tp_size} does not divide the {heads} attention heads of {where} of "
                              f"{model_config.model_type}: each rank of a tensor group computes whole heads")
    ratio = getattr(model_config, "mlp_ratio", None)
    widths = [int(ratio * model_config.embed_dim * 2 ** i) for i in range(len(model_config.depths))] if ratio \
        else [model_config.intermediate_size]
    if any(w % tp_size for w in widths):
        raise ConfigError(f"tp_size {tp_size} does not divide the MLP's hidden units ({', '.join(map(str, widths))})")
    if world_size % tp_size or ranks_per_node % tp_size:
        raise ConfigError(f"tp_size {tp_size} must divide the ranks per node ({ranks_per_node}) and the world size "
                          f"({world_size}): a tensor group's ranks all-reduce four times per block and stay on one "
                          f"node")


def block_linears(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(parameter-name prefix, column | row) of every linear layer AutoTP splits; ConfigError when a block does not
    hold the six linear layers of a ViT or Swin block."""
    out = []
    for block in find_blocks(model):
        linears = [name for name, m in block.module.named_modules() if isinstance(m, torch.nn.Linear)]
        if len(linears) != len(SPLIT):
            raise ConfigError(f"tensor parallelism: block {block.name} holds {len(linears)} linear layers "
                              f"({', '.join(linears)}), not the {len(SPLIT)} of a ViT or Swin block (query, key, "
                              f"value, attention output, two MLP layers)")
        out += [(f"{block.name}.{name}", how) for name, how in zip(linears, SPLIT)]
    return out


def head_bias_tables(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of Swin's relative position biases: a table with one column per head, whose forward gives
    (1, heads, tokens, tokens)."""
    return [(name, m) for name, m in model.named_modules()
            if any(n.endswith("relative_position_bias_table") for n, _ in m.named_parameters(recurse=False))]


def tp_config(model: torch.nn.Module, tp_size: int) -> dict:
    """DeepSpeed's `tensor_parallel` section: AutoTP with this project's partition config, nothing from presets."""
    def exactly(name):  # AutoTP matches from the start of a name it may prefix with its parents' class names
        return rf"(?:.*\.)?{re.escape(name)}$"
    specs = [{"patterns": [exactly(f"{prefix}.weight")], "partition_type": how} for prefix, how in block_linears(model)]
    specs += [{"patterns": [exactly(f"{name}.relative_position_bias_table")], "partition_type": "skip",
               "grad_allreduce": True} for name, _ in head_bias_tables(model)]
    return {"autotp_size": tp_size, "partition_config": {"use_default_specs": False, "layer_specs": specs}}


def shard_head_biases(model: torch.nn.Module, tp_rank: int, tp_size: int):
    """Each relative position bias gives this rank's heads only: columns tp_rank x heads/tp_size onwards, the
    heads its share of the query and key weights computes."""
    def local_heads(module, args, output):
        per_rank = output.shape[1] // tp_size
        return output[:, tp_rank * per_rank:(tp_rank + 1) * per_rank]

    for _, module in head_bias_tables(model):
        module.register_forward_hook(local_heads)


def unshard(name: str, shards: list[torch.Tensor], full_shape) -> torch.Tensor:
    """The whole tensor `name` from its tensor-parallel shards, one per tensor rank in rank order: concatenated
    along the one dimension where a shard is tp_size times smaller than the model's, or the shards' common value
    where the tensor is replicated (ValueError if the replicas differ, or a shard fits neither)."""
    shape, full_shape = tuple(shards[0].shape), tuple(full_shape)
    if shape == full_shape:
        if any(not torch.equal(shards[0], s) for s in shards[1:]):
            raise ValueError(f"{name} is replicated over the tensor group but differs between its ranks")
        return shards[0]
    split = [d for d, (a, b) in enumerate(zip(shape, full_shape)) if a != b]
    if len(shape) != len(full_shape) or len(split) != 1 or shape[split[0]] * len(shards) != full_shape[split[0]]:
        raise ValueError(f"{name}: shards of shape {list(shape)} are not a {len(shards)}-way split of the model's "
                         f"{list(full_shape)}")
    return torch.cat(shards, dim=split[0])


def shard_like_autotp(model: torch.nn.Module, tp_size: int) -> torch.nn.Module:
    """`model` (on the meta device) as the first rank of a tensor group holds it after AutoTP: each block's
    column-split linear layers with 1/tp_size of their outputs, the row-split ones with 1/tp_size of their inputs
    (and the whole bias, added after the all-reduce), the modules holding them with 1/tp_size of their heads (the
    count AutoTP divides), Swin's position biases giving the rank's heads. What the planner profiles: its saved
    tensors, FLOPs and parameters are one rank's."""
    parents = {}
    for prefix, how in block_linears(model):
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        out_features = old.out_features // tp_size if how == "column" else old.out_features
        in_features = old.in_features // tp_size if how == "row" else old.in_features
        linear = torch.nn.Linear(in_features, out_features, bias=old.bias is not None, device=old.weight.device,
                                 dtype=old.weight.dtype)
        # AutoTP's row-split layer ends in an all-reduce: `selective` reruns no such layer (ac/recompute.py)
        linear.tp_row = how == "row"
        setattr(parent, child, linear)
        parents[parent_name] = parent
    for parent in parents.values():
        if isinstance(getattr(parent, "num_attention_heads", None), int):
            parent.num_attention_heads //= tp_size
    shard_head_biases(model, 0, tp_size)
    return model


def rank_params(model: torch.nn.Module, tp_size: int) -> int:
    """Parameters one rank of a tensor group holds before ZeRO partitions them: the split linear layers' weights
    and column-split biases over tp_size, everything else whole."""
    split = {f"{prefix}.weight" for prefix, _ in block_linears(model)} | {
        f"{prefix}.bias" for prefix, how in block_linears(model) if how == "column"}
    return sum(compat.param_numel(p) // (tp_size if name in split else 1) for name, p in model.named_parameters())
