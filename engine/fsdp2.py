"""PyTorch FSDP2 as the trainer's second engine (`engine: fsdp2`), driven by train.py exactly as it drives DeepSpeed.

FSDP2 as its users run it (torchtitan's order: checkpointing, compile, shard): `fully_shard` on every transformer
block and on the root over a 1-D device mesh of every rank, or with `replicate_degree` R > 1 a 2-D mesh (R replicas x
world/R shards: HSDP, gradients reduce-scattered within a shard group and all-reduced across the replicas, ZeRO++'s
hierarchical partitioning's analogue with R = the number of nodes); `reshard_after_forward` from `zero_stage`
(3: a block's weights are freed after its forward and gathered again for its backward, ZeRO-3's trade;
1 and 2: kept to the backward); `MixedPrecisionPolicy` with bf16 weights and fp32 gradient reduction under bf16;
torch's AdamW, fused on GPUs and foreach on CPU, the update DeepSpeed's side runs too (engine/ds_config.py).

`FSDP2Engine` offers the part of `deepspeed.DeepSpeedEngine`'s surface that train.py, the evaluation, the EMA and
the export use: calling the model, `backward`, `step` (the optimizer at the accumulation boundary only),
`get_lr`, `get_global_grad_norm`, `was_step_applied`, `skipped_steps`, `save_checkpoint`, `load_checkpoint`. The
steps match DeepSpeed's: the loss divided by the accumulation steps, the global gradient norm summed in float64
(a run on another number of ranks clips by the same fp32 norm), clipping, a step with non-finite gradients skipped
(on CPU, where the norm is read without a device sync; on GPUs the fused update skips it on the device), the LR
schedule advancing with each applied step. Micro-batches before the boundary accumulate unsharded gradients
without a reduce-scatter (`set_requires_gradient_sync`).

Checkpoints are `torch.distributed.checkpoint` (DCP) directories: each rank writes its shards of the weights and
AdamW's states, and a load on any number of ranks reshards them, so no conversion is needed to resume elsewhere.
With `async_save` the shards are copied to host memory and written by DCP's thread while training goes on
(engine/checkpoint.py commits the checkpoint when the next save starts).
"""
import contextlib
import os

import torch
import torch.distributed as dist

from config import Config
from engine import compat
from engine.optim import lr_schedule, param_groups
from models.blocks import find_blocks

ENGINE_STATE = "engine_state.pt"  # beside DCP's files: the LR schedule, the step counters and the client state
ADAM_EPS = 1e-8


def fsdp2_config(cfg: Config, precision: str, gpu: bool) -> dict:
    """What the FSDP2 engine is configured with (fsdp2_config.json in the run directory)."""
    return {"engine": "fsdp2", "reshard_after_forward": cfg.zero_stage == 3,
            "mesh": "1-D over every rank" if cfg.replicate_degree == 1 else
            f"2-D: {cfg.replicate_degree} replicas x world/{cfg.replicate_degree} shards (HSDP)", "param_dtype": precision, "reduce_dtype": "fp32",
            "optimizer": {"type": "AdamW", "implementation": "fused" if gpu else "foreach", "lr": cfg.lr,
                          "betas": [cfg.beta1, cfg.beta2], "eps": ADAM_EPS, "weight_decay": cfg.weight_decay},
            "async_save": cfg.async_save, "gradient_clipping": cfg.grad_clip, "gradient_accumulation_steps": cfg.grad_accum_steps,
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
          replicate: int = 1):
    """`fully_shard` per block, then the root, in place, resharding after the forward or not, over `device_mesh`;
    each block compiled first with `compile_blocks`. The FSDP2 engine's wrapping, and the benchmark's plain
    FSDP2's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh(device.type, replicate)
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


class FSDP2Engine:
    """A sharded model, its AdamW and LR schedule, stepped as DeepSpeed steps (see the module's docstring)."""

    def __init__(self, module: torch.nn.Module, cfg: Config, device: torch.device):
        self.module, self.cfg, self.device = module, cfg, device
        gpu = device.type == "cuda"
        groups = param_groups(module, cfg.weight_decay, cfg.layer_decay, cfg.lr)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=ADAM_EPS,
                                           weight_decay=cfg.weight_decay, fused=gpu, foreach=not gpu)
        self.basic_optimizer = self.optimizer  # DeepSpeed's name for the torch optimizer under it
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_schedule(cfg))
        self.micro_steps = 0  # micro-batches stepped, as DeepSpeed counts them
        self.skipped_steps = 0
        self.applied = True
        self.norm = None
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.async_save = cfg.async_save  # engine/checkpoint.py's save starts the write and commits it later
        self.pending = None  # engine/checkpoint.py's record of the checkpoint being written in the background
        self._writing = None  # its future
        self._checkpoint_group = None
        # the norm sums each shard once: over the shard group, whose shards every replica holds alike
        mesh = next(p.device_mesh for p in module.parameters() if compat.is_dtensor(p))
        self.shard_group = mesh["shard"].get_group() if mesh.ndim == 2 else None

    # ------------------------------------------------------------------ the model
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self):
        """Training mode, every block's weights resharded (an evaluation without resharding leaves them whole)."""
        self.module.train()
        for m in self.module.modules():
            if compat.is_fsdp2_module(m):
                m.reshard()

    def eval(self):
        self.module.eval()

    @property
    def is_compiled(self) -> bool:
        return all(compat.is_compiled_in_place(b.module) for b in find_blocks(self.module))

    def zero_optimization_partition_weights(self) -> bool:
        """DeepSpeed's question, whether ZeRO-3 partitions the weights: never here (FSDP2's shards are DTensors)."""
        return False

    def autotp_size(self) -> int:
        return 1

    # ------------------------------------------------------------------ the step
    @property
    def at_boundary(self) -> bool:
        """Is the next micro-batch the last of its optimizer step?"""
        return (self.micro_steps + 1) % self.cfg.grad_accum_steps == 0

    def backward(self, loss: torch.Tensor):
        """The micro-batch's gradients, divided by the accumulation steps; reduced into the shards at the last
        micro-batch of a step only."""
        self.module.set_requires_gradient_sync(self.at_boundary)
        (loss / self.cfg.grad_accum_steps if self.cfg.grad_accum_steps > 1 else loss).backward()

    def step(self):
        """After every micro-batch: at the accumulation boundary the norm, clipping, AdamW and the schedule."""
        boundary = self.at_boundary
        self.micro_steps += 1
        if not boundary:
            return
        self.norm = self.global_grad_norm()
        finite = torch.isfinite(self.norm)
        if self.cfg.grad_clip > 0:
            coef = torch.clamp(self.cfg.grad_clip / (self.norm + 1e-6), max=1.0)
            compat.foreach_scale_([compat.local_tensor(p.grad) for p in self.params if p.grad is not None],
                                  coef.to(self.device))
        if self.device.type == "cuda":  # the fused update skips a non-finite step on the device: no sync
            self.optimizer.found_inf = (~finite).float().to(self.device)
            self.optimizer.step()
            self.lr_scheduler.step()
            self.applied = True
        else:
            self.applied = bool(finite)
            if self.applied:
                self.optimizer.step()
                self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def global_grad_norm(self) -> torch.Tensor:
        """The L2 norm of every gradient, its squares summed in float64 across the shards (of one replica under
        HSDP), rounded to fp32 once: the same value for any number of ranks (DeepSpeed's side does the same,
        engine/compat.py)."""
        local = [compat.local_tensor(p.grad) for p in self.params if p.grad is not None]
        norms = compat.foreach_norms_float64(local)
        total = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.shard_group)
        return total.sqrt().float()

    def was_step_applied(self) -> bool:
        return self.applied

    def get_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return self.norm

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool = False):
        """Every rank's shards into `save_dir/tag` (DCP), rank 0's schedule and counters beside them; the last
        act is a barrier, as DeepSpeed's: when it returns, every rank's files are complete."""
        import torch.distributed.checkpoint as dcp

        path = os.path.join(save_dir, tag)
        # a tensor every rank holds (a batch norm's running statistics, each rank's own) is written from rank 0, as
        # DeepSpeed writes the module's buffers, and as the export takes them
        with dcp_failures(path):
            dcp.save(self._state(), checkpoint_id=path, planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
        self._save_engine_state(path, client_state)
        dist.barrier()

    def start_checkpoint(self, save_dir: str, tag: str, client_state: dict):
        """save_checkpoint in the background: the shards copied to host memory now, written by DCP's thread while
        training goes on (its collectives on a gloo group of their own, never beside the step's); wait_checkpoint
        waits for the files."""
        import torch.distributed.checkpoint as dcp

        path = os.path.join(save_dir, tag)
        if self._checkpoint_group is None:  # every rank starts its first background write at the same step
            self._checkpoint_group = dist.new_group(backend="gloo")
        with dcp_failures(path):
            self._writing = (path, dcp.async_save(self._state(), checkpoint_id=path, process_group=self._checkpoint_group,
                                                  planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)))
        self._save_engine_state(path, client_state)

    def wait_checkpoint(self):
        """Until the background write's files are complete on this rank; OSError when a rank's write failed."""
        path, future = self._writing
        self._writing = None
        with dcp_failures(path):
            future.result()

    def _save_engine_state(self, path: str, client_state: dict):
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)  # a background write may not have made it yet
            # optimizer steps, not micro-batches: a resume may accumulate another number of micro-batches per step
            torch.save({"client_state": client_state, "lr_scheduler": self.lr_scheduler.state_dict(),
                        "optimizer_steps": self.micro_steps // self.cfg.grad_accum_steps,
                        "skipped_steps": self.skipped_steps},
                       os.path.join(path, ENGINE_STATE))

    def load_checkpoint(self, load_dir: str, tag: str):
        """(path, client_state) of the checkpoint `load_dir/tag`, loaded into the shards of this run's ranks,
        whatever number of ranks wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        path = os.path.join(load_dir, tag)
        state = self._state()
        # a parameter without gradients when the checkpoint was written (one the forward does not use: UperNet's
        # backbone's last norm) had no AdamW state; it has none to load now either
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        state["optim"]["state"] = {name: s for name, s in state["optim"]["state"].items()
                                   if all(f"optim.state.{name}.{k}" in stored for k in s)}
        dcp.load(state, checkpoint_id=path)
        # not strict: the parameters left out above; DCP's load has already refused a checkpoint missing a weight
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
        extra = torch.load(os.path.join(path, ENGINE_STATE), weights_only=False)
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.micro_steps = extra["optimizer_steps"] * self.cfg.grad_accum_steps
        self.skipped_steps = extra["skipped_steps"]
        return path, extra["client_state"]

    def full_state_dict(self, rank: int) -> dict:
        """The whole model's weights on rank 0's CPU ({} elsewhere), gathered parameter by parameter."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if rank == 0 else {}


@contextlib.contextmanager
def dcp_failures(path: str):
    """A rank's failed write, which DCP raises on every rank as a CheckpointException, as an OSError here."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        first = next(iter(e.failures.values()), (e,))  # rank -> (exception, its traceback)
        first = first[0] if isinstance(first, tuple) else first
        raise OSError(getattr(first, "errno", None), getattr(first, "strerror", None) or str(first),
                      getattr(first, "filename", path)) from e


def checkpoint_files_missing(path: str, world_size: int) -> list[str]:
    """The files of an FSDP2 checkpoint written by `world_size` ranks that are not in `path`."""
    names = set(os.listdir(path))
    wanted = [".metadata", ENGINE_STATE] + [f"__{r}_0.distcp" for r in range(world_size)]
    return [n for n in wanted if n not in names]
