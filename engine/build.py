"""Turn an unmodified Hugging Face model into a training engine: the one place a model is built for training and
wrapped (sequence parallelism's hooks here, then activation checkpointing, compile and the engine, in the engine's
`wrap`). train.py, the benchmark
worker and the equivalence tests all come through here."""
import functools

import torch
import torch.distributed as dist

import compat
from config import Config
from engine.base import Built
from engine.ds_config import resolve_precision
from engine.registry import engine_class
from loop.optim import freeze
from models import build_model
from models.tasks import build_task_model
from parallel import sequence


def engine_config(cfg: Config, hidden_size: int, world_size: int) -> tuple[str, dict]:
    """(precision, engine config) of a run; raises ConfigError on contradictions, before anything runs."""
    precision = resolve_precision(cfg.precision)
    return precision, engine_class(cfg.engine).engine_config(cfg, hidden_size, world_size, precision)


def build_training_model(cfg: Config, engine_config: dict, class_names=None, log=None):
    """(model, image processor) of a run, initial weights from `cfg.seed` alone (or pretrained ones), created as
    its engine needs it (ZeRO-3: partitioned as it is made), with its stochastic depth, its tokens split over
    `cfg.sp_size` ranks, and the parameters `cfg.freeze` names frozen."""
    if cfg.task == "classification":
        build = functools.partial(build_model, cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size, class_names,
                                  seed=cfg.seed, drop_path=cfg.drop_path, log=log)
    else:
        build = functools.partial(build_task_model, cfg.model, cfg.task, cfg.num_labels, cfg.image_size,
                                  cfg.patch_size, seed=cfg.seed, drop_path=cfg.drop_path, class_names=class_names,
                                  mask_ratio=cfg.mask_ratio)
    model, processor = engine_class(cfg.engine).build_model(build, cfg, engine_config)
    if cfg.sp_size > 1:  # the tokens split over each group of sp_size ranks (parallel/sequence.py)
        sequence.apply(model, cfg.sp_size, dist.get_rank(), dist.get_world_size(), cfg.tp_size)
    if cfg.freeze:
        frozen = freeze(model, cfg.freeze)
        if log:
            total = sum(compat.param_numel(p) for p in model.parameters())
            log(f"freeze: {frozen:,} of {total:,} parameters are frozen ({cfg.freeze}); {total - frozen:,} train")
    return model, processor


def build_engine(model: torch.nn.Module, cfg: Config, world_size: int, device_type: str, log=print,
                 resharding: bool = False) -> Built:
    """Wrap a freshly built model for training under `cfg`: train.py's path, and every benchmark's.
    `resharding`: the engine will load a checkpoint written by another number of ranks."""
    return engine_class(cfg.engine).wrap(model, cfg, world_size, device_type, log, resharding)
