"""The host's share of a step: what the engine's Python, the dispatcher, the checkpointing hooks and the
collectives' latency cost per micro-batch and per optimizer step, whatever the width.

The probe runs the real engine (DeepSpeed's: the checkpointing and ZeRO wrapping of engine/deepspeed_zero.py, every
rank of the launch) on the model's own structure at a width of 32 and one image, where arithmetic is negligible, at two
depths. Per ZeRO stage and per block policy (none, selective, full), the forward and backward's seconds fit a
line in the number of blocks: the slope is the host seconds a block of that policy costs, the intercept what a
micro-batch costs besides its blocks (embedding, head, loss, the engine's entry and exit). `engine.step()` fits
the same line for the optimizer step. The same model without engine or checkpointing gives the dispatcher's
own share (each model timed bare just before it is wrapped), which a CPU's operator replay
(planner/replay.py) already measures inside its rates.

estimate() charges it per micro-batch: on a CPU after the operators (the host runs both, one after the other);
on a GPU as max(host, device), since the device runs what the host has queued while the host goes on. A
micro-batch is host-bound when the host's share is the larger; the smallest micro-batch whose device time
covers the host's is the one that saturates the device.
"""
import contextlib
import copy
import gc
import statistics
import time
from dataclasses import replace

import torch

from config import Config
import compat
from engine.deepspeed_zero import DeepSpeedEngine
from engine.ds_config import DTYPES, build_ds_config
from loop.timing import synchronize

MODES = ("none", "selective", "full")  # what a plan assigns a block (ac/policies.py's choose_plan)
STAGES = (1, 2, 3)
PROBE_WIDTH = 32  # ViT's hidden size, Swin's embedding width in the probe: arithmetic far below the host's work


def probe_configs(config) -> list:
    """(transformers config, blocks) at two depths of the model's structure at the probe's width: ViT at 4 and
    12 blocks; Swin with every stage 1 and 3 blocks deep (its patch merging, once per stage, stays in the
    intercept); SegFormer likewise, each stage at the probe's width. The depths lie far apart, so that a few milliseconds of noise in either is small against their
    difference."""
    out = []
    for scale in (1, 3):
        c = copy.deepcopy(config)
        if c.model_type == "segformer":  # four stages, each `scale` blocks deep, all at the probe's width
            c.hidden_sizes, c.num_attention_heads = [PROBE_WIDTH] * 4, [1] * 4
            c.depths, c.decoder_hidden_size = [scale] * 4, PROBE_WIDTH
            blocks = 4 * scale
        elif c.model_type == "swin":
            c.embed_dim = PROBE_WIDTH // 2
            c.depths, c.num_heads = [scale] * len(config.depths), [1] * len(config.depths)
            c.hidden_size = c.embed_dim * 2 ** (len(config.depths) - 1)
            blocks = scale * len(config.depths)
        else:
            c.hidden_size, c.num_attention_heads, c.intermediate_size = PROBE_WIDTH, 2, 2 * PROBE_WIDTH
            c.num_hidden_layers = blocks = 4 * scale
        out.append((c, blocks))
    return out


def probed_engine(probed: dict) -> str:
    """The engine a probe ran (DeepSpeed's, in calibrations that do not name it)."""
    return probed.get("engine", DeepSpeedEngine.name)


def _median_seconds(run_micro, run_step, device, warmup: int, steps: int) -> tuple[float, float]:
    micro, step = [], []
    for i in range(warmup + steps):
        synchronize(device)
        t0 = time.perf_counter()
        run_micro()
        synchronize(device)
        t1 = time.perf_counter()
        run_step()
        synchronize(device)
        t2 = time.perf_counter()
        if i >= warmup:
            micro.append(t1 - t0)
            step.append(t2 - t1)
    return statistics.median(micro), statistics.median(step)


def _engine_seconds(config, run: Config, world_size: int, images, labels, device, dtype, warmup: int,
                    steps: int) -> tuple[float, float, float]:
    """(micro-batch, optimizer step, bare micro-batch) seconds of the model under `run`'s checkpointing and ZeRO
    stage, wrapped as a run's model is (engine/deepspeed_zero.py); the bare forward and backward is the same model
    timed just before it is wrapped (the dispatcher's share alone), so that the difference is measured in one
    moment of the machine."""
    from transformers import AutoModelForImageClassification

    from ac.policies import apply_activation_checkpointing
    from engine.deepspeed_zero import initialize
    from models.registry import width

    ds_config = build_ds_config(run, width(config), world_size, run.precision)
    model = AutoModelForImageClassification.from_config(config).to(device, dtype)

    def bare():
        model(pixel_values=images, labels=labels).loss.backward()
    # a ZeRO-3 engine probed earlier leaves DeepSpeed's linear installed process-wide: the bare model, and the
    # engines of ZeRO-1 and 2, run torch's own, as in a run of theirs
    with compat.functional_linear_is_torchs():
        bare_s = _median_seconds(bare, lambda: model.zero_grad(set_to_none=True), device, warmup, steps)[0]
    plan = apply_activation_checkpointing(model, run.ac, device.type, log=lambda *_: None)
    engine = initialize(model, run, ds_config, plan)

    def micro():
        engine.backward(engine(pixel_values=images, labels=labels).loss)
    try:
        with compat.functional_linear_is_torchs() if run.zero_stage < 3 else contextlib.nullcontext():
            return (*_median_seconds(micro, engine.step, device, warmup, steps), bare_s)
    finally:
        engine.destroy()
        gc.collect()


def probe(cfg: Config, precision: str, device: torch.device, world_size: int, warmup: int = 5, steps: int = 10,
          stages=STAGES, progress=None, rounds: int = 3) -> dict:
    """The host figures of `cfg`'s model on this rank (every rank of the process group calls it at once).
    {"blocks": [small, large], "stages": {stage: {"micro": {policy: [seconds small, large]}, "plain": {policy:
    [the bare model's seconds just before]}, "step": [seconds small, large]}}}: the medians of `steps` timed
    steps after `warmup`. The whole grid (depth x stage x policy) runs `rounds` times over, one round after
    the other, and each figure is the median of its rounds: a machine whose speed drifts over minutes moves
    every configuration alike rather than the one it happened to be running."""
    from models.registry import model_config

    dtype = DTYPES[precision]
    configs = probe_configs(model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size))
    images = torch.randn(1, 3, cfg.image_size, cfg.image_size, device=device, dtype=dtype)
    labels = torch.zeros(1, dtype=torch.long, device=device)
    timing = (images, labels, device, dtype, warmup, steps)
    total, done = rounds * len(configs) * len(stages) * len(MODES), 0
    # samples[(depth, stage, mode)]: (micro-batch, optimizer step, bare micro-batch) seconds of each round
    samples = {}
    for _ in range(rounds):
        for depth, (config, _) in enumerate(configs):
            for stage in stages:
                for mode in MODES:
                    run = replace(cfg, zero_stage=stage, ac=mode, micro_batch_size=1, grad_accum_steps=1,
                                  compile=False, ds_config="", precision=precision)
                    samples.setdefault((depth, stage, mode), []).append(
                        _engine_seconds(config, run, world_size, *timing))
                    done += 1
                    if progress:
                        progress(done, total)

    def median(depth, stage, mode, i):
        return statistics.median(s[i] for s in samples[depth, stage, mode])
    depths = range(len(configs))
    return {"engine": DeepSpeedEngine.name, "blocks": [b for _, b in configs], "warmup": warmup, "steps": steps, "rounds": rounds,
            "width": PROBE_WIDTH, "micro_batch_size": 1,
            "stages": {str(s): {"micro": {m: [median(d, s, m, 0) for d in depths] for m in MODES},
                                "plain": {m: [median(d, s, m, 2) for d in depths] for m in MODES},
                                "step": [statistics.median(median(d, s, m, 1) for m in MODES) for d in depths]}
                       for s in stages}}


def slowest_host(per_rank: list) -> dict:
    """One probe from every rank's: each figure the largest of the ranks' (a step waits for the slowest)."""
    def worst(values):
        if isinstance(values[0], dict):
            return {k: worst([v[k] for v in values]) for k in values[0]}
        return [max(v) for v in zip(*values)]
    out = dict(per_rank[0])
    out["stages"] = worst([r["stages"] for r in per_rank])
    return out


def _line(blocks: list, seconds: list) -> tuple[float, float]:
    """(intercept, slope) through the two depths' seconds; a slope below zero (noise) counts as zero."""
    slope = max((seconds[1] - seconds[0]) / (blocks[1] - blocks[0]), 0.0)
    return max(seconds[0] - slope * blocks[0], 0.0), slope


def host_seconds(host: dict, stage: int, plan: list, serial: bool) -> dict:
    """What the host spends on a micro-batch and on an optimizer step of a model whose blocks follow `plan`
    (a policy per block; `offload` and `light` count as none), per the probe `host`. `serial` (a CPU): only what the
    operators' replay does not already hold, the engine's and the checkpointing's share beyond the bare
    forward and backward."""
    figures, blocks = host["stages"][str(stage)], host["blocks"]

    # the bare model is the same whatever the policy its engine is then given: the median of its timings
    bare = [statistics.median(t) for t in zip(*figures["plain"].values())]

    def seconds(mode: str) -> list:  # a micro-batch at each depth, all its blocks under `mode`
        if not serial:
            return figures["micro"][mode]
        return [max(a - b, 0.0) for a, b in zip(figures["micro"][mode], bare)]
    base, _ = _line(blocks, seconds("none"))
    per_block = {m: _line(blocks, seconds(m))[1] for m in MODES}
    step_base, step_slope = _line(blocks, figures["step"])
    return {"micro_s": base + sum(per_block.get(how, per_block["none"]) for how in plan),
            "step_s": step_base + step_slope * len(plan), "per_block_s": per_block}
