"""Turn an unmodified Hugging Face model into a training engine, DeepSpeed's or FSDP2's: the one place a model is
wrapped.

`build_engine` is what train.py, the benchmark worker and the equivalence tests call. For DeepSpeed,
`parallelize` applies, in this order, activation checkpointing, ZeRO and torch.compile; for FSDP2
(engine/fsdp2.py), activation checkpointing, each block compiled, then `fully_shard`.
"""
import contextlib
import functools
from dataclasses import dataclass

import torch

from ac.policies import apply_activation_checkpointing
from ac.profile import profile_model
from config import Config
from engine import compat
from engine.ds_config import DTYPES, build_ds_config, resolve_precision
from engine.fsdp2 import FSDP2Engine, fsdp2_config, shard
from engine.memory import fsdp2_memory_bytes, zero_memory_bytes
from engine.optim import freeze, lr_schedule, param_groups
from engine.tensor_parallel import layout, rank_params, shard_head_biases, tp_config
from models import build_model, width
from models.blocks import find_blocks
from models.tasks import build_task_model


@dataclass
class Built:
    engine: object  # deepspeed.DeepSpeedEngine or FSDP2Engine: the model, its optimizer and its LR schedule
    ac_plan: dict  # what activation checkpointing applied, with its profile (ac_plan.json)
    ds_config: dict  # the resolved engine config (ds_config.json; FSDP2's: fsdp2_config.json)
    precision: str  # fp32 | bf16 | fp16
    dtype: torch.dtype  # what the model's inputs are cast to


def engine_config(cfg: Config, hidden_size: int, world_size: int) -> tuple[str, dict]:
    """(precision, engine config) of a run: DeepSpeed's config, or what FSDP2 is set up with; raises ConfigError
    on contradictions, before anything runs."""
    precision = resolve_precision(cfg.precision)
    if cfg.engine == "fsdp2":
        return precision, fsdp2_config(cfg, precision, torch.cuda.is_available())
    return precision, build_ds_config(cfg, hidden_size, world_size, precision)


def build_training_model(cfg: Config, ds_config: dict, class_names=None, log=None):
    """(model, image processor) of a run, initial weights from `cfg.seed` alone (or pretrained ones), with its
    stochastic depth and the parameters `cfg.freeze` names frozen.

    Under ZeRO-3 the model is created inside `deepspeed.zero.Init` (transformers does so while a ZeRO-3
    `HfDeepSpeedConfig` lives): every parameter is partitioned as it is created, and a local directory's
    weights are loaded into the partitions, so no rank holds the whole model at any moment. Registry weights
    are initialised module by module with that module's parameters gathered.
    """
    if cfg.task == "classification":
        build = functools.partial(build_model, cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size, class_names,
                                  seed=cfg.seed, drop_path=cfg.drop_path, log=log)
    else:
        build = functools.partial(build_task_model, cfg.model, cfg.task, cfg.num_labels, cfg.image_size,
                                  cfg.patch_size, seed=cfg.seed, drop_path=cfg.drop_path, class_names=class_names,
                                  mask_ratio=cfg.mask_ratio)
    if ds_config.get("zero_optimization", {}).get("stage") != 3:  # FSDP2: whole on each rank, then sharded
        model, processor = build()
    else:
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        hf_zero3 = HfDeepSpeedConfig(ds_config)  # transformers holds it weakly: it must live through the build
        extra = {} if cfg.task != "classification" else \
            dict(partitioned=lambda: deepspeed.zero.Init(config_dict_or_path=ds_config))
        model, processor = build(gathered=lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0),
                                 **extra)
        whole = [n for n, p in model.named_parameters() if not compat.is_zero3_partitioned(p)]
        if whole:
            raise RuntimeError(f"ZeRO-3: {len(whole)} parameters were not created partitioned, e.g. {whole[0]}")
        del hf_zero3
    if cfg.freeze:
        frozen = freeze(model, cfg.freeze)
        if log:
            total = sum(compat.param_numel(p) for p in model.parameters())
            log(f"freeze: {frozen:,} of {total:,} parameters are frozen ({cfg.freeze}); {total - frozen:,} train")
    return model, processor


def build_engine(model: torch.nn.Module, cfg: Config, world_size: int, device_type: str, log=print,
                 load_universal: bool = False) -> Built:
    """Wrap a freshly built model for training under `cfg`: train.py's path, and every benchmark's.
    `load_universal`: the engine will load a universal checkpoint (one written by another number of ranks)."""
    if cfg.engine == "fsdp2":
        return build_fsdp2(model, cfg, world_size, device_type, log)
    precision, ds_config = engine_config(cfg, width(model.config), world_size)
    if precision != "fp32" and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        # DeepSpeed casts the parameters to bf16/fp16 and leaves buffers in fp32 unless told: a batch norm (UperNet's)
        # would meet bf16 weights with fp32 running statistics, which torch's kernels refuse
        ds_config.setdefault("data_types", {})["buffer_dtype"] = precision
    if load_universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    engine, ac_plan = parallelize(model, cfg, ds_config, world_size, precision, device_type, log)
    return Built(engine, ac_plan, ds_config, precision, DTYPES[precision])


def build_fsdp2(model: torch.nn.Module, cfg: Config, world_size: int, device_type: str, log=print) -> Built:
    """Activation checkpointing (budgeted against what FSDP2 holds beside the activations), each block compiled
    with `compile`, then `fully_shard` per block and on the root (engine/fsdp2.py)."""
    precision, config = engine_config(cfg, width(model.config), world_size)
    n = sum(p.numel() for p in model.parameters())
    sizes = [sum(p.numel() for p in b.module.parameters()) for b in find_blocks(model)]
    shards = world_size // cfg.replicate_degree  # HSDP: a replica's shard group
    fixed = fsdp2_memory_bytes(n, n - sum(sizes), max(sizes), shards, precision, reshard=cfg.zero_stage == 3,
                               fused_adamw=device_type == "cuda")
    ac_plan = apply_ac(model, cfg, fixed, precision, device_type, log)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    shard(model, precision, device, reshard=cfg.zero_stage == 3, compile_blocks=cfg.compile,
          replicate=cfg.replicate_degree)
    if cfg.compile:
        log("compile: each block is compiled in place by torch.compile before fully_shard; the first steps are "
            "slow while it compiles")
    return Built(FSDP2Engine(model, cfg, device), ac_plan, config, precision, DTYPES[precision])


def parallelize(model: torch.nn.Module, cfg: Config, ds_config: dict, world_size: int, precision: str,
                device_type: str, log=print):
    """(DeepSpeed engine, activation-checkpointing plan).

    The order is fixed: checkpointing wraps the bare blocks (it profiles the model as defined), ZeRO then hooks
    whatever the blocks have become, and torch.compile traces the model with ZeRO's hooks in place.
    """
    # under tensor parallelism a rank holds its share of the blocks' matrices and the replicated rest, and ZeRO
    # partitions them over world_size / tp_size ranks
    fixed = zero_memory_bytes(rank_params(model, cfg.tp_size), cfg.zero_stage, world_size // cfg.tp_size, precision,
                              ds_config)
    ac_plan = apply_ac(model, cfg, fixed, precision, device_type, log)
    engine = apply_zero(model, cfg, ds_config, ac_plan)
    apply_compile(engine, cfg, log)
    return engine, ac_plan


def apply_ac(model, cfg, fixed, precision, device_type, log) -> dict:
    """Activation checkpointing per `cfg.ac`; `auto` budgets the activations against `fixed`, what the engine
    holds beside them (ZeRO's, engine/memory.py; or FSDP2's for the benchmark's baseline, benchmarks/bench_worker.py,
    which wraps its blocks through this function too). The profile is the planner's: the run's model on the meta device, in
    the run's precision, with the attention kernel of this device, so that no weight is gathered or allocated
    for it (ac/profile.py)."""
    measured = profile_model(cfg, device_type, DTYPES[precision])[0]
    return apply_activation_checkpointing(model, cfg.ac, device_type, fixed=fixed, log=log, profile=measured,
                                          compiled=cfg.compile)


def apply_zero(model, cfg, ds_config, ac_plan):
    """`deepspeed.initialize` with AdamW's parameter groups and the LR schedule; with tp_size > 1 DeepSpeed's AutoTP
    splits the blocks' linear layers first, as engine/tensor_parallel.py configures it.

    Under ZeRO-3 every transformer block is a leaf module (DeepSpeed's own switch): its weights are gathered
    and released once per block, with the hooks on the block, outside its checkpoint. A recompute then
    gathers nothing again (docs/activation_checkpointing.md).
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import set_z3_leaf_module

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


def apply_compile(engine, cfg, log):
    """torch.compile through DeepSpeed's `engine.compile()`, which compiles the module with its ZeRO hooks in
    place (ZeRO-3's break the graph around each block's gather; checkpointed blocks trace through)."""
    if not cfg.compile:
        return
    engine.compile()
    log("compile: the model is compiled by torch.compile, through DeepSpeed's engine.compile(); the first "
        "steps are slow while it compiles" if engine.is_compiled else "compile: DeepSpeed did not compile the model")
