"""DeepSpeed ZeRO stage 1, 2 or 3 as a training engine (`engine: deepspeed`), behind engine/base.py's interface.

`wrap` applies, in this order, activation checkpointing, ZeRO (`deepspeed.initialize` with this project's AdamW
parameter groups and LR schedule; AutoTP first with tp_size > 1) and torch.compile through DeepSpeed's
`engine.compile()`. Under ZeRO-3 the model is created inside `deepspeed.zero.Init` (`build_model`), every
transformer block is a leaf module (its weights gathered and released once per block, outside its checkpoint,
so a recompute gathers nothing again), and checkpoints are DeepSpeed's own files (engine/zero_checkpoint.py).
"""
import contextlib

import torch

import compat
from config import Config, ConfigError
from engine.base import Built, Capabilities, Sizes
from engine.ds_config import DTYPES, build_ds_config, resolve_precision
from engine.memory import comm_bytes, zero_memory_bytes, zero_memory_parts
from engine.parallelize import apply_ac
from engine.zero_checkpoint import ZeroCheckpoint
from models.blocks import find_blocks
from models.registry import width
from parallel.tensor import layout, rank_params, shard_head_biases, tp_config

OFFLOAD_TEMPLATE = "ds_configs/zero3_offload.json"
ZEROPP_TEMPLATE = "ds_configs/zero3pp.json"


class DeepSpeedEngine:
    """deepspeed.DeepSpeedEngine (`self.ds`) under the interface."""
    name = "deepspeed"
    config_file = "ds_config.json"
    capabilities = Capabilities(tensor_parallel=True, muon=True, ds_config=True, fp16=True)
    checkpoint_format = ZeroCheckpoint()
    pipeline = None  # no pipeline stages under DeepSpeed here

    def __init__(self, ds_engine):
        self.ds = ds_engine
        self.module = ds_engine.module
        self.async_save = False  # DeepSpeed writes its checkpoints in the foreground here
        self.pending = None

    # ------------------------------------------------------------------ before the model
    @classmethod
    def engine_config(cls, cfg: Config, hidden_size: int, world_size: int, precision: str,
                      ranks_per_node: int | None = None, gpu: bool | None = None) -> dict:
        ds_config = build_ds_config(cfg, hidden_size, world_size, precision, ranks_per_node, gpu)
        offload = ds_config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
        if cfg.ema_decay and offload == "nvme":
            raise ConfigError("ema_decay with offload_param on nvme: the EMA averages the weights' partitions in "
                              "memory, and NVMe-offloaded partitions are not there; offload to cpu or set ema_decay 0")
        return ds_config

    @classmethod
    def build_model(cls, build, cfg: Config, engine_config: dict):
        """Under ZeRO-3 inside `deepspeed.zero.Init` (transformers does so while a ZeRO-3 `HfDeepSpeedConfig`
        lives): every parameter is partitioned as it is created, and a local directory's weights are loaded into
        the partitions, so no rank holds the whole model at any moment. Registry weights are initialised module
        by module with that module's parameters gathered."""
        if engine_config.get("zero_optimization", {}).get("stage") != 3:
            return build()
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        hf_zero3 = HfDeepSpeedConfig(engine_config)  # transformers holds it weakly: it must live through the build
        extra = {} if cfg.task != "classification" else \
            dict(partitioned=lambda: deepspeed.zero.Init(config_dict_or_path=engine_config))
        model, processor = build(gathered=lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0),
                                 **extra)
        whole = [n for n, p in model.named_parameters() if not compat.is_zero3_partitioned(p)]
        if whole:
            raise RuntimeError(f"ZeRO-3: {len(whole)} parameters were not created partitioned, e.g. {whole[0]}")
        del hf_zero3
        return model, processor

    @classmethod
    def wrap(cls, model: torch.nn.Module, cfg: Config, world_size: int, device_type: str, log=print,
             resharding: bool = False) -> Built:
        """Activation checkpointing wraps the bare blocks (it profiles the model as defined), ZeRO then hooks
        whatever the blocks have become, and torch.compile traces the model with ZeRO's hooks in place.
        `resharding`: load a universal checkpoint (one written by another number of ranks)."""
        precision = resolve_precision(cfg.precision)
        ds_config = cls.engine_config(cfg, width(model.config), world_size, precision)
        if precision != "fp32" and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            # DeepSpeed casts the parameters to bf16/fp16 and leaves buffers in fp32 unless told: a batch norm
            # (UperNet's) would meet bf16 weights with fp32 running statistics, which torch's kernels refuse
            ds_config.setdefault("data_types", {})["buffer_dtype"] = precision
        if resharding:
            ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
        # under tensor parallelism a rank holds its share of the blocks' matrices and the replicated rest, and ZeRO
        # partitions them over world_size / tp_size ranks
        fixed = zero_memory_bytes(rank_params(model, cfg.tp_size), cfg.zero_stage, world_size // cfg.tp_size,
                                  precision, ds_config)
        ac_plan = apply_ac(model, cfg, fixed, precision, device_type, log)
        engine = cls(initialize(model, cfg, ds_config, ac_plan))
        if cfg.compile:  # ZeRO-3's hooks break the graph around each block's gather; checkpointed blocks trace
            engine.ds.compile()
            log("compile: the model is compiled by torch.compile, through DeepSpeed's engine.compile(); the first "
                "steps are slow while it compiles" if engine.ds.is_compiled else
                "compile: DeepSpeed did not compile the model")
        return Built(engine, ac_plan, ds_config, precision, DTYPES[precision])

    @classmethod
    def memory(cls, cfg, sizes: Sizes, data_ranks, precision, engine_config, gpu):
        args = (sizes.params, cfg.zero_stage, data_ranks, precision, engine_config)
        return zero_memory_parts(*args), zero_memory_bytes(*args)

    @classmethod
    def comm_bytes(cls, cfg, n_params, data_ranks, ranks_per_node, weight_bytes, engine_config):
        return comm_bytes(n_params, cfg.zero_stage, cfg.grad_accum_steps, data_ranks,
                          max(1, ranks_per_node // cfg.tp_size), weight_bytes,
                          engine_config.get("zero_optimization", {}))

    @classmethod
    def optimizer_holders(cls, cfg: Config, data_ranks: int) -> int:
        return data_ranks

    @classmethod
    def numerics(cls, cfg: Config, engine_config: dict) -> str | None:
        """ZeRO++'s quantized communication and ZeRO-Offload's CPU Adam change the step's arithmetic."""
        zero = engine_config.get("zero_optimization", {})
        changes = [what for key, what in (("zero_quantized_weights", "int8 weights in its gathers"),
                                          ("zero_quantized_gradients", "int4 gradients in its reduce-scatter"))
                   if zero.get(key)]
        if zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None):
            changes.append("DeepSpeed's CPU Adam on the host instead of torch's AdamW")
        return ", ".join(changes) or None

    @classmethod
    def describe(cls, cfg: Config, world_size: int, module=None) -> str:
        hpz = compat.zero3_hpz_ranks(module) if cfg.zero_stage == 3 and module is not None else 1
        return f"ZeRO-{cfg.zero_stage}" + (f" (hpZ over {hpz} ranks)" if hpz > 1 else "")

    @classmethod
    def plan_label(cls, e: dict) -> str:
        """ZeRO-3's variants as the planner's tables mark them: ++ (ZeRO++), off (ZeRO-Offload)."""
        return f"ZeRO-{e['zero_stage']}" + ("++" if e["zeropp"] else (" off" if e["offload"]["optimizer"] else ""))

    @classmethod
    def search_variants(cls, world_size: int, ranks_per_node: int, tp_size: int) -> list[dict]:
        """The planner's candidates: ZeRO 1 to 3; without tensor parallelism also ZeRO-3 with the optimizer and
        the weights offloaded to host memory and, when the job spans nodes, ZeRO-3 with ZeRO++ (hpZ over a
        node, quantized weights and gradients: within one node hpZ's secondary partition would be the primary)."""
        found = [dict(zero_stage=s, ds_config="") for s in (1, 2, 3)]
        if tp_size == 1:
            found.append(dict(zero_stage=3, ds_config=OFFLOAD_TEMPLATE))
            if world_size > ranks_per_node:
                found.append(dict(zero_stage=3, ds_config=ZEROPP_TEMPLATE))
        return found

    # ------------------------------------------------------------------ the step
    def __call__(self, *args, **kwargs):
        return self.ds(*args, **kwargs)

    def train(self):
        self.ds.train()

    def eval(self):
        self.ds.eval()

    def backward(self, loss: torch.Tensor):
        self.ds.backward(loss)  # DeepSpeed divides by grad_accum_steps

    def step(self):
        self.ds.step()  # optimizer and LR schedule advance only at the accumulation boundary

    @property
    def at_boundary(self) -> bool:
        return self.ds.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        return self.ds.was_step_applied()

    @property
    def skipped_steps(self) -> int:
        return self.ds.skipped_steps

    def get_lr(self) -> list:
        return self.ds.get_lr()

    def get_global_grad_norm(self):
        return self.ds.get_global_grad_norm()

    @property
    def is_compiled(self) -> bool:
        return self.ds.is_compiled

    @property
    def optimizer_name(self) -> str:
        return compat.optimizer_name(self.ds)

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.ds.basic_optimizer

    def destroy(self):
        self.ds.destroy()

    # ------------------------------------------------------------------ checkpoints and export
    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict):
        self.ds.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)

    def start_checkpoint(self, save_dir: str, tag: str, client_state: dict):
        raise NotImplementedError("DeepSpeed's engine writes its checkpoints in the foreground here")

    def wait_checkpoint(self):
        raise NotImplementedError("DeepSpeed's engine writes its checkpoints in the foreground here")

    def close_failed_save(self, background: bool):
        compat.close_failed_save(self.ds)

    def load_checkpoint(self, load_dir: str, tag: str):
        with compat.universal_load_keeps_group_settings(self.ds):
            return self.ds.load_checkpoint(load_dir, tag=tag)

    def writing_local_weights(self):
        return compat.writing_zero3_partitions(self.ds)

    def full_state_dict(self, rank: int) -> dict:
        """The whole model's weights on rank 0 ({} elsewhere). Under ZeRO-3 each module's parameters are gathered
        in turn (`deepspeed.zero.GatheredParameters`) and copied out, so no rank gathers the whole model at once;
        under tensor parallelism DeepSpeed's own consolidation does the same over the tensor groups too."""
        import deepspeed

        module = self.module
        tensor_parallel = self.ds.autotp_size() > 1
        if not tensor_parallel and not self.ds.zero_optimization_partition_weights():
            return module.state_dict() if rank == 0 else {}
        params = {name for name, _ in module.named_parameters()}
        state = {k: v for k, v in module.state_dict().items() if k not in params} if rank == 0 else {}  # buffers
        if tensor_parallel:  # each AutoTP layer's shards, and under ZeRO-3 its partitions, gathered
            return {**state, **compat.tp_gathered_parameters(self.ds)}
        for prefix, sub in module.named_modules():
            own = dict(sub.named_parameters(recurse=False))
            if not own:
                continue
            with deepspeed.zero.GatheredParameters(list(own.values())):
                if rank == 0:
                    state.update({f"{prefix}.{n}" if prefix else n: p.detach().cpu().clone() for n, p in own.items()})
        return state


def initialize(model, cfg: Config, ds_config: dict, ac_plan: dict):
    """`deepspeed.initialize` with AdamW's parameter groups and the LR schedule; with tp_size > 1 DeepSpeed's AutoTP
    splits the blocks' linear layers first, as parallel/tensor.py configures it.

    Under ZeRO-3 every transformer block is a leaf module (DeepSpeed's own switch): its weights are gathered
    and released once per block, with the hooks on the block, outside its checkpoint. A recompute then
    gathers nothing again (docs/activation_checkpointing.md).
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import set_z3_leaf_module

    from loop.optim import lr_schedule, param_groups

    if ds_config.get("compile", {}).get("deepcompile"):  # DeepCompile JIT-builds its op at the first step
        compat.deepspeed_arch_list()
    if cfg.zero_stage == 3:
        for block in find_blocks(model):
            set_z3_leaf_module(block.module, True)
    if cfg.tp_size > 1:  # AutoTP splits the blocks' linear layers inside deepspeed.initialize
        ds_config["tensor_parallel"] = tp_config(model, cfg.tp_size)
        shard_head_biases(model, layout(dist.get_rank(), cfg.tp_size)[1], cfg.tp_size)
    with compat.autotp_sees_one_head_count(model) if cfg.tp_size > 1 else contextlib.nullcontext():
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, cfg.weight_decay, cfg.layer_decay, cfg.lr),
            config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(cfg)),
        )
    compat.zero12_grad_norm_in_float64(engine)
    if engine.zero_optimization_partition_weights():
        compat.make_zero3_linear_out_of_place()
        recomputed = {b["name"] for b in ac_plan["blocks"] if b["policy"] == "full"}
        for name, block in model.named_modules():
            if name in recomputed:
                for module in block.modules():
                    if isinstance(module, torch.nn.Linear):
                        compat.use_torch_linear(module)
    return engine
