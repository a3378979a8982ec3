"""Train a Hugging Face ViT or Swin with DeepSpeed ZeRO stage 1, 2 or 3, PyTorch FSDP2 (`--engine fsdp2`) or DDP
(`--engine ddp`): an image classifier, masked-image pretraining (`--task mae`, `--task simmim`) or a segmenter.

    deepspeed --num_gpus 2 train.py --config configs/digits-vit.yaml    # CPU: 2 ranks, gloo; GPU: NCCL
    deepspeed train.py --config my-recipe.yaml --model vit-base          # every GPU of this node
    torchrun --nproc_per_node 2 train.py --zero_stage 3
    torchrun --nproc_per_node 2 train.py --engine fsdp2                  # PyTorch FSDP2 instead of DeepSpeed
    torchrun --nproc_per_node 2 train.py --engine ddp                    # DistributedDataParallel (replicated)
    accelerate launch --multi_gpu --num_processes 2 train.py --model swin-debug
    python train.py --max_steps 20                                       # one rank

`python train.py --help` lists every config key with its default and meaning (config.py defines them); `--key value`
overrides the recipe.
The run directory receives config.yaml, the engine's config (ds_config.json, fsdp2_config.json or ddp_config.json),
ac_plan.json, hf_config/, metrics.jsonl, TensorBoard events (tb/), checkpoints (checkpoints/: DeepSpeed's, or the
torch engines' through torch.distributed.checkpoint) and, at the end, hf_model/ for `transformers.pipeline` (with task mae
also encoder/, which `--model` loads as a classifier to fine-tune).
"""
import contextlib
import functools
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import compat
from ac.policies import check_policy
from checkpoints.hf_export import export_hf_model
from checkpoints.manager import Resume, check_same_model, describe_load_error, find_resume, remove_interrupted, save
from checkpoints.sync import Mirror, restore
from config import Config, ConfigError, help_text, parse
from data.loader import (ShardStream, TrainLoader, check_labels, check_masks, check_streams, eval_batches,
                         merge_states, resume_state)
from data.shards import DataError, coverage, parse_spec
from data.synthetic import SyntheticBatches
from data.synthetic import val_batches as synthetic_val
from data.transforms import (EvalTransform, Normalize, SegEvalTransform, SegTrainTransform, TrainTransform,
                             mix_batch)
from engine.base import Engine
from engine.build import build_engine, build_training_model, engine_config
from engine.registry import check_engine
from loop.distributed import (DistributedError, Heartbeat, cap_device_memory, check_device_memory, dist_env,
                              exit_distributed, fail_fast, init_distributed, ranks_per_node)
from loop.ema import EMA
from loop.evaluation import Evaluation, evaluate
from loop.interval import Closed, Interval, StepRecord
from loop.optim import frozen_names
from loop.peak_memory import memory_profiler, memory_trace, peak_memory_bytes
from loop.preemption import EXIT_PREEMPTED, Preemption
from loop.timing import clock
from models.blocks import find_blocks
from models.registry import check_weight_files, width
from models.tasks import meta_model, run_config, task_loss
from parallel import pipeline, sequence
from parallel.tensor import check_tp, layout
from runlog import tracking
from runlog.log import RunLog

# a resumed run whose data layout changed starts a fresh data order, seeded by the seed and the step
RESEED_STRIDE = 1_000_003
EXIT_NONFINITE = 5  # max_bad_steps non-finite steps in a row, or a non-finite model at export
EXIT_COLLECTIVE = 6  # a collective failed, or no progress for dist_timeout: another rank died or stalled


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):  # every key, its default and meaning (config.py), from one rank
        if os.environ.get("RANK", "0") == "0":
            print(help_text(), end="")
        return
    run = setup(argv)  # the input checked, then the process group, the watchdog, fail-fast and the signals
    model = build(run)  # weights from the seed alone, then activation checkpointing -> ZeRO -> compile
    start = resume(run, model)  # weights, optimizer, data position and EMA of the checkpoint, if there is one
    data = build_data(run, model, start)
    log = open_log(run, model, start, data)
    trained = train(run, model, start, data, log)
    finish(run, model, start, trained, log)  # the Hugging Face export and the summary


# ---------------------------------------------------------------------------------------------------- setup
@dataclass
class Checked:
    """What check_run found valid: the run's inputs."""
    train_sources: list
    val_sources: list
    class_names: list | None  # from the train shards' _info.json
    engine_config: dict  # the engine's config as the run config gives it (before the model is profiled)
    resume: Resume | None  # the checkpoint to continue from
    param_shapes: dict  # {name: shape} of the model as defined: train_state.json records them
    mirror: Mirror | None = None  # sync_to: where rank 0 uploads checkpoints and the export


def check_run(cfg: Config, world_size: int, rank: int) -> Checked:
    """Every check on the input that can fail, before anything is written or any process group forms."""
    if why := check_device_memory(cfg.device_memory_gb):
        raise ConfigError(why)
    check_engine(cfg)  # an unknown engine, or a feature it lacks
    if world_size % cfg.replicate_degree:
        raise ConfigError(f"replicate_degree {cfg.replicate_degree} does not divide the world size ({world_size}): "
                          f"HSDP's replicas each shard the model over the same number of ranks")
    synthetic = cfg.data_mode == "synthetic"  # no shards read (data/synthetic.py)
    train_sources = [] if synthetic else parse_spec(cfg.train_shards, "train_shards")
    val_sources = [] if synthetic else parse_spec(cfg.val_shards, "val_shards")
    notes = coverage(train_sources, "train_shards") + coverage(val_sources, "val_shards")
    if notes and cfg.strict_data:
        raise DataError(f"{notes[0]} (strict_data)")
    for note in notes if rank == 0 else []:
        print(f"warning: {note}", file=sys.stderr)
    epochs_to_steps(cfg, train_sources, world_size // cfg.model_parallel)
    names = train_sources[0].class_names if train_sources else None
    if names is not None and len(names) != cfg.num_labels:
        raise ConfigError(f"num_labels is {cfg.num_labels} but the train shards' _info.json lists {len(names)} classes")
    check = check_masks if cfg.task == "segmentation" else check_labels  # MAE and SimMIM read labelled shards too
    if not synthetic:
        check(train_sources, cfg.num_labels, "train_shards")
        check(val_sources, cfg.num_labels, "val_shards")
    # an unknown model name or a task it cannot do raises here; a contradicting DeepSpeed JSON below
    defined = run_config(cfg)[0]
    check_tp(defined, cfg.tp_size, world_size, ranks_per_node())
    if why := sequence.check(defined, cfg.sp_size, world_size, cfg.tp_size, cfg.task):
        raise ConfigError(why)
    if why := pipeline.check(defined, cfg, world_size):
        raise ConfigError(why)
    if os.path.isdir(cfg.model):  # a cut-off copy of its weights fails here, by name, not inside transformers
        check_weight_files(cfg.model)
    defined_model = meta_model(cfg)  # the model as defined, on meta
    if not find_blocks(defined_model):  # what the checkpointing policies and ZeRO-3's gathering wrap
        raise ConfigError(f"model {cfg.model}: no transformer blocks found in {type(defined_model).__name__} (an "
                          f"nn.ModuleList whose elements hold an attention module); this trainer trains ViT, Swin "
                          f"and SegFormer models")
    shapes = {n: list(p.shape) for n, p in defined_model.named_parameters()}
    if cfg.freeze:  # a pattern that names no parameter fails here, on the model's shapes alone
        frozen_names(list(shapes), cfg.freeze)
    _, config = engine_config(cfg, width(defined), world_size)  # the engine's own contradictions raise here
    check_policy(cfg.ac, "cuda" if torch.cuda.is_available() else "cpu")
    data_ranks = world_size // cfg.model_parallel  # the ranks of a tensor or sequence group read the same batches
    streams = cfg.data_streams and not synthetic
    if streams and (why := check_streams(cfg.data_streams, data_ranks, cfg.grad_accum_steps, cfg.num_workers)):
        raise ConfigError(f"data_streams: {why}")
    if cfg.warmup_steps >= cfg.max_steps and rank == 0:  # a short debug run may mean it; say what it does
        print(f"warning: warmup_steps {cfg.warmup_steps} >= max_steps {cfg.max_steps}: the learning rate rises "
              f"for the whole run and peaks at {cfg.max_steps / cfg.warmup_steps:.3g} x lr", file=sys.stderr)

    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    if cfg.resume not in ("", "latest") and not os.path.isdir(cfg.resume):
        raise ConfigError(f"resume: checkpoint directory '{cfg.resume}' does not exist")
    if not cfg.resume and os.path.exists(os.path.join(ckpt_dir, "latest")):
        raise ConfigError(f"output_dir '{cfg.output_dir}' already holds a run: continue it with --resume latest "
                          f"or choose another output_dir")
    mirror = Mirror(cfg.sync_to) if cfg.sync_to else None
    if mirror and rank == 0:  # a bucket that is not there or an endpoint that does not answer: here, not later
        mirror.check()
    if mirror and cfg.resume == "latest":  # a new node: the mirror's newest checkpoint, when output_dir has none as new
        restore(mirror, ckpt_dir, rank, log=print if rank == 0 else lambda *_: None)
    resume = find_resume(cfg, world_size)  # a missing file, a changed ZeRO stage or another model fails here
    if resume:
        check_same_model(resume.state, resume.path, shapes)
    if resume and resume.note and rank == 0:
        print(resume.note, file=sys.stderr)
    if rank == 0:  # a tracker asked for that does not answer (rank 0 alone talks to trackers)
        tracking.check_reachable(cfg)
    if rank == 0:  # probe writability last, so a failure above leaves no directory behind
        existed = os.path.isdir(cfg.output_dir)
        try:
            os.makedirs(cfg.output_dir, exist_ok=True)
            probe = os.path.join(cfg.output_dir, ".write-test")
            open(probe, "w").close()
            os.remove(probe)
        except OSError as e:
            if not existed and os.path.isdir(cfg.output_dir):
                shutil.rmtree(cfg.output_dir, ignore_errors=True)
            raise ConfigError(f"output_dir '{cfg.output_dir}' is not writable: {e.strerror}") from None
    return Checked(train_sources, val_sources, names, config, resume, shapes, mirror)



def epochs_to_steps(cfg: Config, train_sources: list, data_ranks: int):
    """`epochs` and `warmup_epochs` as optimizer steps (max_steps, warmup_steps): the train shards' samples (their
    _info.json counts) over the global batch, rounded up."""
    if not (cfg.epochs or cfg.warmup_epochs):
        return
    counts = [c for src in train_sources for c in (src.counts or [None])]
    if not counts or None in counts:
        raise ConfigError("epochs and warmup_epochs need the train shards' sample counts, from the _info.json "
                          "data/make_shards.py writes beside them (or synthetic data has none): give max_steps and "
                          "warmup_steps instead")
    per_epoch = sum(counts) / images_per_step(cfg, data_ranks * cfg.model_parallel)
    if cfg.epochs:
        cfg.max_steps = max(1, math.ceil(cfg.epochs * per_epoch))
    if cfg.warmup_epochs:
        cfg.warmup_steps = math.ceil(cfg.warmup_epochs * per_epoch)


@dataclass
class Run:
    """The run as set up: its config and input, where this process sits, and what every phase reports to."""
    cfg: Config
    checked: Checked
    rank: int
    world_size: int
    local_world: int  # ranks on this node
    data_rank: int  # this rank's tensor or sequence group among the data-parallel ones
    tp_rank: int  # this rank within its tensor or sequence group (parallel/tensor.py, parallel/sequence.py)
    device: torch.device
    heartbeat: Heartbeat  # where this rank is; a dead or stalled rank stops the others within dist_timeout
    preemption: Preemption  # SIGTERM/SIGUSR1: finish the step, checkpoint, exit
    flush_logs: list  # what a failing rank flushes before it exits
    ckpt_dir: str

    @property
    def data_ranks(self) -> int:
        """world_size / (tp_size x sp_size): the micro-batches of one accumulation step, read in parallel."""
        return self.world_size // self.cfg.model_parallel


def check_input(argv, rank: int, world_size: int) -> tuple[Config, Checked]:
    """The run config and its checked inputs; bad input is one line (rank 0's) and exit 2, with nothing written."""
    try:
        cfg = parse(argv)
        return cfg, check_run(cfg, world_size, rank)
    except (ConfigError, DataError, ValueError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # a launcher kills the other ranks when one exits: rank 0 reports first
            time.sleep(5)
        sys.exit(2)


def setup(argv) -> Run:
    """Check the input, then join the process group and start what watches the run."""
    rank, world_size, local_rank, local_world = dist_env()
    cfg, checked = check_input(argv, rank, world_size)
    if "OMP_NUM_THREADS" not in os.environ:  # cores / ranks on this node, as on every benchmark here
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    try:  # after the checks: bad input fails in a second, not after DeepSpeed's import
        device = init_distributed(local_rank, cfg.dist_timeout)
    except DistributedError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)  # every rank: each node has its own view of the network
        if rank == 0 and not os.listdir(cfg.output_dir):  # created by check_run, nothing written yet
            os.rmdir(cfg.output_dir)
        sys.exit(2)
    cap_device_memory(device, cfg.device_memory_gb)
    heartbeat = Heartbeat(rank, world_size, cfg.dist_timeout, EXIT_COLLECTIVE)
    heartbeat.beat("starting")
    # an exception on any rank ends the job in seconds, its traceback in errors/rank<N>.txt, the logs flushed
    flush_logs = []
    fail_fast(heartbeat, cfg.output_dir, flush_logs)
    data_rank, tp_rank = layout(rank, cfg.model_parallel)
    run = Run(cfg, checked, rank, world_size, local_world, data_rank, tp_rank, device, heartbeat,
              Preemption(cfg.preempt_grace), flush_logs, os.path.join(cfg.output_dir, "checkpoints"))
    if rank == 0:
        remove_interrupted(run.ckpt_dir)
    resume = checked.resume
    if resume and resume.reshard:  # written by another number of ranks, in a format converted first
        heartbeat.beat("converting the checkpoint for this number of ranks")
        if rank == 0:
            try:
                resume.convert(world_size)
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                os._exit(2)  # the other ranks wait in the barrier below; the launcher ends them
        dist.barrier()
    return run


# ---------------------------------------------------------------------------------------------------- model
@dataclass
class Model:
    engine: Engine  # engine/base.py's interface: DeepSpeed's, FSDP2's or DDP's
    processor: object  # the Hugging Face image processor: normalisation, and saved with the export
    ac_plan: dict
    engine_config: dict
    precision: str
    dtype: torch.dtype
    n_params: int


def build(run: Run) -> Model:
    """The model from the seed alone (under ZeRO-3 every parameter is partitioned as it is created, so no rank
    holds the whole model), wrapped: activation checkpointing, then ZeRO, then torch.compile."""
    cfg, rank, resume = run.cfg, run.rank, run.checked.resume
    run.heartbeat.beat("building the model")
    model, processor = build_training_model(cfg, run.checked.engine_config, run.checked.class_names,
                                            log=print if rank == 0 else None)
    torch.manual_seed(cfg.seed)  # dropout and stochastic depth draw from here, however the model was built
    n_params = sum(compat.param_numel(p) for p in model.parameters())
    run.heartbeat.beat("wrapping the model")
    try:
        built = build_engine(model, cfg, run.world_size, run.device.type, log=print if rank == 0 else lambda *a: None,
                             resharding=bool(resume and resume.reshard))
    except ConfigError as e:  # an `auto` budget that cannot be met shows only once the model is profiled
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
            if not os.listdir(cfg.output_dir):  # created by check_run, nothing written yet
                os.rmdir(cfg.output_dir)
        sys.exit(2)
    return Model(built.engine, processor, built.ac_plan, built.engine_config, built.precision, built.dtype, n_params)


# ---------------------------------------------------------------------------------------------------- resume
@dataclass
class Start:
    step: int  # the last step done: 0 for a fresh run
    data_state: dict | None  # the data position to continue from; None: a fresh data order
    data_streams: int  # the data_streams the data position was written with (or the config's)
    ema: EMA | None


def resume(run: Run, model: Model) -> Start:
    cfg, rank, resume = run.cfg, run.rank, run.checked.resume
    start = Start(0, None, cfg.data_streams, None)
    if cfg.resume and resume is None and rank == 0:
        print(f"resume: no checkpoint in {run.ckpt_dir} yet, starting from step 0")
    if resume:
        run.heartbeat.beat("loading the checkpoint")
        try:
            path, client_state = model.engine.load_checkpoint(resume.load_dir, resume.load_tag)
        except RuntimeError as e:  # another model's checkpoint: one line, every rank stops (bad input)
            if (why := describe_load_error(e, resume.path)) is None:
                raise
            if rank == 0:
                print(f"error: {why}", file=sys.stderr, flush=True)
            else:  # a launcher ends the other ranks when one exits: rank 0 reports first
                time.sleep(5)
            os._exit(2)
        if path is None:
            raise SystemExit(f"error: could not load a checkpoint from {resume.path}")
        start.step = client_state["step"]
        start.data_state, streams, why_not = resume_state(
            resume.state and resume.state["data"], step=start.step, mode=cfg.data_mode, seed=cfg.seed,
            data_streams=cfg.data_streams, world_size=run.data_ranks, grad_accum_steps=cfg.grad_accum_steps,
            num_workers=cfg.num_workers, micro_batch_size=cfg.micro_batch_size, shuffle_buffer=cfg.shuffle_buffer)
        start.data_streams = streams or start.data_streams
        if rank == 0:
            print(f"resumed from {path} at step {start.step}" + (
                "" if start.data_state else f"; data order restarts ({why_not})"))
    # the EMA of the weights: each rank averages what it holds of them (under ZeRO-3 its partition)
    start.ema = EMA(model.engine.module, cfg.ema_decay, cfg.pp_size) if cfg.ema_decay else None
    if start.ema and resume and not start.ema.load(resume.path) and rank == 0:
        print(f"ema: {resume.path} holds no EMA; it starts from the resumed weights")
    return start


# ---------------------------------------------------------------------------------------------------- data
@dataclass
class Data:
    train_batches: TrainLoader
    per_epoch: int | None  # micro-batches per rank in an epoch; None in resampled mode
    normalize: Normalize  # uint8 from the loader to the model's input, on the device
    val_batches: functools.partial  # a fresh pass over the validation set


def build_data(run: Run, model: Model, start: Start) -> Data:
    """Every rank and worker reads its own deterministic slice; a checkpoint's data position makes a resumed run
    read exactly what the uninterrupted run would have read next."""
    cfg, processor = run.cfg, model.processor
    segmentation = cfg.task == "segmentation"  # (image, mask) samples, transformed together
    if cfg.data_mode == "synthetic":
        shape = (cfg.micro_batch_size, cfg.image_size, cfg.num_labels, cfg.task, cfg.seed, run.data_rank)
        return Data(SyntheticBatches(*shape), None, Normalize(processor), functools.partial(synthetic_val, *shape))
    train_transform, eval_transform = (SegTrainTransform, SegEvalTransform) if segmentation else \
        (TrainTransform, EvalTransform)
    train_stream = ShardStream(
        run.checked.train_sources, mode=cfg.data_mode, rank=run.data_rank, world_size=run.data_ranks,
        num_workers=cfg.num_workers, micro_batch_size=cfg.micro_batch_size, shuffle_buffer=cfg.shuffle_buffer,
        grad_accum_steps=cfg.grad_accum_steps, streams=start.data_streams,
        seed=cfg.seed if start.data_state or not start.step else cfg.seed * RESEED_STRIDE + start.step,
        transform=train_transform(processor, cfg.crop_scale_min, cfg.hflip, cfg.randaug_n, cfg.randaug_m),
        state=start.data_state, num_labels=cfg.num_labels, task=cfg.task)
    val_batches = functools.partial(eval_batches, run.checked.val_sources, eval_transform(processor),
                                    cfg.micro_batch_size, run.data_rank, run.data_ranks, cfg.num_labels, cfg.task)
    return Data(TrainLoader(train_stream, cfg.num_workers), train_stream.batches_per_rank_epoch(),
                Normalize(processor), val_batches)


def open_log(run: Run, model: Model, start: Start, data: Data) -> RunLog:
    """The run's one-line description, then its directory's files and logs (runlog/log.py)."""
    cfg, world_size, local_world = run.cfg, run.world_size, run.local_world
    engine = type(model.engine)
    if run.rank == 0:
        sharding = engine.describe(cfg, world_size, model.engine.module)
        model_parallel = [(cfg.tp_size, "tensor parallel"), (cfg.sp_size, "sequence parallel"),
                          (cfg.pp_size, "pipeline stages")]
        print(f"{cfg.model}: {model.n_params / 1e6:.2f}M params | {sharding} | {model.engine.optimizer_name} | "
              f"{model.precision} | world size {world_size} ({world_size // local_world} node(s) x {local_world}, "
              f"{run.device.type}, {torch.get_num_threads()} threads per rank)"
              + (f" = {run.data_ranks} data" if cfg.model_parallel > 1 else "")
              + "".join(f" x {size} {what}" for size, what in model_parallel if size > 1) +
              f" | global batch {images_per_step(cfg, world_size)} = {cfg.micro_batch_size} micro x "
              f"{cfg.grad_accum_steps} accum x {run.data_ranks} ranks | steps {start.step}->"
              f"{cfg.max_steps}" + (f" ({cfg.epochs:g} epochs)" if cfg.epochs else "") + f" | data {cfg.data_mode}"
              + (f", {data.per_epoch // cfg.grad_accum_steps} steps per epoch" if data.per_epoch else ""))
    run.heartbeat.beat("opening the logs")
    tags = {}
    if run.rank == 0:  # what the trackers file the run under
        tags = {"engine": cfg.engine, "zero_stage": cfg.zero_stage, "world_size": world_size, "task": cfg.task,
                "model": cfg.model, "params_millions": round(model.n_params / 1e6, 2), "precision": model.precision,
                "ac": cfg.ac, "commit": tracking.source_commit()}
    return RunLog(cfg, run.rank, start.step, (engine.config_file, model.engine_config), model.ac_plan,
                  model.engine.module, model.processor, run.flush_logs, tags)


def images_per_step(cfg: Config, world_size: int) -> int:
    return cfg.micro_batch_size * cfg.grad_accum_steps * world_size // cfg.model_parallel


# ---------------------------------------------------------------------------------------------------- step
def train_step(run: Run, model: Model, data: Data, step: int) -> tuple[torch.Tensor, int, int, float]:
    """One optimizer step over grad_accum_steps micro-batches: (this rank's loss summed over them, on the device;
    the samples its loader skipped and padded; seconds spent waiting for data). Nothing here reads the device."""
    cfg, device, engine = run.cfg, run.device, model.engine
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    skipped = padded = 0
    data_wait = 0.0
    for micro in range(cfg.grad_accum_steps):
        wait_start = time.perf_counter()
        images, labels, meta = next(data.train_batches)
        data_wait += time.perf_counter() - wait_start
        skipped, padded = skipped + meta["skipped"], padded + meta["padded"]
        images = data.normalize(images.to(device, non_blocking=True))  # uint8 from the loader: a quarter of the bytes
        labels = labels.to(device, non_blocking=True)
        # mixing, masking, dropout and stochastic depth draw from the seed, the step and the micro-batch's slot in
        # the step, so that they are the same for any number of ranks and across resumes
        slot = run.data_rank * cfg.grad_accum_steps + micro
        slot_seed = hash((cfg.seed, step, slot)) % 2**63
        torch.manual_seed(slot_seed)
        if cfg.task == "classification":  # mixup and cutmix make soft targets
            mix_rng = torch.Generator().manual_seed(slot_seed)
            images, labels = mix_batch(images, labels, cfg.num_labels, cfg.mixup, cfg.cutmix, mix_rng)
        if engine.pipeline:  # the schedule runs the micro-batch's pieces through every stage (parallel/pipeline.py)
            loss = engine.pipeline.step(images.to(model.dtype), labels)
        else:
            loss = task_loss(engine, cfg, images.to(model.dtype), labels, step, slot)
            engine.backward(loss)  # divided by grad_accum_steps
        engine.step()  # the optimizer and the LR schedule advance only at the accumulation boundary
        loss_sum += loss.detach().double()
    return loss_sum, skipped, padded, data_wait


# ---------------------------------------------------------------------------------------------------- train
@dataclass
class Trained:
    result: Evaluation | None = None  # the last evaluation
    ema_result: Evaluation | None = None
    timed_images: int = 0  # images and seconds of the steady-state steps: the summary's images/s
    timed_seconds: float = 0.0
    started: float = 0.0
    bad_in_a_row: int = 0  # steps with a non-finite loss or gradients: the newest run of them, and all
    bad_total: int = 0
    data_skipped: int = 0  # samples skipped and padded by the loaders of every rank
    data_padded: int = 0
    checkpoint_seconds: float = 0.0  # what the checkpoints cost the loop (with async_save: the copies and commits)


def train(run: Run, model: Model, start: Start, data: Data, log: RunLog) -> Trained:
    """The steps, read from the device once per logging interval (loop/interval.py): at most every log_every
    steps, at each evaluation and checkpoint, after the first two steps (warm-up, and the profiled step on CPU) and
    often enough for a preemption signal to be acted on within a quarter of preempt_grace."""
    cfg, device, engine, ema = run.cfg, run.device, model.engine, start.ema
    trained = Trained(started=time.perf_counter())
    interval, next_read, skipped_in_a_row = Interval(device, clock(device)), start.step + 1, 0
    for step in range(start.step + 1, cfg.max_steps + 1):
        run.heartbeat.beat(f"step {step}")
        lr = engine.get_lr()[0]
        # one profiled step per run on CPU: its peak allocation is the CPU counterpart of the GPU allocator's peak
        profiled = device.type == "cpu" and step == start.step + 2
        with memory_profiler() if profiled else contextlib.nullcontext() as prof:
            loss_sum, skipped, padded, data_wait = train_step(run, model, data, step)
            if ema and engine.was_step_applied():
                ema.update()
        counts = run.tp_rank == 0  # a tensor group's ranks read the same samples: its first counts the skipped
        record = StepRecord(step, lr, skipped * counts, padded * counts, data_wait, engine.was_step_applied(),
                            engine.skipped_steps, peak_memory_bytes())
        if profiled:  # profiling slows this step: it is read alone, and the summary's images/s leaves it out
            before, peak, _ = memory_trace(prof)
            record.extra["mem/step_peak_alloc_bytes"] = peak - before
        if data.per_epoch:
            record.extra["data/epoch"] = data.train_batches.state["batches"] / data.per_epoch
        interval.add(record, loss_sum, engine.get_global_grad_norm())
        # the engine skips a step whose gradients are not finite, and every rank knows it without reading the device;
        # under fp16 that is its loss scaler's normal work, and a non-finite loss is read every step instead
        skipped_in_a_row = skipped_in_a_row + 1 if not record.applied else 0
        evaluating = step == cfg.max_steps or bool(cfg.eval_every and step % cfg.eval_every == 0)
        saving = step == cfg.max_steps or bool(cfg.save_every and step % cfg.save_every == 0)
        if not (step >= next_read or evaluating or saving or model.precision == "fp16"
                or skipped_in_a_row >= cfg.max_bad_steps):
            continue
        closed = interval.close(run.preemption.requested, run.world_size)
        if closed.records[0].step > start.step + (2 if device.type == "cpu" else 1):  # warm-up and profiled left out
            trained.timed_images += images_per_step(cfg, run.world_size) * len(closed.records)
            trained.timed_seconds += closed.seconds
        log_steps(run, model, data, ema, trained, closed, log, evaluate_last=evaluating and not closed.preempted)
        if closed.preempted or saving:
            score = trained.result.score if evaluating and not closed.preempted else None
            # the last checkpoint and a preemption's are on disk before going on; others may write in the background
            began = time.perf_counter()
            saved = save_checkpoint(run, model, data, ema, step, score, log,
                                    wait=step == cfg.max_steps or closed.preempted)
            trained.checkpoint_seconds += time.perf_counter() - began
        if closed.preempted:
            log.close("KILLED")
            if run.rank == 0:
                name = signal.Signals(run.preemption.signal).name if run.preemption.signal else \
                    "a signal on another rank"
                print(f"preempted ({name}) after step {step}: " + (
                    f"checkpoint step{step:07d} written; continue with --resume latest" if saved else
                    "no checkpoint written (see above); --resume latest continues from the newest"), flush=True)
                if run.checked.mirror:  # within preempt_grace, or the mirror keeps its previous checkpoint
                    run.checked.mirror.wait()
            exit_distributed(EXIT_PREEMPTED)
        # the next read: after the second step, then at the next multiple of log_every, sooner when a quarter of
        # the preemption grace holds fewer steps (step_seconds is the same on every rank)
        within_grace = max(1, int(cfg.preempt_grace / 4 / max(closed.step_seconds, 1e-9)))
        next_read = step + 1 if step == start.step + 1 else min(step + cfg.log_every - step % cfg.log_every,
                                                                 step + within_grace)
        interval = Interval(device, time.perf_counter())
    log.end_progress()
    if trained.result is None:  # resumed at max_steps: nothing left to train, still report the model's accuracy
        evaluate_now(run, model, data, None, trained)
    return trained


def log_steps(run: Run, model: Model, data: Data, ema: EMA | None, trained: Trained, closed: Closed, log: RunLog,
              evaluate_last: bool):
    """The interval's steps in metrics.jsonl, TensorBoard and the bar, the last one evaluated first if due; a run
    of max_bad_steps non-finite steps ends the job after the one that completes it."""
    cfg, n = run.cfg, len(closed.records)
    for r in closed.records:
        loss = r.loss_sum / (cfg.grad_accum_steps * run.world_size)
        nonfinite = not math.isfinite(loss) or (not r.applied and model.precision != "fp16")
        trained.bad_in_a_row = trained.bad_in_a_row + 1 if nonfinite else 0
        trained.bad_total += nonfinite
        trained.data_skipped += r.skipped
        trained.data_padded += r.padded
        record = {"step": r.step, "loss": loss, "lr": r.lr, "grad_norm": r.grad_norm,
                  "opt/nonfinite_steps": trained.bad_total, "opt/skipped_steps": r.ds_skipped_steps,
                  "images_per_sec": images_per_step(cfg, run.world_size) * n / closed.seconds,
                  "data_wait_frac": r.data_wait * n / closed.seconds, "peak_mem_bytes": r.peak_mem_bytes,
                  "data/skipped": trained.data_skipped, "data/padded": trained.data_padded,
                  "ac/activation_bytes": model.ac_plan["activation_bytes_planned"],
                  "ac/recompute_flops_frac": model.ac_plan["recompute_flops_fraction"], **r.extra}
        if evaluate_last and r is closed.records[-1]:
            run.heartbeat.beat(f"step {r.step}, evaluating")
            evaluate_now(run, model, data, ema, trained)
            record.update({f"val_{k}": v for k, v in trained.result.metrics.items()})
            if ema:
                record.update({f"val_ema_{k}": v for k, v in trained.ema_result.metrics.items()})
            log.evaluation(r.step, trained.result, trained.ema_result)
        log.record(record)
        if trained.bad_in_a_row >= cfg.max_bad_steps:  # every rank sees the same all-reduced loss and skipped step
            log.close("FAILED")
            if run.rank == 0:
                print(f"error: step {r.step}: the loss or the gradients were not finite in {trained.bad_in_a_row} "
                      f"steps in a row (max_bad_steps), each one skipped; the weights are those of step "
                      f"{r.step - trained.bad_in_a_row}. Look for bad data or a too high lr, then resume from the "
                      f"newest checkpoint", file=sys.stderr, flush=True)
            exit_distributed(EXIT_NONFINITE)
        log.progress(loss, record["images_per_sec"])


def evaluate_now(run: Run, model: Model, data: Data, ema: EMA | None, trained: Trained):
    """The live weights on the whole validation set, then (with an EMA) the averaged ones."""
    args = (data.normalize, model.dtype, run.device, run.cfg, run.data_rank, run.data_ranks)
    trained.result = evaluate(model.engine, data.val_batches(), *args)
    if ema:
        with ema.swapped(model.engine):
            trained.ema_result = evaluate(model.engine, data.val_batches(), *args)


def save_checkpoint(run: Run, model: Model, data: Data, ema: EMA | None, step: int, val_score, log: RunLog,
                    wait: bool = True) -> bool:
    """Every rank's part of checkpoint `step`, with the data position of every rank and worker; `val_score`: the
    evaluation's score at this step (higher is better: keep_best), or None. `wait` False: written in the
    background where the engine can (async_save)."""
    cfg = run.cfg
    run.heartbeat.beat(f"step {step}, saving")
    positions = [None] * run.world_size
    dist.all_gather_object(positions, data.train_batches.state_dict())
    state = {"step": step, "world_size": run.world_size, "engine": cfg.engine, "zero_stage": cfg.zero_stage,
             "tp_size": cfg.tp_size,
             "val_score": val_score, "data": merge_states(positions), "param_shapes": run.checked.param_shapes}
    # the first checkpoint's size, for the disk check: weights in the model's precision, the fp32 master copy and
    # Adam's two moments (later checks use the newest checkpoint's real size)
    estimate = model.n_params * (model.dtype.itemsize + 12)
    return save(model.engine, run.ckpt_dir, step, state, keep_last=cfg.keep_last, keep_best=cfg.keep_best,
                min_free_gb=cfg.min_free_gb, estimate_bytes=estimate, log=log.write, also=ema.save if ema else None,
                wait=wait, mirror=run.checked.mirror)


# ---------------------------------------------------------------------------------------------------- export
def finish(run: Run, model: Model, start: Start, trained: Trained, log: RunLog):
    """The model as a Hugging Face directory (the EMA's weights with export_ema), summary.json and the last line."""
    cfg = run.cfg
    hf_dir = os.path.join(cfg.output_dir, "hf_model")
    encoder_dir = os.path.join(cfg.output_dir, "encoder") if cfg.task == "mae" else ""  # what fine-tuning loads
    with start.ema.swapped(model.engine) if cfg.export_ema else contextlib.nullcontext():
        exported = export_hf_model(model.engine, model.processor, hf_dir, run.rank, encoder_dir)
    if not exported:
        log.close("FAILED")
        exit_distributed(EXIT_NONFINITE)
    log.model(hf_dir)
    log.close()
    result, ema_result = trained.result, trained.ema_result
    seconds = trained.timed_seconds
    elapsed = time.perf_counter() - trained.started
    minutes, secs = divmod(int(elapsed), 60)
    summary = {"step": cfg.max_steps, "task": cfg.task, **{f"val_{k}": v for k, v in result.metrics.items()},
               **{f"val_ema_{k}": v for k, v in (ema_result.metrics if ema_result else {}).items()},
               "images_per_sec": trained.timed_images / seconds if seconds else None,
               "steps_this_launch": cfg.max_steps - start.step, "seconds_this_launch": round(elapsed, 1),
               "checkpoint_seconds_this_launch": round(trained.checkpoint_seconds, 3),
               "hf_model": hf_dir, **({"encoder": encoder_dir} if encoder_dir else {}),
               "hf_model_weights": "ema" if cfg.export_ema else "live", "labels": log.labels,
               # a classifier's: rows true, columns predicted
               "confusion": result.confusion.long().tolist() if result.confusion is not None else None}
    throughput = f"{trained.timed_images / seconds:.0f}" if seconds else "n/a"
    log.summary(summary, f"done: val {result.describe()} | {throughput} images/s | "
                         f"{cfg.max_steps - start.step} steps in {minutes}m{secs:02d}s | "
                         f"{'EMA model' if cfg.export_ema else 'model'} saved to {hf_dir}")
    if run.checked.mirror and run.rank == 0:  # the last checkpoint's upload, then the export and the records
        run.checked.mirror.upload_export(cfg.output_dir)
    exit_distributed(0)  # everything is written and closed: skips a gloo abort at interpreter exit (see there)


if __name__ == "__main__":
    main()
