"""Throughput and peak memory: DeepSpeed ZeRO 1-3 with this project's activation checkpointing, against
plain PyTorch FSDP2 with Hugging Face's own checkpointing. One command per suite:

    .venv/bin/python benchmarks/train_bench.py --suite cpu-smoke   # ~80 s: checks the harness (a test runs it)
    .venv/bin/python benchmarks/train_bench.py --suite cpu         # ~60 min on 2 cores: the committed results
    .venv/bin/python benchmarks/train_bench.py --suite gpu         # one 8-GPU node, bf16 (not run here)
    .venv/bin/python benchmarks/train_bench.py --suite gpu-check   # one GPU, ViT-L, one repeat (gpu_check.sh)
    .venv/bin/python benchmarks/train_bench.py --suite cpu --out /tmp/rerun --compare benchmarks/results/cpu
                                                                   # a rerun, checked against the committed one

Every configuration is its own distributed job (`bench_worker.py` under torchrun); all configurations of a
suite run in one invocation, in alternating order (forward, then reversed, ...), `repeats` times. Writes
benchmarks/results/<suite>/: runs.jsonl (every job), results.csv (median, min, max per configuration),
results.md (tables and the targets, met or missed) and pareto.png (images/s against peak memory).
"""
import argparse
import csv
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
MiB = 2**20


@dataclass
class Shape:
    model: str
    image_size: int
    patch_size: int
    micro_batch_size: int
    label: str


@dataclass
class Run:
    """One configuration. `ac` is this project's policy, on either engine, or for FSDP2 also Hugging Face's own
    checkpointing (`hf:full`, `hf:every_n:K`); `auto:race` and `auto:fX` are budgets the harness fills from
    peaks it measured earlier in the same invocation (see `resolve_budget`)."""
    engine: str  # deepspeed | fsdp2
    ac: str
    zero: int = 0  # deepspeed's stage
    reshard: bool = True  # fsdp2's reshard_after_forward

    @property
    def name(self) -> str:
        if self.engine == "fsdp2":
            hf = {"hf:full": "HF full AC"}.get(self.ac, f"HF AC every {self.ac.split(':')[-1]}") \
                if self.ac.startswith("hf:") else self.ac
            return f"FSDP2{'' if self.reshard else ' no-reshard'} + {hf}"
        return f"ZeRO-{self.zero} + {self.ac}"

    @property
    def plain(self) -> bool:
        """FSDP2 as its users run it: without this project's checkpointing (none, or Hugging Face's)."""
        return self.engine == "fsdp2" and (self.ac == "none" or self.ac.startswith("hf:"))


@dataclass
class Suite:
    shapes: list
    runs: list  # per shape label, or "*" for every shape: {label: [Run, ...]}
    repeats: int = 5
    profiled_steps: int = 2
    warmup_steps: int = 0  # untimed, between the profiled steps and the timed ones (bench_worker.Spec)
    timed_steps: int = 2
    ranks: int = 2
    timeout_s: int = 600
    targets_shape: str = ""  # the shape the budget-race, memory and `auto` targets are checked on
    host: bool = False  # a host-overhead suite: its targets are on the time per step alone
    notes: list = field(default_factory=list)


def fsdp2(ac, reshard=True):
    return Run("fsdp2", ac, reshard=reshard)


def zero(stage, *policies):
    return [Run("deepspeed", ac, zero=stage) for ac in policies]


def same_policy(policies, stage=3):
    """Each policy under FSDP2 (resharding, as ZeRO-3 does) and under ZeRO-`stage`, side by side."""
    return [run for ac in policies for run in (fsdp2(ac), Run("deepspeed", ac, zero=stage))]


# Order matters only in the first repeat: plain FSDP2 and the fixed policies come first because the `auto`
# budgets are derived from their measured peaks.
PLAIN_VIT = [fsdp2("none"), fsdp2("hf:full"), fsdp2("hf:every_n:2"), fsdp2("none", False)]
PLAIN_SWIN = [fsdp2("none"), fsdp2("hf:full"), fsdp2("none", False)]
VIT_S = Shape("vit-small", 64, 8, 32, "ViT-S/8, 64x64 (65 tokens), batch 32 per rank")
SWIN_T = Shape("swin-tiny-w4", 128, 4, 32, "Swin-T (4x4 windows), 128x128, batch 32 per rank")
SUITES = {
    "cpu-smoke": Suite(
        shapes=[Shape("vit-debug", 16, 0, 8, "vit-debug, 16x16, batch 8 per rank")],
        runs={"*": [fsdp2("none"), fsdp2("hf:full"), *zero(1, "none"), *same_policy(["selective"]),
                    *zero(3, "none", "full", "auto:f0.5")]},
        repeats=2, profiled_steps=2, warmup_steps=1, timed_steps=2, timeout_s=180, targets_shape="vit-debug"),
    "cpu": Suite(
        shapes=[VIT_S, SWIN_T],
        runs={VIT_S.label: [*PLAIN_VIT, Run("deepspeed", "none", zero=2),
                            *same_policy(["full", "every_n:2", "selective", "hierarchical"]), *zero(3, "none"),
                            *same_policy(["auto:race"]), *zero(2, "auto:race")],
              SWIN_T.label: [*PLAIN_SWIN, Run("deepspeed", "none", zero=2), *zero(3, "none"),
                             *same_policy(["selective", "full"])]},
        # 5 repeats of 3 timed steps: 15 steps per configuration, each ratio paired within a repeat
        repeats=5, profiled_steps=2, warmup_steps=1, timed_steps=3, targets_shape="vit-small"),
    # host overhead: 24 blocks of width 64 and 2 images per rank, where a step is the engine's Python, dispatch
    # and collectives rather than arithmetic; the time per step, per engine and per policy
    "host": Suite(
        shapes=[Shape("vit-narrow", 32, 4, 2, "ViT 24 blocks x width 64, 32x32 (65 tokens), batch 2 per rank")],
        runs={"*": [fsdp2("none"), fsdp2("hf:full"), fsdp2("none", False), *zero(2, "none"), *zero(3, "none"),
                    *same_policy(["selective", "full"])]},
        repeats=5, profiled_steps=2, warmup_steps=5, timed_steps=30, timeout_s=300, targets_shape="vit-narrow",
        host=True),
    "gpu": Suite(
        shapes=[Shape("vit-large", 224, 16, 32, "ViT-L/16, 224x224, batch 32 per GPU"),
                Shape("vit-huge", 224, 14, 16, "ViT-H/14, 224x224, batch 16 per GPU"),
                Shape("swin-base", 224, 4, 32, "Swin-B, 224x224, batch 32 per GPU"),
                Shape("swin-large", 224, 4, 16, "Swin-L, 224x224, batch 16 per GPU")],
        runs={"*": [fsdp2("none"), fsdp2("hf:full"), fsdp2("hf:every_n:2"), *zero(3, "none"),
                    *same_policy(["selective", "full", "hierarchical", "auto:race"]),
                    *zero(2, "none", "selective")]},
        repeats=3, profiled_steps=3, timed_steps=10, ranks=8, targets_shape="vit-large"),
    # what benchmarks/gpu_check.sh measures on one GPU, once: each engine at each fixed policy on ViT-L/16
    # (its planned micro-batch: --micro_batch_size), and the same runs on a tiny model on CPU for its smoke mode
    "gpu-check": Suite(
        shapes=[Shape("vit-large", 224, 16, 32, "ViT-L/16, 224x224, batch 32 per GPU")],
        runs={"*": [*same_policy(["none", "selective", "full"]), *zero(2, "none", "selective", "full")]},
        repeats=1, profiled_steps=2, warmup_steps=1, timed_steps=8, ranks=1, timeout_s=120, targets_shape="vit-large"),
    "gpu-check-smoke": Suite(
        shapes=[Shape("vit-debug", 16, 0, 8, "vit-debug, 16x16, batch 8 per rank")],
        runs={"*": [*same_policy(["none", "selective", "full"]), *zero(2, "none", "selective", "full")]},
        repeats=1, profiled_steps=2, warmup_steps=1, timed_steps=2, ranks=1, timeout_s=120, targets_shape="vit-debug"),
}


def runs_of(suite: Suite, shape: Shape) -> list:
    return suite.runs.get(shape.label, suite.runs.get("*", []))


# ----------------------------------------------------------------------------- measuring
# glibc's malloc hands allocations above 32 MiB to mmap and returns freed heap tops to the kernel, so every step
# faults those pages in again, which taxes a checkpointed backward's new allocations rather than its work.
# Keeping freed memory in the process is what CUDA's caching allocator does on GPUs (docs/benchmarks.md). No
# effect on the peaks, which come from the profiler's allocation events; max RSS grows. Read at process start.
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def gemm_gflops(threads: int, n: int = 2048, reps: int = 5) -> list:
    """fp32 GEMM rate with the ranks' thread count: the CPU peak MFU is measured against."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        rates.append(2 * n**3 / (time.perf_counter() - start) / 1e9)
    return rates


def memory_gbs(threads: int, reps: int = 5) -> list:
    """GB/s of an elementwise add over 64 MiB fp32 tensors with the ranks' thread count (engine/replay.py)."""
    from engine.replay import stream_gbs

    torch.set_num_threads(threads)
    return [stream_gbs(torch.device("cpu"), reps=1) for _ in range(reps)]


def calibrate(model: str, image_size: int, patch_size: int, micro_batch_size: int, num_labels: int, ranks: int,
              threads: int, precision: str = "fp32", timeout_s: int = 600) -> dict:
    """`plan.py --calibrate` of one shape under torchrun with the suite's ranks and threads: the planner's
    figures for it, measured with every rank running as in a suite's job (engine/planner.py:calibrate)."""
    from engine.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calibration.json")
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), os.path.join(REPO, "plan.py"), "--calibrate", out, "--model", model,
               "--image_size", str(image_size), "--patch_size", str(patch_size), "--micro_batch_size",
               str(micro_batch_size), "--num_labels", str(num_labels), "--precision", precision]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", **CPU_ALLOCATOR_ENV)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"calibrating {model} failed: {(proc.stdout + proc.stderr)[-2000:]}")
        with open(out) as f:
            return json.load(f)


# dense bf16 peak per GPU (TFLOP/s, without sparsity), from the vendors' data sheets: reported beside the measured one
GPU_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}


def gpu_peak_gflops(n: int = 8192, reps: int = 5) -> list:
    """bf16 GEMM rate of this GPU, measured now: the peak MFU is read against (the data sheet's beside it)."""
    from engine.timing import clock

    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    rates = []
    for _ in range(reps):
        start = clock(device)
        for _ in range(10):
            a @ a
        rates.append(10 * 2 * n**3 / (clock(device) - start) / 1e9)
    return rates


def datasheet_gflops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((tflops * 1e3 for key, tflops in GPU_BF16_PEAK_TFLOPS.items() if key in name), None)


def model_flops_per_image(shape: Shape) -> float:
    """Forward + backward FLOPs of the model as defined (no recompute), counted by torch."""
    from engine import compat
    from models import build_model

    model, _ = build_model(shape.model, 10, shape.image_size, shape.patch_size)
    images = torch.randn(2, 3, shape.image_size, shape.image_size)
    with compat.flop_counter() as counter:
        model(images).logits.sum().backward()
    return counter.get_total_flops() / 2


def peak_of(result: dict) -> int:
    """Peak allocated bytes of a job: the largest rank's."""
    return max(result["peak_alloc_bytes"])


def resolve_budget(run: Run, shape: Shape, measured: dict):
    """GiB for `auto:race` (halfway between FSDP2 + HF full AC's and plain FSDP2's peaks: the budget race) or
    `auto:fX` (X of the way from this stage's `full` peak to its `none` peak: the budget sweep)."""
    arg = run.ac.split(":", 1)[1]
    if arg == "race":
        low, high = measured.get((shape.label, fsdp2("hf:full").name)), measured.get((shape.label, fsdp2("none").name))
        frac = 0.5
    elif arg.startswith("f"):
        low = measured.get((shape.label, Run("deepspeed", "full", run.zero).name))
        high = measured.get((shape.label, Run("deepspeed", "none", run.zero).name))
        frac = float(arg[1:])
    else:
        return float(arg)
    if low is None or high is None:
        raise RuntimeError(f"{run.name}: its budget's reference runs have not been measured")
    return (low + frac * (high - low)) / 2**30


def run_job(suite: Suite, shape: Shape, run: Run, budget_gib, repeat: int, threads: int, log_dir: str) -> dict:
    ac = f"auto:{budget_gib:.6f}" if budget_gib is not None else run.ac
    spec = dict(engine=run.engine, model=shape.model, image_size=shape.image_size, patch_size=shape.patch_size,
                micro_batch_size=shape.micro_batch_size, zero=run.zero or 3, ac=ac, reshard=run.reshard,
                profiled_steps=suite.profiled_steps, warmup_steps=suite.warmup_steps, timed_steps=suite.timed_steps,
                count_flops=repeat == 0)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(suite.ranks),
               "--master_port", str(port), os.path.join(REPO, "benchmarks", "bench_worker.py"),
               "--spec", json.dumps(spec), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1",
                   **CPU_ALLOCATOR_ENV)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=suite.timeout_s)
            failed = proc.returncode != 0 or not os.path.exists(out)
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            failed, tail = True, f"timed out after {suite.timeout_s} s"
        result = {"error": tail} if failed else json.load(open(out))
    result.update(shape=shape.label, run=run.name, engine=run.engine, zero=run.zero, reshard=run.reshard,
                  ac=run.ac, budget_gib=budget_gib, repeat=repeat, job_seconds=time.perf_counter() - start)
    if failed:
        with open(os.path.join(log_dir, "failed.log"), "a") as f:
            f.write(f"=== {shape.label} | {run.name} | repeat {repeat}\n{tail}\n")
    return result


# ----------------------------------------------------------------------------- statistics
BOOTSTRAP_RESAMPLES = 10_000


def by_repeat(results: list, shape: str, config: str, value) -> dict:
    """{repeat: value(job)} of a configuration's successful jobs."""
    return {r["repeat"]: value(r) for r in results
            if r["shape"] == shape and r["run"] == config and "error" not in r}


def paired_ratio(a: dict, b: dict, seed: int = 0):
    """(ratio, low, high, n) of a over b, both {repeat: value}: the geometric mean of the per-repeat ratios
    (a and b of one repeat ran in the same sweep of the alternating order, so the machine's drift between
    sweeps cancels), with a 95% percentile bootstrap interval over the repeats. None without a common repeat."""
    import random

    logs = [math.log(a[k] / b[k]) for k in sorted(set(a) & set(b)) if a[k] > 0 and b[k] > 0]
    if not logs:
        return None
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(BOOTSTRAP_RESAMPLES))
    lo, hi = means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]
    return math.exp(statistics.fmean(logs)), math.exp(lo), math.exp(hi), len(logs)


def fmt_ratio(r) -> str:
    return f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]" if r else "n/a"


def speed_ratio(results, shape, a, b):
    return paired_ratio(by_repeat(results, shape, a, lambda r: r["images_per_sec"]),
                        by_repeat(results, shape, b, lambda r: r["images_per_sec"]))


def peak_ratio(results, shape, a, b):
    return paired_ratio(by_repeat(results, shape, a, peak_of), by_repeat(results, shape, b, peak_of))


def engine_table(results: list, rows: list, suite: Suite) -> list:
    """Table 1: DeepSpeed against FSDP2 at the same checkpointing policy (ZeRO-3 against resharding FSDP2,
    ZeRO-2 against FSDP2 without resharding), per shape: dicts with the two rows and both ratios."""
    out = []
    for shape in suite.shapes:
        have = {r["config"]: r for r in rows if r["shape"] == shape.label and "images_per_sec" in r}
        for run in runs_of(suite, shape):
            if run.engine != "deepspeed" or run.zero == 1:
                continue
            other = fsdp2(run.ac, reshard=run.zero == 3)
            if run.name in have and other.name in have:
                out.append({"shape": shape.label, "policy": run.ac, "ours": have[run.name], "fsdp2": have[other.name],
                            "speed": speed_ratio(results, shape.label, run.name, other.name),
                            "memory": peak_ratio(results, shape.label, run.name, other.name)})
    return out


def race_table(results: list, rows: list, suite: Suite) -> list:
    """Table 2, the budget race: at each budget (every plain FSDP2 configuration's peak, and the midpoint between
    FSDP2 + HF full AC's and plain FSDP2's peaks that `auto:race` was given), the fastest configuration with
    this project's checkpointing that fits (DeepSpeed's, and on either engine) against plain FSDP2's fastest
    that fits, with the paired speed ratio."""
    out = []
    for shape in suite.shapes:
        have = [r for r in rows if r["shape"] == shape.label and "images_per_sec" in r]
        plain_names = {run.name for run in runs_of(suite, shape) if run.plain}
        plain = [r for r in have if r["config"] in plain_names]
        budgets = sorted({r["peak_alloc_mib"] for r in plain})
        f_none = next((r for r in plain if r["config"] == fsdp2("none").name), None)
        f_full = next((r for r in plain if r["config"] == fsdp2("hf:full").name), None)
        midpoint = (f_none["peak_alloc_mib"] + f_full["peak_alloc_mib"]) / 2 if f_none and f_full else None
        if midpoint:
            budgets = sorted(budgets + [midpoint])
        for budget in budgets:
            fits = [r for r in have if r["peak_alloc_mib"] <= budget]
            best = lambda rs: max(rs, key=lambda r: r["images_per_sec"]) if rs else None  # noqa: E731
            theirs = best([r for r in fits if r["config"] in plain_names])
            ours = best([r for r in fits if r["engine"] == "deepspeed"])
            either = best([r for r in fits if r["config"] not in plain_names])
            if not theirs:
                continue
            entry = {"shape": shape.label, "budget_mib": budget, "midpoint": budget == midpoint, "fsdp2": theirs,
                     "ours": ours, "either": either}
            for key in ("ours", "either"):
                entry[f"{key}_speed"] = speed_ratio(results, shape.label, entry[key]["config"], theirs["config"]) \
                    if entry[key] else None
            out.append(entry)
    return out


# ----------------------------------------------------------------------------- summarising
def summarise(results: list, shapes: list, suite: Suite, flops: dict, peak_gflops: float) -> list:
    rows = []
    for shape in shapes:
        reference_loss = None
        for run in runs_of(suite, shape):
            jobs = [r for r in results if r["shape"] == shape.label and r["run"] == run.name and "error" not in r]
            failed = [r for r in results if r["shape"] == shape.label and r["run"] == run.name and "error" in r]
            row = {"shape": shape.label, "config": run.name, "engine": run.engine, "zero_stage": run.zero or "",
                   "reshard": run.reshard if run.engine == "fsdp2" else "", "ac": run.ac, "jobs_ok": len(jobs),
                   "jobs_failed": len(failed)}
            if not jobs:
                rows.append(row)
                continue
            speeds = [r["images_per_sec"] for r in jobs]
            peaks = [peak_of(r) for r in jobs]
            first = jobs[0]
            hardware = next((r["hardware_flops_per_step"] for r in jobs if r["hardware_flops_per_step"]), 0)
            model_per_step = flops[shape.label] * shape.micro_batch_size * suite.ranks
            med = statistics.median(speeds)
            # the loss of the same step in every job (the first repeat's jobs run one extra, FLOP-counted step)
            loss = statistics.median(r["losses"][suite.profiled_steps + suite.timed_steps - 1] for r in jobs)
            if reference_loss is None:
                reference_loss = loss
            row.update(
                budget_gib=round(first["budget_gib"], 4) if first["budget_gib"] else "",
                images_per_sec=round(med, 3), images_per_sec_min=round(min(speeds), 3),
                images_per_sec_max=round(max(speeds), 3),
                step_ms=round(1000 * shape.micro_batch_size * suite.ranks / med, 2),
                mfu=round(flops[shape.label] * med / (peak_gflops * 1e9 * suite.ranks), 4),
                recompute_flops_frac=round(hardware / model_per_step - 1, 4) if hardware else "",
                peak_alloc_mib=round(statistics.median(peaks) / MiB, 1),
                peak_alloc_mib_min=round(min(peaks) / MiB, 1), peak_alloc_mib_max=round(max(peaks) / MiB, 1),
                setup_peak_mib=round(statistics.median(max(r["setup_peak_bytes"]) for r in jobs) / MiB, 1),
                step_peak_mib=round(statistics.median(max(r["step_peak_bytes"]) for r in jobs) / MiB, 1),
                activation_mib=round(statistics.median(max(r["activation_bytes"]) for r in jobs) / MiB, 1),
                # the whole weights that forward left beside them (absent from older runs.jsonl files: 0)
                forward_weights_mib=round(statistics.median(max(r.get("forward_weight_bytes", [0])) for r in jobs)
                                          / MiB, 1),
                max_rss_mib=round(statistics.median(max(r["max_rss_bytes"]) for r in jobs) / MiB, 1),
                final_loss=round(loss, 6), loss_rel_diff=f"{abs(loss - reference_loss) / abs(reference_loss):.1e}",
                ac_plan="/".join(f"{p[0]}" for p in first.get("ac_plan", {}).get("blocks", [])))
            # images/s over the same repeats' plain FSDP2, with its interval: what `--compare` checks
            vs = speed_ratio(results, shape.label, run.name, fsdp2("none").name)
            if vs:
                row.update(speed_vs_fsdp2=round(vs[0], 4), speed_vs_fsdp2_low=round(vs[1], 4),
                           speed_vs_fsdp2_high=round(vs[2], 4))
            plan = first.get("ac_plan", {})
            if plan.get("peak_bytes_planned") is not None:  # the planner's prediction, against the peak
                planned = plan["peak_bytes_planned"] / MiB
                row.update(planned_peak_mib=round(planned, 1),
                           planned_error=round(planned / row["peak_alloc_mib"] - 1, 4))
            rows.append(row)
    return rows


def straddles(r, threshold: float) -> str:
    """A note when a ratio's interval contains the target's threshold: the verdict rests on the point only."""
    return " (the interval straddles the target)" if r and r[1] <= threshold <= r[2] else ""


def check_targets(rows: list, suite: Suite, results: list) -> list:
    """(target, verdict, figures): DeepSpeed against FSDP2 at equal policy and `selective` on every shape; the
    budget race, memory and `auto` targets on the targets shape, the race reported on the others
    (docs/benchmarks.md lists them). Verdicts are on the point estimates; each ratio carries its interval."""
    label = next((s.label for s in suite.shapes if s.model == suite.targets_shape), None)
    shape_rows = [r for r in rows if r["shape"] == label and "images_per_sec" in r]
    by = {r["config"]: r for r in shape_rows}
    out = []

    def fits(r, budget_mib):
        return r["peak_alloc_mib"] <= budget_mib

    for e in engine_table(results, rows, suite):
        speed, memory = e["speed"], e["memory"]
        if not speed or not memory:
            continue
        if suite.host:  # the time per step is the host's: DeepSpeed's at most 1.1x FSDP2's
            step = speed_ratio(results, e["shape"], e["fsdp2"]["config"], e["ours"]["config"])
            out.append((f"Host time per step, {e['ours']['config']} against {e['fsdp2']['config']}: <= 1.10x",
                        step[0] <= 1.10, f"{fmt_ratio(step)}x{straddles(step, 1.10)} "
                                         f"({e['ours']['step_ms']:.1f} vs {e['fsdp2']['step_ms']:.1f} ms)"))
            continue
        out.append((f"Equal policy, {e['shape'].split(',')[0]}, {e['ours']['config']} against "
                    f"{e['fsdp2']['config']}: images/s >= 0.98x, peak <= 1.00x",
                    speed[0] >= 0.98 and memory[0] <= 1.0,
                    f"images/s {fmt_ratio(speed)}{straddles(speed, 0.98)}; peak {fmt_ratio(memory)} "
                    f"({e['ours']['peak_alloc_mib']:.0f} vs {e['fsdp2']['peak_alloc_mib']:.0f} MiB)"))
    for e in race_table(results, rows, suite) if not suite.host else []:
        if not e["midpoint"] or not e["ours"]:
            continue
        r = e["ours_speed"]
        checked = e["shape"] == label
        out.append((f"Budget race, {e['shape'].split(',')[0]}: at {e['budget_mib']:.0f} MiB, our fastest that fits / "
                    f"plain FSDP2's fastest that fits" + (" >= 1.10x" if checked else " (reported)"),
                    r[0] >= 1.10 if checked else None,
                    f"{fmt_ratio(r)}{straddles(r, 1.10) if checked else ''}: {e['ours']['config']} "
                    f"{e['ours']['images_per_sec']:.2f} img/s at {e['ours']['peak_alloc_mib']:.0f} MiB vs "
                    f"{e['fsdp2']['config']} {e['fsdp2']['images_per_sec']:.2f} img/s at "
                    f"{e['fsdp2']['peak_alloc_mib']:.0f} MiB"))
    z3 = by.get("ZeRO-3 + none")
    if z3 and not suite.host:
        fast = [r for r in shape_rows if r["engine"] == "deepspeed" and r["images_per_sec"] >= 0.9 * z3["images_per_sec"]]
        best = min(fast, key=lambda r: r["peak_alloc_mib"])
        ratio = best["peak_alloc_mib"] / z3["peak_alloc_mib"]
        out.append(("Memory: best-memory config at >= 0.9x ZeRO-3's images/s uses <= 0.7x its peak", ratio <= 0.7,
                    f"{best['config']}: {ratio:.3f}x the peak ({best['peak_alloc_mib']:.0f} vs "
                    f"{z3['peak_alloc_mib']:.0f} MiB) at {best['images_per_sec'] / z3['images_per_sec']:.3f}x the images/s"))
    for shape in suite.shapes:  # `selective` is held to its target on every shape and engine
        of_shape = {r["config"]: r for r in rows if r["shape"] == shape.label and "images_per_sec" in r}
        for engine in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2"):
            none, sel = of_shape.get(f"{engine} + none"), of_shape.get(f"{engine} + selective")
            if none and sel and none["activation_mib"]:
                cut = 1 - sel["activation_mib"] / none["activation_mib"]
                step = speed_ratio(results, shape.label, none["config"], sel["config"])  # step time, sel / none
                if suite.host:
                    out.append((f"Host time per step, {engine}: selective <= 1.10x none", step[0] <= 1.10,
                                f"{fmt_ratio(step)}x{straddles(step, 1.10)} ({sel['step_ms']:.1f} vs "
                                f"{none['step_ms']:.1f} ms)"))
                    continue
                out.append((f"Selective, {shape.label.split(',')[0]}, {engine}: activation memory -40% or more "
                            f"at <= 10% step time", cut >= 0.4 and step[0] <= 1.10,
                            f"activations {sel['activation_mib']:.0f} vs {none['activation_mib']:.0f} MiB "
                            f"({-cut:+.1%}), step time {fmt_ratio(step)}x{straddles(step, 1.10)}"))
    for r in shape_rows:
        if not r["ac"].startswith("auto") or not r.get("budget_gib"):
            continue
        budget = r["budget_gib"] * 1024
        fixed = [x for x in shape_rows if (x["engine"], x["zero_stage"], x["reshard"]) == (r["engine"], r["zero_stage"],
                 r["reshard"]) and not x["ac"].startswith(("auto", "hf:")) and fits(x, budget)]
        fastest = max(fixed, key=lambda x: x["images_per_sec"]) if fixed else None
        within = r["peak_alloc_mib"] <= 1.05 * budget
        speed = r["images_per_sec"] / fastest["images_per_sec"] if fastest else None
        # "never slower" judged against the run-to-run noise: the fastest fixed policy's own min-max
        fast_enough = fastest is None or r["images_per_sec"] >= fastest["images_per_sec_min"]
        out.append((f"{r['config']} (budget {budget:.0f} MiB): peak within 5%, not slower than the fastest fixed "
                    f"policy that fits", within and fast_enough,
                    f"peak {r['peak_alloc_mib']:.0f} MiB ({r['peak_alloc_mib'] / budget - 1:+.1%} of the budget), plan "
                    f"{r['ac_plan']}; " + (f"{speed:.3f}x the images/s of {fastest['config']} (min-max "
                                           f"{fastest['images_per_sec_min']:.2f}-{fastest['images_per_sec_max']:.2f})"
                                           if fastest else "no fixed policy fits")))
    return out


def environment(threads: int, gemm: list) -> dict:
    import deepspeed
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    return {"date": datetime.date.today().isoformat(), "git_commit": commit, "cpu": cpu, "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "",
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "threads_per_rank": threads, "peak_gflops_per_rank": round(statistics.median(gemm), 1),
            # what the planner charges memory-bound operators at on CPU (engine/planner.py)
            "mem_gbs_per_rank": None if torch.cuda.is_available() else round(statistics.median(memory_gbs(threads)), 1),
            "peak_source": "bf16 GEMM 8192^3, measured here" if torch.cuda.is_available() else
            "fp32 GEMM 2048^3, measured here",
            "datasheet_gflops_per_rank": datasheet_gflops() if torch.cuda.is_available() else None,
            "gemm_samples": [round(g, 1) for g in gemm]}


def write_markdown(path: str, suite_name: str, suite: Suite, rows: list, targets: list, env: dict, minutes: float,
                   results: list):
    with open(path, "w") as f:
        f.write(f"# `{suite_name}` suite\n\n![throughput against peak memory](pareto.png)\n\n")
        f.write(f"{env['date']} | commit {env.get('git_commit', 'not recorded')} | {env['gpu'] or env['cpu']}, "
                f"{env['cores']} cores | torch {env['torch']}, deepspeed "
                f"{env['deepspeed']}, transformers {env['transformers']} | {suite.ranks} ranks x "
                f"{env['threads_per_rank']} threads | MFU peak {env['peak_gflops_per_rank']} GFLOP/s per rank "
                f"({env['peak_source']}) | {suite.repeats} repeats in alternating order, {suite.timed_steps} timed steps "
                f"each after {suite.profiled_steps} profiled and {suite.warmup_steps} warm-up ones | {minutes:.0f} min\n\n")
        f.write("Ratios: the geometric mean over repeats of the ratio within each repeat, with a 95% bootstrap "
                "interval over the repeats in brackets.\n\n")
        f.write("## Targets\n\n| target | met | measured |\n|---|---|---|\n")
        for name, ok, figures in targets:
            f.write(f"| {name} | {'-' if ok is None else 'yes' if ok else '**missed**'} | {figures} |\n")
        f.write("\n## DeepSpeed against FSDP2 at the same checkpointing policy\n\nZeRO-3 against FSDP2 resharding "
                "after the forward, ZeRO-2 against FSDP2 without; the same `apply_ac` wraps both engines' blocks.\n\n"
                "| shape | policy | DeepSpeed | images/s | FSDP2 | images/s | speed ratio | peak MiB | FSDP2 peak | "
                "memory ratio |\n|---|---|---|---|---|---|---|---|---|---|\n")
        for e in engine_table(results, rows, suite):
            o, t = e["ours"], e["fsdp2"]
            f.write(f"| {e['shape'].split(',')[0]} | {e['policy']} | {o['config']} | {o['images_per_sec']:.2f} | "
                    f"{t['config']} | {t['images_per_sec']:.2f} | {fmt_ratio(e['speed'])} | "
                    f"{o['peak_alloc_mib']:.0f} | {t['peak_alloc_mib']:.0f} | {fmt_ratio(e['memory'])} |\n")
        f.write("\n## The budget race: this project's fastest against plain FSDP2's fastest at each budget\n\n"
                "Budgets: each plain FSDP2 configuration's peak and the midpoint (*) between FSDP2 + HF full AC's "
                "and plain FSDP2's. Plain FSDP2: no checkpointing or Hugging Face's. Ours: DeepSpeed with this "
                "project's checkpointing; *either engine*: this project's checkpointing under DeepSpeed or FSDP2.\n\n"
                "| shape | budget MiB | plain FSDP2's fastest | images/s | DeepSpeed's fastest | images/s | ratio | "
                "either engine's fastest | ratio |\n|---|---|---|---|---|---|---|---|---|\n")
        for e in race_table(results, rows, suite):
            t, o, x = e["fsdp2"], e["ours"], e["either"]
            f.write(f"| {e['shape'].split(',')[0]} | {e['budget_mib']:.0f}{' *' if e['midpoint'] else ''} | "
                    f"{t['config']} | {t['images_per_sec']:.2f} | "
                    + (f"{o['config']} | {o['images_per_sec']:.2f} | {fmt_ratio(e['ours_speed'])}" if o else "none fits | |")
                    + " | " + (f"{x['config']} | {fmt_ratio(e['either_speed'])}" if x else "none fits |") + " |\n")
        for shape in suite.shapes:
            f.write(f"\n## {shape.label}\n\n| configuration | images/s, median (min-max) | ms/step | MFU | recompute | peak "
                    f"MiB/rank | planned peak (error) | setup peak | step peak | activations (+ whole weights) | "
                    f"max RSS | loss after {suite.profiled_steps + suite.timed_steps} steps (rel. diff) |\n"
                    "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                if r["shape"] != shape.label:
                    continue
                if "images_per_sec" not in r:
                    f.write(f"| {r['config']} | failed ({r['jobs_failed']} jobs, see failed.log) |||||||||||\n")
                    continue
                budget = f" ({r['budget_gib'] * 1024:.0f} MiB)" if r["budget_gib"] else ""
                if r["jobs_failed"]:
                    budget += f" ({r['jobs_ok']} of {r['jobs_ok'] + r['jobs_failed']} jobs; see failed.log)"
                rec = f"{r['recompute_flops_frac']:+.0%}" if r["recompute_flops_frac"] != "" else ""
                f.write(f"| {r['config']}{budget} | {r['images_per_sec']:.2f} ({r['images_per_sec_min']:.2f}-"
                        f"{r['images_per_sec_max']:.2f}) | {r['step_ms']:.1f} | {r['mfu']:.1%} | {rec} | "
                        f"{r['peak_alloc_mib']:.0f} | "
                        + (f"{r['planned_peak_mib']:.0f} ({r['planned_error']:+.1%})" if "planned_peak_mib" in r else "")
                        + f" | {r['setup_peak_mib']:.0f} | {r['step_peak_mib']:.0f} | {r['activation_mib']:.0f}"
                        + (f" (+{r['forward_weights_mib']:.0f})" if r["forward_weights_mib"] else "") + " | "
                        f"{r['max_rss_mib']:.0f} | {r['final_loss']:.5f} ({r['loss_rel_diff']}) |\n")


def plot(path: str, suite: Suite, rows: list):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in suite.shapes if any(r["shape"] == s.label and "images_per_sec" in r for r in rows)]
    fig, axes = plt.subplots(1, len(shapes), figsize=(7.5 * len(shapes), 5.5), squeeze=False)
    colors = {"fsdp2": "tab:gray", "ours-fsdp2": "tab:orange", 1: "tab:green", 2: "tab:blue", 3: "tab:purple"}
    for ax, shape in zip(axes[0], shapes):
        rs = [r for r in rows if r["shape"] == shape.label and "images_per_sec" in r]
        for r in rs:
            plain = r["engine"] == "fsdp2" and (r["ac"] == "none" or r["ac"].startswith("hf:"))
            c = colors[r["zero_stage"] if r["engine"] == "deepspeed" else "fsdp2" if plain else "ours-fsdp2"]
            marker = "o" if r["engine"] == "deepspeed" else "s" if plain else "^"
            ax.errorbar(r["peak_alloc_mib"], r["images_per_sec"], fmt=marker, color=c, ms=6,
                        yerr=[[r["images_per_sec"] - r["images_per_sec_min"]],
                              [r["images_per_sec_max"] - r["images_per_sec"]]], capsize=2)
            ax.annotate(r["config"].replace(" + ", "\n"), (r["peak_alloc_mib"], r["images_per_sec"]), fontsize=6,
                        xytext=(4, 2), textcoords="offset points", color=c)
        # the Pareto front: no configuration is both faster and smaller
        front = sorted((r["peak_alloc_mib"], r["images_per_sec"]) for r in rs)
        best, line = -1.0, []
        for x, y in front:
            if y > best:
                best = y
                line.append((x, y))
        ax.step(*zip(*line), where="post", color="black", lw=0.8, alpha=0.5)
        f_none = next((r for r in rs if r["config"] == fsdp2("none").name), None)
        f_full = next((r for r in rs if r["config"] == fsdp2("hf:full").name), None)
        if f_none and f_full:
            ax.axvline((f_none["peak_alloc_mib"] + f_full["peak_alloc_mib"]) / 2, ls="--", color="tab:red", lw=0.8,
                       label="budget-race budget")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_xlabel("peak allocated per rank (MiB)")
        ax.set_ylabel(f"images/s ({suite.ranks} ranks), median, min-max")
        ax.set_title(shape.label, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("DeepSpeed ZeRO-1/2/3 (green/blue/purple) vs plain FSDP2 (grey squares) and FSDP2 with this "
                 "project's checkpointing (orange triangles): up and left is better",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# Reproduced, row by row: speed as each configuration's images/s over its own run's plain FSDP2 (paired within
# repeats, with its bootstrap interval: the machine's speed drifts between invocations, the ratio does not), and
# peak bytes, which do not depend on speed, directly. The peak's noise is the larger of a floor and the spread
# (max - min over median) of the configuration's own jobs in either run.
PEAK_NOISE = 0.03


def compare(rows: list, reference: list) -> tuple:
    """Markdown lines comparing a rerun's rows with a reference run's, and the rows not reproduced.

    A row is reproduced when its speed intervals against plain FSDP2 overlap in the two runs and its peaks
    agree within the noise. An `auto` row's budget comes from its own run's measured FSDP2 peaks, so when the
    two budgets differ its peak is compared relative to its budget (the row's claim is that it fits it).
    """
    def keyed(rs):
        return {(r["shape"], r["config"]): r for r in rs}

    def spread(r, column):
        return (float(r[f"{column}_max"]) - float(r[f"{column}_min"])) / float(r[column])

    def interval(r):
        return float(r["speed_vs_fsdp2_low"]), float(r["speed_vs_fsdp2_high"])

    new, ref = keyed(rows), keyed(reference)
    lines = ["| shape | config | images/s vs plain FSDP2: reference -> rerun [95% intervals] | intervals overlap | "
             "peak MiB: reference -> rerun | change (noise) | recompute FLOPs | reproduced |",
             "|---|---|---|---|---|---|---|---|"]
    missed = []
    for key, r in new.items():
        old = ref.get(key)
        if old is None or not r.get("speed_vs_fsdp2") or not old.get("speed_vs_fsdp2"):
            missed.append(key)
            lines.append(f"| {key[0][:12]} | {key[1]} | missing in one run | | | | | **no** |")
            continue
        (a_lo, a_hi), (b_lo, b_hi) = interval(old), interval(r)
        overlap = a_lo <= b_hi and b_lo <= a_hi
        peak_noise = max(PEAK_NOISE, spread(old, "peak_alloc_mib"), spread(r, "peak_alloc_mib"))
        pa, pb, what = float(old["peak_alloc_mib"]), float(r["peak_alloc_mib"]), ""
        if old.get("budget_gib") and r.get("budget_gib") and old["budget_gib"] != r["budget_gib"]:
            ga, gb = float(old["budget_gib"]) * 1024, float(r["budget_gib"]) * 1024
            what = f" (budgets {ga:.0f} -> {gb:.0f} MiB: peak/budget {pa / ga:.3f} -> {pb / gb:.3f})"
            pa, pb = pa / ga, pb / gb
        ok = overlap and abs(pb / pa - 1) <= peak_noise
        if not ok:
            missed.append(key)
        plan = f", plan {old['ac_plan']} -> {r['ac_plan']}" if r.get("ac_plan") != old.get("ac_plan") else ""
        same_flops = "same" if old["recompute_flops_frac"] == r["recompute_flops_frac"] else "differ"
        lines.append(f"| {key[0][:12]} | {key[1]}{plan} | {float(old['speed_vs_fsdp2']):.3f} [{a_lo:.3f}, {a_hi:.3f}] "
                     f"-> {float(r['speed_vs_fsdp2']):.3f} [{b_lo:.3f}, {b_hi:.3f}] | {'yes' if overlap else 'no'} | "
                     f"{float(old['peak_alloc_mib']):.0f} -> {float(r['peak_alloc_mib']):.0f}{what} | "
                     f"{pb / pa - 1:+.1%} ({peak_noise:.0%}) | {same_flops} | {'yes' if ok else '**no**'} |")
    head = (f"{len(new) - len(missed)} of {len(new)} configurations reproduced: the 95% intervals of images/s "
            f"relative to the same run's plain FSDP2 overlap, and the peaks agree within their noise (in brackets: "
            f"the larger of {PEAK_NOISE:.0%} and the spread of the configuration's jobs in either run).")
    return [head, ""] + lines, missed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--out", default="", help="output directory (default: benchmarks/results/<suite>)")
    parser.add_argument("--ranks", type=int, default=0, help="override the suite's ranks (a check, not a result)")
    parser.add_argument("--repeats", type=int, default=0, help="override the suite's repeats (a check, not a result)")
    parser.add_argument("--micro_batch_size", type=int, default=0,
                        help="override every shape's micro-batch (gpu_check.sh: the one plan.py picks)")
    parser.add_argument("--compare", default="",
                        help="a results directory of the same suite (say benchmarks/results/cpu): write comparison.md "
                             "against its results.csv and exit non-zero when a configuration is not reproduced")
    parser.add_argument("--report_only", action="store_true",
                        help="rewrite results.csv/.md and pareto.png from the out directory's runs.jsonl, running nothing")
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    if args.ranks or args.repeats:
        import dataclasses

        suite = dataclasses.replace(suite, ranks=args.ranks or suite.ranks, repeats=args.repeats or suite.repeats)
    if args.micro_batch_size:
        import dataclasses

        shapes = [dataclasses.replace(s, micro_batch_size=args.micro_batch_size,
                                      label=s.label.replace(f"batch {s.micro_batch_size} ", f"batch {args.micro_batch_size} "))
                  for s in suite.shapes]
        runs = {new.label: suite.runs.get(old.label, suite.runs.get("*")) for old, new in zip(suite.shapes, shapes)}
        suite = dataclasses.replace(suite, shapes=shapes, runs=runs)
    if args.suite.startswith("gpu") and not args.suite.endswith("smoke") and torch.cuda.device_count() < suite.ranks:
        sys.exit(f"error: the {args.suite} suite needs {suite.ranks} GPUs on this node; found {torch.cuda.device_count()}")
    out_dir = args.out or os.path.join(REPO, "benchmarks", "results", args.suite)
    os.makedirs(out_dir, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // suite.ranks) if not torch.cuda.is_available() else 1
    from tqdm import tqdm

    if args.report_only:
        with open(os.path.join(out_dir, "runs.jsonl")) as f:
            results = [json.loads(line) for line in f]
        with open(os.path.join(out_dir, "environment.json")) as f:
            saved = json.load(f)
        return report(out_dir, args.suite, suite, results, saved["gemm_samples"], threads, saved["minutes"],
                      args.compare, saved_env=saved)
    if os.path.exists(os.path.join(out_dir, "failed.log")):
        os.remove(os.path.join(out_dir, "failed.log"))
    started = time.perf_counter()
    gemm = gemm_gflops(threads) if not torch.cuda.is_available() else gpu_peak_gflops()
    # what the planner's step time is computed from, per shape (plan.py --calibrate), measured at the start of
    # every repeat, as the jobs are: the machine's speed drifts over a suite
    calibrations = {shape.label: [] for shape in suite.shapes}
    jobs = [(shape, run) for shape in suite.shapes for run in runs_of(suite, shape)]
    results, measured, budgets = [], {}, {}
    bar = tqdm(total=(len(jobs) + len(suite.shapes)) * suite.repeats, desc=args.suite, dynamic_ncols=True)
    with open(os.path.join(out_dir, "runs.jsonl"), "w") as log:
        for repeat in range(suite.repeats):
            for shape in suite.shapes:
                bar.set_postfix_str(f"calibrating the planner for {shape.model}")
                try:
                    calibrations[shape.label].append(calibrate(
                        shape.model, shape.image_size, shape.patch_size, shape.micro_batch_size, 10, suite.ranks,
                        threads, "bf16" if torch.cuda.is_available() else "fp32"))
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # plan.py --validate measures it instead
                    print(f"warning: {str(e).splitlines()[0]}", file=sys.stderr)
                bar.update()
            for shape, run in (jobs if repeat % 2 == 0 else jobs[::-1]):  # alternating order
                budget = None
                if run.ac.startswith("auto:"):
                    key = (shape.label, run.name)
                    if key not in budgets:
                        budgets[key] = resolve_budget(run, shape, measured)
                    budget = budgets[key]
                r = run_job(suite, shape, run, budget, repeat, threads, out_dir)
                if "error" not in r:
                    measured.setdefault((shape.label, run.name), peak_of(r))
                results.append(r)
                log.write(json.dumps(r) + "\n")
                log.flush()
                bar.set_postfix_str(f"{run.name}: " + (f"{r['images_per_sec']:.2f} img/s, {peak_of(r) / MiB:.0f} MiB"
                                                       if "error" not in r else "FAILED"))
                bar.update()
            if not torch.cuda.is_available():
                gemm += gemm_gflops(threads)  # the peak, re-measured between repeats: the machine drifts
    bar.close()
    from engine.planner import median_calibration

    return report(out_dir, args.suite, suite, results, gemm, threads, (time.perf_counter() - started) / 60,
                  args.compare, calibrations={k: median_calibration(v) for k, v in calibrations.items() if v})


def report(out_dir: str, suite_name: str, suite: Suite, results: list, gemm: list, threads: int, minutes: float,
           compare_to: str = "", saved_env: dict = None, calibrations: dict = None) -> int:
    """Write results.csv/.md, environment.json and pareto.png; `saved_env`: the runs' own environment (a report
    rewritten later keeps the date, commit and versions of the runs); `calibrations`: the planner's, per shape,
    the median of those measured at the start of each repeat."""
    flops = {s.label: model_flops_per_image(s) for s in suite.shapes}
    env = {k: v for k, v in saved_env.items() if k not in ("suite", "minutes", "model_flops_per_image")} \
        if saved_env else dict(environment(threads, gemm), calibration=calibrations or {})
    rows = summarise(results, suite.shapes, suite, flops, env["peak_gflops_per_rank"])
    targets = check_targets(rows, suite, results)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out_dir, "environment.json"), "w") as f:
        json.dump(dict(env, suite=suite_name, minutes=round(minutes, 1),
                       model_flops_per_image={k: v for k, v in flops.items()}), f, indent=1)
    write_markdown(os.path.join(out_dir, "results.md"), suite_name, suite, rows, targets, env, minutes, results)
    plot(os.path.join(out_dir, "pareto.png"), suite, rows)
    from plan import write_validation

    write_validation(out_dir, suite_name)  # plan.py's predictions against these rows: planner.md
    print(open(os.path.join(out_dir, "results.md")).read())
    failed = sum(r.get("jobs_failed", 0) for r in rows)
    if failed:
        print(f"{failed} jobs failed: {os.path.join(out_dir, 'failed.log')}", file=sys.stderr)
    not_reproduced = []
    if compare_to:
        with open(os.path.join(compare_to, "results.csv")) as f:
            reference = list(csv.DictReader(f))
        # through CSV, as the reference was read: the same strings on both sides
        with open(os.path.join(out_dir, "results.csv")) as f:
            lines, not_reproduced = compare(list(csv.DictReader(f)), reference)
        with open(os.path.join(out_dir, "comparison.md"), "w") as f:
            f.write(f"# {suite_name}: this run against {compare_to}\n\n" + "\n".join(lines) + "\n")
        print("\n".join(lines))
    return 1 if failed or not_reproduced else 0


if __name__ == "__main__":
    sys.exit(main())
