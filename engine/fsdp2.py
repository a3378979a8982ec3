"""PyTorch FSDP2 as the trainer's second engine (`engine: fsdp2`), behind engine/base.py's interface.

FSDP2 as its users run it (torchtitan's order: checkpointing, compile, shard): `fully_shard` on every transformer
block and on the root over a 1-D device mesh of every rank, or with `replicate_degree` R > 1 a 2-D mesh (R replicas x
world/R shards: HSDP, gradients reduce-scattered within a shard group and all-reduced across the replicas, ZeRO++'s
hierarchical partitioning's analogue with R = the number of nodes); `reshard_after_forward` from `zero_stage`
(3: a block's weights are freed after its forward and gathered again for its backward, ZeRO-3's trade;
1 and 2: kept to the backward); `MixedPrecisionPolicy` with bf16 weights and fp32 gradient reduction under bf16.
The optimizer, the step and the DCP checkpoints are engine/torch_engine.py's; micro-batches before the
accumulation boundary accumulate unsharded gradients without a reduce-scatter (`set_requires_gradient_sync`).
With `async_save` the shards are copied to host memory and written by DCP's thread while training goes on
(checkpoints/manager.py commits the checkpoint when the next save starts).
"""
import torch
import torch.distributed as dist

import compat
from config import Config
from engine.base import Built, Capabilities, Sizes
from engine.ds_config import DTYPES, resolve_precision
from engine.memory import fsdp2_comm_bytes, fsdp2_memory_bytes, fsdp2_memory_parts
from engine.parallelize import apply_ac, cut_stage
from engine.torch_engine import TorchEngine, adamw_config
from models.blocks import find_blocks
from parallel import pipeline


def fsdp2_config(cfg: Config, precision: str, gpu: bool) -> dict:
    """What the FSDP2 engine is configured with (fsdp2_config.json in the run directory)."""
    return {"engine": "fsdp2", "reshard_after_forward": cfg.zero_stage == 3,
            "mesh": "1-D over every rank" if cfg.replicate_degree == 1 else
            f"2-D: {cfg.replicate_degree} replicas x world/{cfg.replicate_degree} shards (HSDP)",
            "param_dtype": precision, "reduce_dtype": "fp32", "optimizer": adamw_config(cfg, gpu),
            "async_save": cfg.async_save, "gradient_clipping": cfg.grad_clip,
            "gradient_accumulation_steps": cfg.grad_accum_steps,
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size}


def device_mesh(device_type: str, replicate: int = 1):
    """Every rank in one shard group (1-D), or `replicate` groups of world/replicate ranks, each holding a replica
    (2-D, dims 'replicate' and 'shard': HSDP). Consecutive ranks share a shard group: one node's, when
    `replicate` is the number of nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def shard(model: torch.nn.Module, precision: str, device: torch.device, reshard: bool, compile_blocks: bool,
          replicate: int = 1, mesh=None):
    """`fully_shard` per block, then the root, in place, resharding after the forward or not, over `device_mesh`;
    each block compiled first with `compile_blocks`. The FSDP2 engine's wrapping, and the benchmark's plain
    FSDP2's. `mesh`: the shard group's, instead (a pipeline stage's data-parallel ranks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh(device.type, replicate) if mesh is None else mesh
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    if device.type == "cuda":
        model.to(device)
    for block in find_blocks(model):
        if compile_blocks:  # torchtitan's order: each block in place, after checkpointing, before sharding
            block.module.compile()
        fully_shard(block.module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return model


def memory_args(cfg: Config, sizes: Sizes, data_ranks: int, precision: str, gpu: bool) -> tuple:
    return (sizes.params, sizes.outside_blocks, sizes.largest_block, data_ranks // cfg.replicate_degree, precision,
            cfg.zero_stage == 3, gpu, cfg.grad_accum_steps)


class FSDP2Engine(TorchEngine):
    """A sharded model, its AdamW and LR schedule, stepped as DeepSpeed steps (engine/torch_engine.py)."""
    name = "fsdp2"
    config_file = "fsdp2_config.json"
    capabilities = Capabilities(async_save=True, replicate=True, pipeline=True)

    def __init__(self, module: torch.nn.Module, cfg: Config, device: torch.device, layers=None):
        super().__init__(module, cfg, device, layers)
        # the norm sums each shard once: over the shard group, whose shards every replica holds alike (a
        # pipeline's stages hold distinct parameters: every rank's squares count)
        mesh = next(p.device_mesh for p in module.parameters() if compat.is_dtensor(p))
        self._norm_group = mesh["shard"].get_group() if mesh.mesh_dim_names == ("replicate", "shard") else None

    # ------------------------------------------------------------------ before the model
    @classmethod
    def engine_config(cls, cfg: Config, hidden_size: int, world_size: int, precision: str,
                      ranks_per_node: int | None = None, gpu: bool | None = None) -> dict:
        return fsdp2_config(cfg, precision, torch.cuda.is_available() if gpu is None else gpu)

    @classmethod
    def wrap(cls, model: torch.nn.Module, cfg: Config, world_size: int, device_type: str, log=print,
             resharding: bool = False) -> Built:
        """Activation checkpointing (budgeted against what FSDP2 holds beside the activations), each block
        compiled with `compile`, then `fully_shard` per block and on the root. With `pp_size` > 1 the model is cut
        to this rank's stage first and sharded over the ranks that hold the same stage (parallel/pipeline.py)."""
        precision = resolve_precision(cfg.precision)
        config = cls.engine_config(cfg, 0, world_size, precision)
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        mesh, stage, layers = cut_stage(model, cfg, device.type, log)  # a pipeline's stage, if pp_size > 1
        data_ranks = world_size // cfg.pp_size
        fixed = fsdp2_memory_bytes(*memory_args(cfg, cls.sizes(model), data_ranks, precision, device_type == "cuda"))
        ac_plan = apply_ac(model, cfg, fixed, precision, device_type, log, stage)
        shard(model, precision, device, reshard=cfg.zero_stage == 3, compile_blocks=cfg.compile,
              replicate=cfg.replicate_degree, mesh=mesh["dp"] if mesh is not None else None)
        if cfg.compile:
            log("compile: each block is compiled in place by torch.compile before fully_shard; the first steps are "
                "slow while it compiles")
        engine = cls(model, cfg, device, layers)
        if mesh is not None:
            engine.pipeline = pipeline.Pipeline(model, stage, cfg.pp_size, mesh.get_group("pp"), device, cfg)
        return Built(engine, ac_plan, config, precision, DTYPES[precision])

    @classmethod
    def memory(cls, cfg, sizes, data_ranks, precision, engine_config, gpu):
        args = memory_args(cfg, sizes, data_ranks, precision, gpu)
        return fsdp2_memory_parts(*args), fsdp2_memory_bytes(*args)

    @classmethod
    def comm_bytes(cls, cfg, n_params, data_ranks, ranks_per_node, weight_bytes, engine_config):
        return fsdp2_comm_bytes(n_params, cfg.zero_stage == 3, cfg.grad_accum_steps, data_ranks, ranks_per_node,
                                weight_bytes, cfg.replicate_degree)

    @classmethod
    def optimizer_holders(cls, cfg: Config, data_ranks: int) -> int:
        return data_ranks // cfg.replicate_degree

    @classmethod
    def describe(cls, cfg: Config, world_size: int, module=None) -> str:
        kept = "resharded" if cfg.zero_stage == 3 else "kept"
        if cfg.replicate_degree > 1:
            shards = world_size // cfg.replicate_degree
            return (f"HSDP ({cfg.replicate_degree} replicas x {shards} shard{'s' if shards > 1 else ''}, "
                    f"{kept} after forward)")
        return f"FSDP2 ({kept} after forward)"

    @classmethod
    def plan_label(cls, e: dict) -> str:
        hsdp = f" HSDP{r}" if (r := e.get("replicate_degree", 1)) > 1 else ""
        return f"FSDP2{hsdp} {'reshard' if e['zero_stage'] == 3 else 'keep'}"

    @classmethod
    def search_variants(cls, world_size: int, ranks_per_node: int, tp_size: int) -> list[dict]:
        """The planner's candidates: resharding after the forward (ZeRO-3's trade) or not, without tensor
        parallelism; across whole nodes also HSDP (a replica per node)."""
        if tp_size > 1:
            return []
        nodes = world_size // ranks_per_node if world_size > ranks_per_node and world_size % ranks_per_node == 0 \
            else 1
        return [dict(zero_stage=s, replicate_degree=r) for r in ([1, nodes] if nodes > 1 else [1]) for s in (3, 2)]

    # ------------------------------------------------------------------ the model
    def train(self):
        """Training mode, every block's weights resharded (an evaluation without resharding leaves them whole)."""
        self.module.train()
        for m in self.module.modules():
            if compat.is_fsdp2_module(m):
                m.reshard()

    def backward(self, loss: torch.Tensor):
        self.module.set_requires_gradient_sync(self.at_boundary)
        super().backward(loss)

    def full_state_dict(self, rank: int) -> dict:
        """The whole model's weights on rank 0's CPU ({} elsewhere), gathered parameter by parameter."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.pipeline is None:
            state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return state if rank == 0 else {}
        # each stage whole on the ranks that shard it, the first pipeline's sent to rank 0
        return self.gather_stages(get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True)),
                                  rank)
