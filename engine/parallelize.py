"""Activation checkpointing as every engine applies it, first, to the bare blocks of an unmodified model.

The engines (engine/deepspeed_zero.py, engine/fsdp2.py, engine/ddp.py) then compile and shard or replicate whatever
the blocks have become, in their `wrap`; engine/build.py's `build_engine` is the one entry to that.
"""
from ac.policies import apply_activation_checkpointing
from ac.profile import profile_model
from config import Config
from engine.ds_config import DTYPES
from loop.optim import layer_ids
from models.blocks import find_blocks
from parallel import pipeline, sequence


def apply_ac(model, cfg: Config, fixed: dict, precision: str, device_type: str, log, stage: int = 0) -> dict:
    """Activation checkpointing per `cfg.ac`; `auto` budgets the activations against `fixed`, what the engine
    holds beside them (engine/memory.py; the benchmark's plain FSDP2 wraps its blocks through this function too,
    benchmarks/bench_worker.py). The profile is the planner's: the run's model on the meta device, in the run's
    precision, with the attention kernel of this device, so that no weight is gathered or allocated for it
    (ac/profile.py); under a pipeline, of pipeline stage `stage`: its blocks with the pieces it holds at once
    (parallel/pipeline.py's stage_profile), so that `auto` recomputes more on the early stages, which hold more.
    Returns the plan (ac_plan.json)."""
    measured = rank_profile(cfg, device_type, precision, [b.name for b in find_blocks(model)], stage)
    return apply_activation_checkpointing(model, cfg.ac, device_type, fixed=fixed, log=log, profile=measured,
                                          compiled=cfg.compile)


def rank_profile(cfg: Config, device_type: str, precision: str, blocks: list, stage: int = 0):
    """The activation profile one rank holds (ac/profile.py): under sequence parallelism its share of the split
    blocks' tokens (Profile.sequence_share, as the planner counts them), under a pipeline its stage's `blocks`
    with the pieces the stage holds at once."""
    measured = profile_model(cfg, device_type, DTYPES[precision])[0]
    if cfg.sp_size > 1:  # each rank of a sequence group holds its tokens of the split blocks
        measured = measured.sequence_share(cfg.sp_size, sequence.split_blocks(p.name for p in measured))
    if cfg.pp_size > 1:  # the model holds a pipeline stage's blocks
        measured = pipeline.stage_profile(measured, blocks, cfg, stage)
    return measured


def cut_stage(model, cfg: Config, device_type: str, log) -> tuple:
    """With `pp_size` > 1: keep this rank's pipeline stage of `model` in place (parallel/pipeline.py) and say how
    the blocks are cut; (the (dp, pp) mesh, this rank's stage, the whole model's layer ids for layer-wise lr decay
    or None). Without a pipeline: (None, 0, None)."""
    if cfg.pp_size == 1:
        return None, 0, None
    mesh = pipeline.mesh(device_type, cfg.pp_size)
    stage = mesh.get_local_rank("pp")
    layers = layer_ids(model) if cfg.layer_decay < 1 else None  # numbered before the cut
    blocks = len(find_blocks(model))
    pipeline.split(model, stage, cfg.pp_size, cfg.pp_split)
    log(pipeline.describe(cfg, blocks))
    return mesh, stage, layers
