"""PyTorch DistributedDataParallel as a training engine (`engine: ddp`): every rank holds the whole model, its
gradients and AdamW's states, and the gradients are all-reduced once per optimizer step. What people run for a
ViT-B on 8 GPUs, where the model's 16 bytes per parameter fit beside the activations many times over.

Activation checkpointing first, then each block compiled in place with `compile`, then DDP (gradients as views of
its buckets, so they take no second copy). Under bf16 the weights stay fp32 and the forward runs under
`torch.autocast` (DDP's usual mixed precision; the gradients and the all-reduce are fp32). Micro-batches before the
accumulation boundary run inside `no_sync()`, and the one all-reduce at the boundary averages what they summed.
The optimizer, the step, the float64 gradient norm (here of whole gradients, no collective) and the DCP checkpoints
are engine/torch_engine.py's: a checkpoint holds the weights once (the lowest rank writes what every rank holds)
and loads on any number of ranks.
"""
import contextlib
import functools

import torch

from config import Config
from engine.base import Built, Capabilities, Sizes
from engine.ds_config import resolve_precision
from engine.parallelize import apply_ac, cut_stage
from engine.torch_engine import TorchEngine, adamw_config
from models.blocks import find_blocks
from parallel import pipeline


def ddp_memory_parts(n_params: int, precision: str, fused_adamw: bool) -> dict:
    """Per-rank bytes beside the activations, under engine/memory.py's names: fp32 weights, fp32 gradients (DDP's
    bucket views, allocated at the start and held throughout), AdamW's two moments and, for the unfused (foreach)
    update, one model-sized temporary."""
    return {"weights": 4 * n_params, "gradients": 4 * n_params, "optimizer_states": 8 * n_params,
            "zero3_gathered": 0, "zero3_secondary": 0, "optimizer_step_temporaries": 0 if fused_adamw else 4 * n_params}


class DDPEngine(TorchEngine):
    name = "ddp"
    config_file = "ddp_config.json"
    capabilities = Capabilities(pipeline=True)

    def __init__(self, module: torch.nn.Module, ddp, cfg: Config, device: torch.device, precision: str,
                 layers=None):
        super().__init__(module, cfg, device, layers)
        self.ddp = ddp
        self._norm_group = False  # whole gradients, the same on every rank after the all-reduce
        self.precision = precision
        self._no_sync = None  # the no_sync() a micro-batch before the boundary runs in, from its forward to its backward

    # ------------------------------------------------------------------ before the model
    @classmethod
    def engine_config(cls, cfg: Config, hidden_size: int, world_size: int, precision: str,
                      ranks_per_node: int | None = None, gpu: bool | None = None) -> dict:
        gpu = torch.cuda.is_available() if gpu is None else gpu
        return {"engine": "ddp", "weights": "fp32, whole on every rank",
                "autocast": precision if precision != "fp32" else None, "gradient_as_bucket_view": True,
                "optimizer": adamw_config(cfg, gpu), "gradient_clipping": cfg.grad_clip,
                "gradient_accumulation_steps": cfg.grad_accum_steps,
                "train_micro_batch_size_per_gpu": cfg.micro_batch_size}

    @classmethod
    def wrap(cls, model: torch.nn.Module, cfg: Config, world_size: int, device_type: str, log=print,
             resharding: bool = False) -> Built:
        from torch.nn.parallel import DistributedDataParallel

        precision = resolve_precision(cfg.precision)
        config = cls.engine_config(cfg, 0, world_size, precision)
        mesh, stage, layers = cut_stage(model, cfg, device_type, log)  # a pipeline's stage, if pp_size > 1
        fixed = cls.memory(cfg, cls.sizes(model), world_size, precision, config, device_type == "cuda")[1]
        ac_plan = apply_ac(model, cfg, fixed, precision, device_type, log, stage)
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        model.to(device)
        if cfg.compile:
            for block in find_blocks(model):
                block.module.compile()
            log("compile: each block is compiled in place by torch.compile; the first steps are slow while it "
                "compiles")
        # a parameter the forward never uses (UperNet's backbone's last norm) gets no gradient: DDP must look for it
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                      gradient_as_bucket_view=True,
                                      find_unused_parameters=cfg.task == "segmentation",
                                      process_group=mesh.get_group("dp") if mesh is not None else None)
        engine = cls(model, ddp, cfg, device, precision, layers)
        if mesh is not None:
            engine._norm_group = mesh.get_group("pp")  # whole gradients of a stage: the stages' squares summed
            autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16) \
                if precision == "bf16" else None
            engine.pipeline = pipeline.Pipeline(model, stage, cfg.pp_size, mesh.get_group("pp"), device, cfg,
                                                wrapped=ddp, autocast=autocast)
        return Built(engine, ac_plan, config, precision, torch.float32)

    @classmethod
    def memory(cls, cfg, sizes: Sizes, data_ranks, precision, engine_config, gpu):
        parts = ddp_memory_parts(sizes.params, precision, fused_adamw=gpu)
        held = parts["weights"] + parts["gradients"] + parts["optimizer_states"]
        return parts, {"backward": held, "optimizer_step": held + parts["optimizer_step_temporaries"],
                       "zero3_gathered": 0}

    @classmethod
    def comm_bytes(cls, cfg, n_params, data_ranks, ranks_per_node, weight_bytes, engine_config):
        """One ring all-reduce of the fp32 gradients per optimizer step: 2(N-1)/N of them; across nodes when the
        job spans them."""
        sent = 2 * (data_ranks - 1) / data_ranks * 4 * n_params if data_ranks > 1 else 0.0
        return (0.0, sent) if data_ranks > ranks_per_node else (sent, 0.0)

    @classmethod
    def describe(cls, cfg: Config, world_size: int, module=None) -> str:
        return "DDP (replicated)"

    @classmethod
    def plan_label(cls, e: dict) -> str:
        return "DDP"

    @classmethod
    def search_variants(cls, world_size: int, ranks_per_node: int, tp_size: int) -> list[dict]:
        return [{}] if tp_size == 1 else []

    # ------------------------------------------------------------------ the step
    def __call__(self, *args, **kwargs):
        if self.pipeline is not None:  # evaluation: the stages one after the other
            return self.pipeline.forward(*args)
        if self.module.training and torch.is_grad_enabled() and not self.at_boundary and self._no_sync is None:
            self._no_sync = self.ddp.no_sync()  # left in backward
            self._no_sync.__enter__()
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if self.precision == "bf16" else \
                contextlib.nullcontext():
            return self.ddp(*args, **kwargs)

    def backward(self, loss: torch.Tensor):
        try:
            super().backward(loss)
        finally:
            if self._no_sync is not None:
                self._no_sync.__exit__(None, None, None)
                self._no_sync = None

    def full_state_dict(self, rank: int) -> dict:
        """The model's weights on rank 0's CPU ({} elsewhere): every rank holds them whole."""
        if self.pipeline is not None:
            return self.gather_stages(self.module.state_dict(), rank)
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()} if rank == 0 else {}
