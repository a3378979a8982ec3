"""What the torch engines (FSDP2, DDP) share: torch's AdamW and LR schedule stepped as DeepSpeed steps them, and
DCP checkpoints (engine/dcp_checkpoint.py).

The steps match DeepSpeed's: the loss divided by the accumulation steps, the global gradient norm summed in float64
(a run on another number of ranks clips by the same fp32 norm), clipping, a step with non-finite gradients skipped
(on CPU, where the norm is read without a device sync; on GPUs the fused update skips it on the device), the LR
schedule advancing with each applied step. AdamW is fused on GPUs and foreach on CPU, the update DeepSpeed's side
runs too (engine/ds_config.py). A subclass says how its gradients are reduced: `_sync(boundary)` before a
micro-batch's forward and backward, `_norm_group` for the norm's all-reduce.
"""
import contextlib
import os

import torch
import torch.distributed as dist

import compat
from config import Config
from engine import dcp_checkpoint
from engine.base import Sizes
from loop.optim import lr_schedule, param_groups
from models.blocks import find_blocks

ADAM_EPS = 1e-8


def adamw_config(cfg: Config, gpu: bool) -> dict:
    return {"type": "AdamW", "implementation": "fused" if gpu else "foreach", "lr": cfg.lr,
            "betas": [cfg.beta1, cfg.beta2], "eps": ADAM_EPS, "weight_decay": cfg.weight_decay}


class TorchEngine:
    """A wrapped model, its AdamW and LR schedule (see the module's docstring)."""
    checkpoint_format = dcp_checkpoint.DCPCheckpoint()

    pipeline = None  # parallel/pipeline.py's Pipeline under pp_size > 1: its schedule runs the forward and backward

    def __init__(self, module: torch.nn.Module, cfg: Config, device: torch.device, layers=None):
        self.module, self.cfg, self.device = module, cfg, device
        gpu = device.type == "cuda"
        # `layers`: the whole model's layer ids (loop/optim.py's layer_ids) when `module` holds a pipeline stage
        groups = param_groups(module, cfg.weight_decay, cfg.layer_decay, cfg.lr, layers)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=ADAM_EPS,
                                           weight_decay=cfg.weight_decay, fused=gpu, foreach=not gpu)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_schedule(cfg))
        self.micro_steps = 0  # micro-batches stepped, as DeepSpeed counts them
        self.skipped_steps = 0
        self.applied = True
        self.norm = None
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.async_save = cfg.async_save  # checkpoints/manager.py's save starts the write and commits it later
        self.pending = None  # checkpoints/manager.py's record of the checkpoint being written in the background
        self._writing = None  # its (path, future)
        self._checkpoint_group = None
        # the group the gradient norm's squares are summed over: None, every rank; False, none (whole gradients)
        self._norm_group = None

    # ------------------------------------------------------------------ before the model
    @classmethod
    def build_model(cls, build, cfg: Config, engine_config: dict):
        return build()  # whole on each rank, then sharded or replicated by `wrap`

    @classmethod
    def optimizer_holders(cls, cfg: Config, data_ranks: int) -> int:
        return 1

    @classmethod
    def numerics(cls, cfg: Config, engine_config: dict) -> str | None:
        return None

    @staticmethod
    def sizes(model: torch.nn.Module) -> Sizes:
        n = sum(p.numel() for p in model.parameters())
        blocks = [sum(p.numel() for p in b.module.parameters()) for b in find_blocks(model)]
        return Sizes(n, n - sum(blocks), max(blocks))

    # ------------------------------------------------------------------ the model
    def __call__(self, *args, **kwargs):
        if self.pipeline is not None:  # evaluation: the stages one after the other, the logits on every rank
            return self.pipeline.forward(*args)
        return self.module(*args, **kwargs)

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    @property
    def is_compiled(self) -> bool:
        return all(compat.is_compiled_in_place(b.module) for b in find_blocks(self.module))

    @property
    def optimizer_name(self) -> str:
        return type(self.optimizer).__name__

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    def gather_stages(self, state: dict, rank: int) -> dict:
        """Under a pipeline: the whole model's weights on rank 0's CPU ({} elsewhere) from `state`, each rank's
        stage whole; the ranks of the first pipeline send theirs."""
        mine = {k: v.detach().cpu() for k, v in state.items()} if rank < self.cfg.pp_size else {}
        del state
        parts = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if rank == 0 else {}

    def writing_local_weights(self):
        return contextlib.nullcontext()  # each rank's local tensors are the weights

    def destroy(self):
        pass

    # ------------------------------------------------------------------ the step
    @property
    def at_boundary(self) -> bool:
        """Is the next micro-batch the last of its optimizer step?"""
        return (self.micro_steps + 1) % self.cfg.grad_accum_steps == 0

    def backward(self, loss: torch.Tensor):
        """The micro-batch's gradients, divided by the accumulation steps; reduced at the last micro-batch of a
        step only."""
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
        """The L2 norm of every gradient, its squares summed in float64 over what this rank holds (and across
        `_norm_group`), rounded to fp32 once: the same value for any number of ranks (DeepSpeed's side does the
        same, compat.zero12_grad_norm_in_float64)."""
        local = [compat.local_tensor(p.grad) for p in self.params if p.grad is not None]
        norms = compat.foreach_norms_float64(local)
        total = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), dtype=torch.float64, device=self.device)
        if self._norm_group is not False:
            dist.all_reduce(total, group=self._norm_group)
        return total.sqrt().float()

    def was_step_applied(self) -> bool:
        return self.applied

    def get_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return self.norm

    # ------------------------------------------------------------------ checkpoints
    def _extra(self, client_state: dict) -> dict:
        # optimizer steps, not micro-batches: a resume may accumulate another number of micro-batches per step
        return {"client_state": client_state, "lr_scheduler": self.lr_scheduler.state_dict(),
                "optimizer_steps": self.micro_steps // self.cfg.grad_accum_steps, "skipped_steps": self.skipped_steps}

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict):
        """Every rank's shards into `save_dir/tag` (DCP), rank 0's schedule and counters beside them; the last
        act is a barrier, as DeepSpeed's: when it returns, every rank's files are complete."""
        dcp_checkpoint.save(self.module, self.optimizer, os.path.join(save_dir, tag), self._extra(client_state))
        dist.barrier()

    def start_checkpoint(self, save_dir: str, tag: str, client_state: dict):
        """save_checkpoint in the background: the shards copied to host memory now, written by DCP's thread while
        training goes on (its collectives on a gloo group of their own, never beside the step's); wait_checkpoint
        waits for the files."""
        path = os.path.join(save_dir, tag)
        if self._checkpoint_group is None:  # every rank starts its first background write at the same step
            self._checkpoint_group = dist.new_group(backend="gloo")
        future = dcp_checkpoint.save(self.module, self.optimizer, path, self._extra(client_state),
                                     group=self._checkpoint_group, background=True)
        self._writing = (path, future)

    def wait_checkpoint(self):
        """Until the background write's files are complete on this rank; OSError when a rank's write failed."""
        path, future = self._writing
        self._writing = None
        with dcp_checkpoint.dcp_failures(path):
            future.result()

    def close_failed_save(self, background: bool):
        if not background:
            dist.barrier()  # the closing barrier the other ranks' save_checkpoint waits in

    def load_checkpoint(self, load_dir: str, tag: str):
        """(path, client_state) of the checkpoint `load_dir/tag`, loaded into this run's ranks, whatever number
        of ranks wrote it."""
        path = os.path.join(load_dir, tag)
        extra = dcp_checkpoint.load(self.module, self.optimizer, path)
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.micro_steps = extra["optimizer_steps"] * self.cfg.grad_accum_steps
        self.skipped_steps = extra["skipped_steps"]
        return path, extra["client_state"]
