"""Train a Hugging Face ViT or Swin image classifier with DeepSpeed ZeRO stage 1, 2 or 3.

    deepspeed --num_gpus 2 train.py --config configs/digits-vit.yaml    # CPU: 2 ranks, gloo; GPU: NCCL
    deepspeed train.py --config my-recipe.yaml --model vit-base          # every GPU of this node
    torchrun --nproc_per_node 2 train.py --zero_stage 3
    accelerate launch --multi_gpu --num_processes 2 train.py --model swin-debug
    python train.py --max_steps 20                                       # one rank

Every config key, its default and meaning is in config.py; `--key value` overrides the recipe.
The run directory receives config.yaml, ds_config.json, ac_plan.json, hf_config/, metrics.jsonl, TensorBoard events
(tb/), DeepSpeed checkpoints (checkpoints/) and, at the end, hf_model/ for `transformers.pipeline`.
"""
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from config import Config, ConfigError, parse, to_dict
from data.loader import (ShardStream, TrainLoader, check_labels, check_streams, eval_batches, merge_states,
                         resume_state)
from data.shards import DataError, parse_spec
from data.transforms import EvalTransform, Normalize, TrainTransform, mix_batch
from engine.distributed import (DistributedError, Heartbeat, dist_env, exit_distributed, fail_fast,
                                init_distributed)
from engine.memory import memory_profiler, memory_trace, peak_memory_bytes
from engine.preemption import EXIT_PREEMPTED, Preemption
from engine import compat, figures
from engine.checkpoint import (check_same_model, describe_load_error, find_resume, remove_interrupted, save,
                               to_universal)
from engine.ema import EMA
from engine.optim import frozen_names
from engine.parallelize import build_engine, build_training_model, engine_config
from engine.planner import meta_model
from engine.timing import clock
from models import model_config
from models.checkpointing import check_policy
from models.registry import check_weight_files

# a resumed run whose data layout changed starts a fresh data order, seeded by the seed and the step
RESEED_STRIDE = 1_000_003
EXIT_NONFINITE = 5  # max_bad_steps non-finite steps in a row, or a non-finite model at export
EXIT_COLLECTIVE = 6  # a collective failed, or no progress for dist_timeout: another rank died or stalled


def check_run(cfg: Config, world_size: int, rank: int):
    """Every check on the input that can fail, before anything is written or any process group forms."""
    train_sources = parse_spec(cfg.train_shards, "train_shards")
    val_sources = parse_spec(cfg.val_shards, "val_shards")
    names = train_sources[0].class_names
    if names is not None and len(names) != cfg.num_labels:
        raise ConfigError(f"num_labels is {cfg.num_labels} but the train shards' _info.json lists {len(names)} classes")
    check_labels(train_sources, cfg.num_labels, "train_shards")
    check_labels(val_sources, cfg.num_labels, "val_shards")
    # an unknown model name raises here, with the list of known ones; a contradicting DeepSpeed JSON below
    hidden = model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size).hidden_size
    if os.path.isdir(cfg.model):  # a cut-off copy of its weights fails here, by name, not inside transformers
        check_weight_files(cfg.model)
    shapes = {n: list(p.shape) for n, p in meta_model(cfg).named_parameters()}  # the model as defined, on meta
    if cfg.freeze:  # a pattern that names no parameter fails here, on the model's shapes alone
        frozen_names(list(shapes), cfg.freeze)
    _, ds_config = engine_config(cfg, hidden, world_size)
    offload = ds_config["zero_optimization"].get("offload_param", {}).get("device", "none")
    if cfg.ema_decay and offload == "nvme":
        raise ConfigError("ema_decay with offload_param on nvme: the EMA averages the weights' partitions in memory, "
                          "and NVMe-offloaded partitions are not there; offload to cpu or set ema_decay 0")
    check_policy(cfg.ac, "cuda" if torch.cuda.is_available() else "cpu")
    if cfg.data_streams and (why := check_streams(cfg.data_streams, world_size, cfg.grad_accum_steps, cfg.num_workers)):
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
    resume = find_resume(cfg, world_size)  # a missing file, a changed ZeRO stage or another model fails here
    if resume:
        check_same_model(resume.state, resume.path, shapes)
    if resume and resume.note and rank == 0:
        print(resume.note, file=sys.stderr)
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
    return train_sources, val_sources, names, ds_config, resume, shapes


@dataclass
class Evaluation:
    top1: float
    top5: float
    confusion: torch.Tensor  # (num_labels, num_labels) counts over every rank: rows true, columns predicted
    shown: tuple  # (images, labels, predictions) of this rank's first images, for the prediction grid


@torch.no_grad()
def evaluate(engine, loader, normalize, dtype, device, num_labels: int) -> Evaluation:
    """Top-1, top-5 and the confusion matrix over the whole validation set, reduced over ranks. The loader's
    uint8 images are normalised on the device (`normalize`)."""
    engine.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct@1, correct@5, count
    confusion = torch.zeros(num_labels * num_labels, dtype=torch.float64, device=device)
    shown = None
    batches, dummy = iter(loader), None
    while True:
        batch = next(batches, None)
        # ZeRO-3 gathers parameters inside each forward, so every rank must run as many forwards as
        # the others: a rank that ran out of data joins with a dummy batch until all are done.
        more = torch.tensor([batch is not None], dtype=torch.int32, device=device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            break
        if batch is None:
            engine(dummy)
            continue
        images, labels = normalize(batch[0].to(device, non_blocking=True)).to(dtype), batch[1].to(device)
        dummy = images[:1]
        logits = engine(images).logits.float()  # (B, num_labels)
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        hits = top == labels[:, None]
        # the count on the GPU as well: torch.stack does not move a CPU scalar the way arithmetic does
        count = torch.tensor(len(labels), device=device)
        totals += torch.stack([hits[:, 0].sum(), hits.any(-1).sum(), count]).to(totals)
        confusion += torch.bincount(labels * num_labels + top[:, 0], minlength=num_labels * num_labels).to(confusion)
        if shown is None:
            shown = (batch[0][:16], batch[1][:16], top[:16, 0].cpu())
    dist.all_reduce(totals)
    dist.all_reduce(confusion)
    engine.train()
    return Evaluation((totals[0] / totals[2]).item(), (totals[1] / totals[2]).item(),
                      confusion.view(num_labels, num_labels).cpu(), shown)


def export_hf_model(engine, processor, out_dir: str, rank: int) -> bool:
    """A Hugging Face directory `pipeline("image-classification", model=out_dir)` loads; False (and nothing
    written) if a weight is not finite."""
    state_dict = full_state_dict(engine, rank)
    bad = [k for k, v in state_dict.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        print(f"error: not exported: {len(bad)} weight tensors hold inf or NaN ({', '.join(bad[:3])}"
              f"{', ...' if len(bad) > 3 else ''})", file=sys.stderr, flush=True)
    elif rank == 0:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one shard: a bar says nothing
        partial = out_dir + ".partial"  # renamed when complete: a kill mid-export leaves the previous export whole
        shutil.rmtree(partial, ignore_errors=True)
        engine.module.save_pretrained(partial, state_dict=state_dict)
        processor.save_pretrained(partial)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(partial, out_dir)
    exported = [not bad]
    dist.broadcast_object_list(exported, src=0)  # only rank 0 holds the weights
    return exported[0]


def full_state_dict(engine, rank: int) -> dict:
    """The whole model's weights on rank 0 ({} elsewhere). Under ZeRO-3 each module's parameters are gathered
    in turn (`deepspeed.zero.GatheredParameters`) and copied out, so no rank gathers the whole model at once."""
    import deepspeed

    module = engine.module
    if not engine.zero_optimization_partition_weights():
        return module.state_dict() if rank == 0 else {}
    params = {name for name, _ in module.named_parameters()}
    state = {k: v for k, v in module.state_dict().items() if k not in params} if rank == 0 else {}  # buffers
    for prefix, sub in module.named_modules():
        own = dict(sub.named_parameters(recurse=False))
        if not own:
            continue
        with deepspeed.zero.GatheredParameters(list(own.values())):
            if rank == 0:
                state.update({f"{prefix}.{n}" if prefix else n: p.detach().cpu().clone() for n, p in own.items()})
    return state


def _record_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a blank or cut-off one (a kill mid-write), which is dropped."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def main(argv=None):
    # ------------------------------------------------------------------ setup
    rank, world_size, local_rank, local_world = dist_env()
    try:
        cfg = parse(argv)
        train_sources, val_sources, names, ds_config, resume, shapes = check_run(cfg, world_size, rank)
    except (ConfigError, DataError, ValueError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # a launcher kills the other ranks when one exits: rank 0 reports first
            time.sleep(5)
        sys.exit(2)
    if "OMP_NUM_THREADS" not in os.environ:  # cores / ranks on this node, as on every benchmark here
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    try:  # after the checks: bad input fails in a second, not after DeepSpeed's import
        device = init_distributed(local_rank, cfg.dist_timeout)
    except DistributedError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)  # every rank: each node has its own view of the network
        if rank == 0 and not os.listdir(cfg.output_dir):  # created by check_run, nothing written yet
            os.rmdir(cfg.output_dir)
        sys.exit(2)
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    # a dead or stalled rank: the others stop within dist_timeout, with one line naming where each rank was
    heartbeat = Heartbeat(rank, world_size, cfg.dist_timeout, EXIT_COLLECTIVE)
    heartbeat.beat("starting")
    # an exception on any rank ends the job in seconds, its traceback in errors/rank<N>.txt, the logs flushed
    flush_logs = []
    fail_fast(heartbeat, cfg.output_dir, flush_logs)
    preemption = Preemption(cfg.preempt_grace)  # SIGTERM/SIGUSR1: finish the step, checkpoint, exit
    if rank == 0:
        remove_interrupted(ckpt_dir)
    if resume and resume.universal:  # written by another number of ranks: resharded through the universal format
        heartbeat.beat("converting the checkpoint to the universal format")
        if rank == 0:
            try:
                to_universal(resume, world_size)
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                os._exit(2)  # the other ranks wait in the barrier below; the launcher ends them
        dist.barrier()

    # ------------------------------------------------------------------ model
    # the initial weights come from the seed alone; under ZeRO-3 every parameter is partitioned as it is created,
    # so no rank holds the whole model
    heartbeat.beat("building the model")
    model, processor = build_training_model(cfg, ds_config, names, log=print if rank == 0 else None)
    torch.manual_seed(cfg.seed)  # dropout and stochastic depth draw from here, however the model was built
    n_params = sum(compat.param_numel(p) for p in model.parameters())
    heartbeat.beat("wrapping the model")
    try:  # activation checkpointing, then ZeRO, then torch.compile
        built = build_engine(model, cfg, world_size, device.type, log=print if rank == 0 else lambda *a: None,
                             load_universal=bool(resume and resume.universal))
    except ConfigError as e:  # an `auto` budget that cannot be met shows only once the model is profiled
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
            if not os.listdir(cfg.output_dir):  # created by check_run, nothing written yet
                os.rmdir(cfg.output_dir)
        sys.exit(2)
    engine, ac_plan, ds_config, precision, dtype = (built.engine, built.ac_plan, built.ds_config, built.precision,
                                                     built.dtype)
    # the first checkpoint's size, for the disk check: weights in the model's precision, the fp32 master copy and
    # Adam's two moments (later checks use the newest checkpoint's real size)
    checkpoint_estimate = n_params * (dtype.itemsize + 12)

    # ------------------------------------------------------------------ resume
    start_step, data_state, data_streams = 0, None, cfg.data_streams
    if cfg.resume and resume is None and rank == 0:
        print(f"resume: no checkpoint in {ckpt_dir} yet, starting from step 0")
    if resume:
        heartbeat.beat("loading the checkpoint")
        try:
            with compat.universal_load_keeps_group_settings(engine):
                path, client_state = engine.load_checkpoint(resume.load_dir, tag=resume.load_tag)
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
        start_step = client_state["step"]
        data_state, streams, why_not = resume_state(
            resume.state and resume.state["data"], step=start_step, mode=cfg.data_mode, seed=cfg.seed,
            data_streams=cfg.data_streams, world_size=world_size, grad_accum_steps=cfg.grad_accum_steps,
            num_workers=cfg.num_workers, micro_batch_size=cfg.micro_batch_size, shuffle_buffer=cfg.shuffle_buffer)
        data_streams = streams or data_streams
        if rank == 0:
            print(f"resumed from {path} at step {start_step}" + (
                "" if data_state else f"; data order restarts ({why_not})"))
    # the EMA of the weights: each rank averages what it holds of them (under ZeRO-3 its partition)
    ema = EMA(engine.module, cfg.ema_decay) if cfg.ema_decay else None
    if ema and resume and not ema.load(resume.path) and rank == 0:
        print(f"ema: {resume.path} holds no EMA; it starts from the resumed weights")

    # ------------------------------------------------------------------ data
    # Every rank and worker reads its own deterministic slice; a checkpoint's data position makes a resumed
    # run read exactly what the uninterrupted run would have read next.
    train_stream = ShardStream(
        train_sources, mode=cfg.data_mode, rank=rank, world_size=world_size, num_workers=cfg.num_workers,
        micro_batch_size=cfg.micro_batch_size, shuffle_buffer=cfg.shuffle_buffer,
        grad_accum_steps=cfg.grad_accum_steps, streams=data_streams,
        seed=cfg.seed if data_state or not start_step else cfg.seed * RESEED_STRIDE + start_step,
        transform=TrainTransform(processor, cfg.crop_scale_min, cfg.hflip, cfg.randaug_n, cfg.randaug_m),
        state=data_state, num_labels=cfg.num_labels)
    train_batches = TrainLoader(train_stream, cfg.num_workers)
    per_epoch = train_stream.batches_per_rank_epoch()  # None in resampled mode
    normalize = Normalize(processor)
    val_data = functools.partial(eval_batches, val_sources, EvalTransform(processor), cfg.micro_batch_size, rank,
                                 world_size, cfg.num_labels)

    # ------------------------------------------------------------------ run directory and logging
    images_per_step = cfg.micro_batch_size * cfg.grad_accum_steps * world_size
    metrics_file = writer = None
    if rank == 0:
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        with open(os.path.join(cfg.output_dir, "ds_config.json"), "w") as f:
            json.dump(ds_config, f, indent=2)
        with open(os.path.join(cfg.output_dir, "ac_plan.json"), "w") as f:
            json.dump(ac_plan, f, indent=1)
        engine.module.config.save_pretrained(os.path.join(cfg.output_dir, "hf_config"))  # for export.py
        processor.save_pretrained(os.path.join(cfg.output_dir, "hf_config"))
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if os.path.exists(metrics_path):  # drop records past the checkpoint we resumed from
            with open(metrics_path) as f:
                kept = [line for line in f if _record_step(line) <= start_step]
            with open(metrics_path, "w") as f:
                f.writelines(kept)
        metrics_file = open(metrics_path, "a")
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(cfg.output_dir, "tb"), purge_step=start_step + 1)
        flush_logs += [metrics_file.flush, writer.flush]
        hpz = compat.zero3_hpz_ranks(engine.module) if cfg.zero_stage == 3 else 1
        print(f"{cfg.model}: {n_params / 1e6:.2f}M params | ZeRO-{cfg.zero_stage}"
              f"{f' (hpZ over {hpz} ranks)' if hpz > 1 else ''} | {compat.optimizer_name(engine)} | {precision} | "
              f"world size {world_size} ({world_size // local_world} node(s) x {local_world}, {device.type}, "
              f"{torch.get_num_threads()} threads per rank) | global batch {images_per_step} = {cfg.micro_batch_size} "
              f"micro x {cfg.grad_accum_steps} accum x {world_size} ranks | steps {start_step}->{cfg.max_steps} | "
              f"data {cfg.data_mode}" + (f", {per_epoch // cfg.grad_accum_steps} steps per epoch" if per_epoch else ""))

    def close_logs():
        if rank == 0:
            bar.close()
            metrics_file.close()
            writer.close()

    def log(record: dict):
        if rank == 0:
            record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            for key, value in record.items():
                if key != "step" and value is not None:
                    tag = key if "/" in key else ("val/" if key.startswith("val_") else "train/") + key
                    writer.add_scalar(tag, value, record["step"])

    def pictures(result: Evaluation, step: int):
        """Rank 0: the prediction grid and the confusion matrix of an evaluation, to TensorBoard."""
        labels = [engine.module.config.id2label[i] for i in range(cfg.num_labels)]
        if result.shown is not None:
            writer.add_figure("val/predictions", figures.predictions(*result.shown, labels), step)
        writer.add_figure("val/confusion", figures.confusion(result.confusion.numpy(), labels), step)

    if rank == 0:  # what the run is, beside its scalars: the config and the checkpointing plan
        writer.add_text("config", "```\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False) + "```", start_step)
        writer.add_figure("ac/plan", figures.ac_plan(ac_plan), start_step)

    # ------------------------------------------------------------------ training loop
    from tqdm import tqdm

    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=rank != 0 or not cfg.progress, dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    top1 = top5 = result = ema_result = None
    timed_images, timed_seconds, run_start = 0, 0.0, time.perf_counter()
    data_totals = torch.zeros(2, dtype=torch.float64, device=device)  # samples skipped, padded: all ranks
    bad_in_a_row = bad_total = 0
    for step in range(start_step + 1, cfg.max_steps + 1):
        heartbeat.beat(f"step {step}")
        # the previous step ended on the clock, so the device is idle here: no second synchronisation a step
        step_start, data_wait = time.perf_counter(), 0.0
        lr = engine.get_lr()[0]
        # one profiled step per run on CPU: its peak allocation is the CPU counterpart of the GPU allocator's peak
        profiler = None
        if device.type == "cpu" and step == start_step + 2:
            profiler = memory_profiler()
            prof = profiler.__enter__()
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, skipped, padded, preemption requested
        for micro in range(cfg.grad_accum_steps):
            wait_start = time.perf_counter()
            images, labels, meta = next(train_batches)
            data_wait += time.perf_counter() - wait_start
            images = normalize(images.to(device, non_blocking=True))  # uint8 from the loader: a quarter of the bytes
            labels = labels.to(device, non_blocking=True)
            # mixing, dropout and stochastic depth draw from the seed, the step and the micro-batch's slot in the
            # step, so that they are the same for any number of ranks and across resumes
            slot_seed = hash((cfg.seed, step, rank * cfg.grad_accum_steps + micro)) % 2**63
            mix_rng = torch.Generator().manual_seed(slot_seed)
            torch.manual_seed(slot_seed)
            images, targets = mix_batch(images, labels, cfg.num_labels, cfg.mixup, cfg.cutmix, mix_rng)
            logits = engine(images.to(dtype)).logits.float()  # (B, num_labels)
            loss = F.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing)
            engine.backward(loss)  # DeepSpeed divides by grad_accum_steps
            engine.step()  # optimizer and LR schedule advance only at the accumulation boundary
            sums[:3] += torch.stack([loss.detach().double(), torch.tensor(meta["skipped"], dtype=torch.float64,
                                     device=device), torch.tensor(meta["padded"], dtype=torch.float64, device=device)])
        if ema and engine.was_step_applied():
            ema.update()
        sums[3] = float(preemption.requested)  # read at the step's end: every rank stops after the same step
        if profiler is not None:
            profiler.__exit__(None, None, None)
            before, peak, _ = memory_trace(prof)
        dist.all_reduce(sums)
        step_seconds = clock(device) - step_start  # on GPUs, once the step's kernels and collectives are done
        step_loss = sums[0].item() / (cfg.grad_accum_steps * world_size)
        data_totals += sums[1:3]
        preempted = sums[3].item() > 0
        if step > start_step + 1 and profiler is None:  # step 1 allocates buffers and starts workers
            timed_images, timed_seconds = timed_images + images_per_step, timed_seconds + step_seconds
        grad_norm = engine.get_global_grad_norm()
        # DeepSpeed skips an optimizer step whose gradients are not finite (every ZeRO stage and precision; under
        # fp16 that is also its loss scaler's normal work, so there only a non-finite loss counts)
        nonfinite = not math.isfinite(step_loss) or (not engine.was_step_applied() and precision != "fp16")
        bad_in_a_row, bad_total = (bad_in_a_row + 1 if nonfinite else 0), bad_total + nonfinite
        record = {"step": step, "loss": step_loss, "lr": lr,
                  "grad_norm": float(grad_norm) if grad_norm is not None else None,
                  "opt/nonfinite_steps": bad_total, "opt/skipped_steps": engine.skipped_steps,
                  "images_per_sec": images_per_step / step_seconds, "data_wait_frac": data_wait / step_seconds,
                  "peak_mem_bytes": peak_memory_bytes(), "data/skipped": int(data_totals[0]),
                  "data/padded": int(data_totals[1]), "ac/activation_bytes": ac_plan["activation_bytes_planned"],
                  "ac/recompute_flops_frac": ac_plan["recompute_flops_fraction"]}
        if profiler is not None:  # profiling slows this step: the summary's images/s leaves it out
            record["mem/step_peak_alloc_bytes"] = peak - before
        if per_epoch:
            record["data/epoch"] = train_batches.state["batches"] / per_epoch

        if not preempted and (step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            heartbeat.beat(f"step {step}, evaluating")
            result = evaluate(engine, val_data(), normalize, dtype, device, cfg.num_labels)
            top1, top5 = result.top1, result.top5
            record.update(val_top1=top1, val_top5=top5)
            if ema:
                with ema.swapped(engine):
                    ema_result = evaluate(engine, val_data(), normalize, dtype, device, cfg.num_labels)
                record.update(val_ema_top1=ema_result.top1, val_ema_top5=ema_result.top5)
            if rank == 0:
                bar.write(f"step {step}: val top-1 {top1:.2%} top-5 {top5:.2%}" + (
                    f" | EMA top-1 {ema_result.top1:.2%} top-5 {ema_result.top5:.2%}" if ema else ""))
                pictures(result, step)
        log(record)
        if bad_in_a_row >= cfg.max_bad_steps:  # every rank sees the same all-reduced loss and skipped step
            close_logs()
            if rank == 0:
                print(f"error: step {step}: the loss or the gradients were not finite in {bad_in_a_row} steps in a row "
                      f"(max_bad_steps), each one skipped; the weights are those of step {step - bad_in_a_row}. "
                      f"Look for bad data or a too high lr, then resume from the newest checkpoint",
                      file=sys.stderr, flush=True)
            exit_distributed(EXIT_NONFINITE)
        bar.set_postfix(loss=f"{step_loss:.4f}", img_s=f"{record['images_per_sec']:.0f}", refresh=False)
        bar.update()

        # -------------------------------------------------------------- checkpoint
        if preempted or step == cfg.max_steps or (cfg.save_every and step % cfg.save_every == 0):
            heartbeat.beat(f"step {step}, saving")
            positions = [None] * world_size
            dist.all_gather_object(positions, train_batches.state_dict())
            state = {"step": step, "world_size": world_size, "zero_stage": cfg.zero_stage,
                     "val_top1": record.get("val_top1"), "data": merge_states(positions), "param_shapes": shapes}
            saved = save(engine, ckpt_dir, step, state, keep_last=cfg.keep_last, keep_best=cfg.keep_best,
                         min_free_gb=cfg.min_free_gb, estimate_bytes=checkpoint_estimate,
                         log=bar.write if rank == 0 else lambda *a: None, also=ema.save if ema else None)
        if preempted:
            close_logs()
            if rank == 0:
                name = signal.Signals(preemption.signal).name if preemption.signal else "a signal on another rank"
                print(f"preempted ({name}) after step {step}: " + (
                    f"checkpoint step{step:07d} written; continue with --resume latest" if saved else
                    "no checkpoint written (see above); --resume latest continues from the newest"), flush=True)
            exit_distributed(EXIT_PREEMPTED)
    bar.close()
    if top1 is None:  # resumed at max_steps: nothing left to train, still report the model's accuracy
        result = evaluate(engine, val_data(), normalize, dtype, device, cfg.num_labels)
        top1, top5 = result.top1, result.top5

    # ------------------------------------------------------------------ export and summary
    hf_dir = os.path.join(cfg.output_dir, "hf_model")
    with ema.swapped(engine) if cfg.export_ema else contextlib.nullcontext():
        exported = export_hf_model(engine, processor, hf_dir, rank)
    if not exported:
        exit_distributed(EXIT_NONFINITE)
    if rank == 0:
        metrics_file.close()
        writer.close()
        throughput = f"{timed_images / timed_seconds:.0f}" if timed_seconds else "n/a"
        elapsed = time.perf_counter() - run_start
        minutes, seconds = divmod(int(elapsed), 60)
        summary = {"step": cfg.max_steps, "val_top1": top1, "val_top5": top5,
                   "val_ema_top1": ema_result.top1 if ema_result else None,
                   "images_per_sec": timed_images / timed_seconds if timed_seconds else None,
                   "steps_this_launch": cfg.max_steps - start_step, "seconds_this_launch": round(elapsed, 1),
                   "hf_model": hf_dir, "hf_model_weights": "ema" if cfg.export_ema else "live",
                   "labels": [engine.module.config.id2label[i] for i in range(cfg.num_labels)],
                   "confusion": result.confusion.long().tolist()}  # rows true, columns predicted
        with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(f"done: val top-1 {top1:.2%} (top-5 {top5:.2%}) | {throughput} images/s | "
              f"{cfg.max_steps - start_step} steps in {minutes}m{seconds:02d}s | "
              f"{'EMA model' if cfg.export_ema else 'model'} saved to {hf_dir}")
    exit_distributed(0)  # everything is written and closed: skips a gloo abort at interpreter exit (see there)


if __name__ == "__main__":
    main()
