"""Every configuration of a run that fits a cluster, fastest first, and the smallest cluster one fits on."""
from dataclasses import replace

from ac.profile import PROFILE_BATCH, profile_model
from config import Config, ConfigError
from engine.deepspeed_zero import OFFLOAD_TEMPLATE, DeepSpeedEngine
from engine.ds_config import DTYPES
from engine.registry import ENGINES
from models.registry import model_config
from parallel import pipeline, sequence
from parallel.tensor import check_tp
from planner.devices import DEFAULT_MBU, DEFAULT_MFU, Device, target
from planner.estimate import estimate


def tp_sizes(cfg: Config, world_size: int, ranks_per_node: int) -> list:
    """The tensor-parallel sizes a search tries: cfg.tp_size if it is set, else every power of two that
    parallel/tensor.py accepts for this model and cluster (1 always)."""
    if cfg.tp_size > 1:
        return [cfg.tp_size]
    model = model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size)
    found = [1]
    for tp in (2**i for i in range(1, 7)):
        try:
            check_tp(model, tp, world_size, ranks_per_node)
        except ConfigError:
            continue
        found.append(tp)
    return found


def search(cfg: Config, ds_config_for, precision: str, world_size: int, ranks_per_node: int, device: Device,
           global_batch: int, mfu: float = DEFAULT_MFU, overlap: float = 0.0, policies=None,
           mbu: float = DEFAULT_MBU, rates=None, tp=None, engines=None, sp=None, pp=None) -> list:
    """Every (engine and its variant, tensor-parallel size, micro-batch, accumulation, ac policy) whose global batch
    is `global_batch` and whose peak fits, fastest first. `ds_config_for(cfg)`: the engine config of a candidate.
    `engines`: the engines to try (default every one in engine/registry.py), each with the variants its
    `search_variants` lists (DeepSpeed: ZeRO 1 to 3, offload, ZeRO++ across nodes; FSDP2: resharding or not,
    HSDP across nodes; DDP). `tp`: the tensor-parallel sizes to try (default tp_sizes()), each checked against the
    model and cluster. `sp`: the sequence-parallel sizes to try (default cfg.sp_size), each checked against the
    model (parallel/sequence.py) and within a node, and searched without tensor parallelism (they do not compose).
    `pp`: the pipeline sizes to try (default cfg.pp_size), each checked against the model (parallel/pipeline.py)
    and searched alone, under the engines that run a pipeline (FSDP2, DDP), with the pieces pp_microbatches gives,
    over the cuts of the blocks `pipeline.candidate_splits` lists (cfg's `pp_split` alone when it sets one).
    `rates`: a calibration of cfg's micro-batch (estimate()), which then is the only micro-batch and the only
    tensor-parallel size (cfg's) searched."""
    policies = policies or ("none", "light", "selective", "full")
    found = []
    if tp:
        model = model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size)
        for size in tp:
            check_tp(model, size, world_size, ranks_per_node)
    layouts = [(size, cfg.sp_size if size == 1 else 1, cfg.pp_size if size == 1 else 1)
               for size in ([cfg.tp_size] if rates else tp or tp_sizes(cfg, world_size, ranks_per_node))]
    for split in sp or []:  # each sequence-parallel size, without tensor parallelism
        model = model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size)
        if why := sequence.check(model, split, world_size, 1, cfg.task):
            raise ConfigError(f"--sp_sizes: {why}")
        if split > ranks_per_node:
            raise ConfigError(f"--sp_sizes: a sequence group of {split} ranks spans nodes ({ranks_per_node} per node)")
        layouts.append((1, split, 1))
    for stages in pp or []:  # each pipeline size, alone
        model = model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size)
        if why := pipeline.check(model, replace(cfg, pp_size=stages, tp_size=1, sp_size=1, replicate_degree=1,
                                                ema_decay=0.0), world_size):
            raise ConfigError(f"--pp_sizes: {why}")
        layouts.append((1, 1, stages))
    layouts, profiles = list(dict.fromkeys(layouts)), {}
    if all(global_batch % (world_size // (size * split * stages)) for size, split, stages in layouts):
        raise ConfigError(f"global batch {global_batch} is not a multiple of the world size {world_size}"
                          + (" over any tensor or sequence group searched" if len(layouts) > 1 else ""))
    for size, split, stages in layouts:
        batch_ranks = world_size // (size * split * stages)  # ranks reading different micro-batches
        if global_batch % batch_ranks:
            continue
        per_rank = global_batch // batch_ranks  # images per data-parallel rank
        micro_batches = [m for m in (2**i for i in range(0, 13)) if per_rank % m == 0] or [1]
        if rates:
            if per_rank % cfg.micro_batch_size:
                raise ConfigError(f"the calibrated micro-batch {cfg.micro_batch_size} does not divide the "
                                  f"{per_rank} images per rank of global batch {global_batch}")
            micro_batches = [cfg.micro_batch_size]
        if size not in profiles:  # the whole sequence's: estimate() takes a sequence group's share
            profiles[size] = profile_model(replace(cfg, micro_batch_size=PROFILE_BATCH, tp_size=size),
                                           target(device), DTYPES[precision])
        base = profiles[size]
        variants = [(name, v) for name, e in ENGINES.items() if not engines or name in engines
                    if stages == 1 or e.capabilities.pipeline
                    for v in e.search_variants(world_size, ranks_per_node, size)
                    if stages == 1 or v.get("replicate_degree", 1) == 1]
        for engine, variant in variants:
            for micro in micro_batches:
                if stages > 1 and micro % pipeline.microbatches(stages, cfg.pp_microbatches, micro):
                    continue  # the given pieces do not divide this micro-batch
                scaled = (base[0].scaled(micro / PROFILE_BATCH), *base[1:])
                cuts = [""] if stages == 1 else [cfg.pp_split] if cfg.pp_split and stages == cfg.pp_size else \
                    pipeline.candidate_splits(len(base[0]), stages)
                for ac, cut in ((ac, cut) for ac in policies for cut in cuts):
                    candidate = replace(cfg, **{"engine": engine, "micro_batch_size": micro, "tp_size": size,
                                                "sp_size": split, "pp_size": stages, "pp_split": cut,
                                                "grad_accum_steps": per_rank // micro, "ac": ac, "ds_config": "",
                                                "replicate_degree": 1, **variant})
                    est = estimate(candidate, ds_config_for(candidate), precision, world_size, ranks_per_node,
                                   device, mfu, overlap, scaled, mbu, rates)
                    if est["fits"]:
                        found.append(est)
    # equal times (compute-bound either way): fewer accumulation steps, then the lower peak, then no tensor
    # parallelism
    return sorted(found, key=lambda e: (round(e["step_s"], 6), e["grad_accum_steps"], e["peak_bytes"], e["tp_size"]))


def smallest_cluster(cfg: Config, ds_config_for, precision: str, ranks_per_node: int, device: Device,
                     limit: int = 2**20):
    """(the fewest ranks, a power of two, on which ZeRO-3 with full recompute at micro-batch 1 fits, with the
    optimizer and weights offloaded if that is what fits first; whether it is) or (None, False)."""
    cfg = replace(cfg, tp_size=1, engine=DeepSpeedEngine.name)
    base = profile_model(replace(cfg, micro_batch_size=1), target(device), DTYPES[precision])
    world = 1
    while world <= limit:
        for template in ("", OFFLOAD_TEMPLATE):
            candidate = replace(cfg, zero_stage=3, micro_batch_size=1, grad_accum_steps=1, ac="full",
                                ds_config=template)
            if estimate(candidate, ds_config_for(candidate), precision, world, ranks_per_node, device,
                        measured=base)["fits"]:
                return world, bool(template)
        world *= 2
    return None, False
