"""Throughput and peak memory: DeepSpeed ZeRO 1-3 with this project's activation checkpointing, against
plain PyTorch FSDP2 with Hugging Face's own checkpointing. One command per suite:

    .venv/bin/python benchmarks/train_bench.py --suite cpu-smoke   # ~80 s: checks the harness (a test runs it)
    .venv/bin/python benchmarks/train_bench.py --suite cpu         # ~60 min on 2 cores: the committed results
    .venv/bin/python benchmarks/train_bench.py --suite gpu         # one 8-GPU node, bf16 (not run here)
    .venv/bin/python benchmarks/train_bench.py --suite gpu-small   # one GPU, ViT-L, one repeat: a check
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
    """One configuration. `ac` for DeepSpeed is this project's policy; `auto:race` and `auto:fX` are budgets
    the harness fills from peaks it measured earlier in the same invocation (see `resolve_budget`)."""
    engine: str  # deepspeed | fsdp2
    ac: str
    zero: int = 0  # deepspeed's stage
    reshard: bool = True  # fsdp2's reshard_after_forward

    @property
    def name(self) -> str:
        if self.engine == "fsdp2":
            hf = {"none": "no AC", "full": "HF full AC"}.get(self.ac, f"HF AC every {self.ac.split(':')[-1]}")
            return f"FSDP2{'' if self.reshard else ' no-reshard'} + {hf}"
        return f"ZeRO-{self.zero} + {self.ac}"


@dataclass
class Suite:
    shapes: list
    runs: list  # per shape label, or "*" for every shape: {label: [Run, ...]}
    repeats: int = 3
    profiled_steps: int = 2
    warmup_steps: int = 0  # untimed, between the profiled steps and the timed ones (bench_worker.Spec)
    timed_steps: int = 2
    ranks: int = 2
    timeout_s: int = 600
    targets_shape: str = ""  # the shape the engine and `auto` targets are checked on
    notes: list = field(default_factory=list)


def fsdp2(ac, reshard=True):
    return Run("fsdp2", ac, reshard=reshard)


def zero(stage, *policies):
    return [Run("deepspeed", ac, zero=stage) for ac in policies]


# Order matters only in the first repeat: the FSDP2 runs and the fixed policies come first because the
# `auto` budgets are derived from their measured peaks.
VIT_S = Shape("vit-small", 64, 8, 32, "ViT-S/8, 64x64 (65 tokens), batch 32 per rank")
SWIN_T = Shape("swin-tiny-w4", 128, 4, 32, "Swin-T (4x4 windows), 128x128, batch 32 per rank")
SUITES = {
    "cpu-smoke": Suite(
        shapes=[Shape("vit-debug", 16, 0, 8, "vit-debug, 16x16, batch 8 per rank")],
        runs={"*": [fsdp2("none"), fsdp2("full"), *zero(1, "none"), *zero(3, "none", "selective", "full"),
                    *zero(3, "auto:f0.5")]},
        repeats=2, profiled_steps=2, warmup_steps=1, timed_steps=2, timeout_s=180, targets_shape="vit-debug"),
    "cpu": Suite(
        shapes=[VIT_S, SWIN_T],
        runs={VIT_S.label: [fsdp2("none"), fsdp2("full"), fsdp2("every_n:2"), fsdp2("none", False),
                            fsdp2("full", False),
                            *zero(1, "none", "selective", "full"),
                            *zero(2, "none", "selective", "full", "hierarchical"),
                            *zero(3, "none", "selective", "full", "hierarchical"),
                            *zero(2, "auto:race"), *zero(3, "auto:race", "auto:f0.25", "auto:f0.5", "auto:f0.75")],
              SWIN_T.label: [fsdp2("none"), fsdp2("full"), *zero(2, "none", "selective"),
                             *zero(3, "none", "selective", "full", "hierarchical")]},
        # 4 timed steps per job, 12 per configuration: warm Swin-T ZeRO-3 steps have single ops stalling at
        # random (docs/benchmarks.md), which a median of fewer steps does not absorb
        warmup_steps=2, timed_steps=4, targets_shape="vit-small"),
    "gpu": Suite(
        shapes=[Shape("vit-large", 224, 16, 32, "ViT-L/16, 224x224, batch 32 per GPU"),
                Shape("vit-huge", 224, 14, 16, "ViT-H/14, 224x224, batch 16 per GPU"),
                Shape("swin-base", 224, 4, 32, "Swin-B, 224x224, batch 32 per GPU"),
                Shape("swin-large", 224, 4, 16, "Swin-L, 224x224, batch 16 per GPU")],
        runs={"*": [fsdp2("none"), fsdp2("full"), fsdp2("every_n:2"), *zero(2, "none", "selective", "full"),
                    *zero(3, "none", "selective", "full", "hierarchical", "auto:race")]},
        repeats=3, profiled_steps=3, timed_steps=10, ranks=8, targets_shape="vit-large"),
    # the gpu suite's first shape on one GPU, once: checks the harness's GPU path in ~3 minutes (gpu_check.sh)
    "gpu-small": Suite(
        shapes=[Shape("vit-large", 224, 16, 32, "ViT-L/16, 224x224, batch 32 per GPU")],
        runs={"*": [fsdp2("none"), fsdp2("full"), *zero(2, "none", "selective"),
                    *zero(3, "none", "selective", "full", "auto:race")]},
        repeats=1, profiled_steps=3, timed_steps=10, ranks=1, timeout_s=240, targets_shape="vit-large"),
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


# dense bf16 peak per GPU (TFLOP/s, without sparsity), from the vendors' data sheets
GPU_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}


def gpu_peak_gflops() -> list:
    name = torch.cuda.get_device_name()
    for key, tflops in GPU_BF16_PEAK_TFLOPS.items():
        if key in name:
            return [tflops * 1e3]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)  # unknown GPU: measure instead
    a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return [10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e9]


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
    """GiB for `auto:race` (halfway between FSDP2 + HF full AC's and FSDP2 no-AC's peaks: the budget race) or
    `auto:fX` (X of the way from this stage's `full` peak to its `none` peak: the budget sweep)."""
    arg = run.ac.split(":", 1)[1]
    if arg == "race":
        low, high = measured.get((shape.label, fsdp2("full").name)), measured.get((shape.label, fsdp2("none").name))
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
            plan = first.get("ac_plan", {})
            if plan.get("peak_bytes_planned") is not None:  # the planner's prediction, against the peak
                planned = plan["peak_bytes_planned"] / MiB
                row.update(planned_peak_mib=round(planned, 1),
                           planned_error=round(planned / row["peak_alloc_mib"] - 1, 4))
            rows.append(row)
    return rows


def check_targets(rows: list, suite: Suite) -> list:
    """(target, verdict, figures): the engine targets (budget race, memory, floor) and `auto`'s on the targets
    shape, and `selective`'s on every shape (docs/benchmarks.md lists them)."""
    label = next((s.label for s in suite.shapes if s.model == suite.targets_shape), None)
    shape_rows = [r for r in rows if r["shape"] == label and "images_per_sec" in r]
    by = {r["config"]: r for r in shape_rows}
    out = []

    def fits(r, budget_mib):
        return r["peak_alloc_mib"] <= budget_mib

    f_none, f_full = by.get(fsdp2("none").name), by.get(fsdp2("full").name)
    if f_none and f_full:
        budget = (f_none["peak_alloc_mib"] + f_full["peak_alloc_mib"]) / 2
        ours = [r for r in shape_rows if r["engine"] == "deepspeed" and fits(r, budget)]
        theirs = [r for r in shape_rows if r["engine"] == "fsdp2" and fits(r, budget)]
        if ours and theirs:
            a, b = max(ours, key=lambda r: r["images_per_sec"]), max(theirs, key=lambda r: r["images_per_sec"])
            ratio = a["images_per_sec"] / b["images_per_sec"]
            out.append(("Budget race: ours / best FSDP2 at a budget of %.0f MiB >= 1.15x" % budget,
                        ratio >= 1.15, f"{ratio:.3f}x: {a['config']} {a['images_per_sec']:.2f} img/s at "
                                       f"{a['peak_alloc_mib']:.0f} MiB vs {b['config']} {b['images_per_sec']:.2f} img/s "
                                       f"at {b['peak_alloc_mib']:.0f} MiB"))
    z3 = by.get("ZeRO-3 + none")
    if z3:
        fast = [r for r in shape_rows if r["engine"] == "deepspeed" and r["images_per_sec"] >= 0.9 * z3["images_per_sec"]]
        best = min(fast, key=lambda r: r["peak_alloc_mib"])
        ratio = best["peak_alloc_mib"] / z3["peak_alloc_mib"]
        out.append(("Memory: best-memory config at >= 0.9x ZeRO-3's images/s uses <= 0.7x its peak", ratio <= 0.7,
                    f"{best['config']}: {ratio:.3f}x the peak ({best['peak_alloc_mib']:.0f} vs "
                    f"{z3['peak_alloc_mib']:.0f} MiB) at {best['images_per_sec'] / z3['images_per_sec']:.3f}x the images/s"))
    z3f = by.get("ZeRO-3 + full")
    if z3f and f_full:
        out.append(("Floor: ZeRO-3 + full peak <= FSDP2 + HF full AC peak",
                    z3f["peak_alloc_mib"] <= f_full["peak_alloc_mib"],
                    f"{z3f['peak_alloc_mib']:.0f} vs {f_full['peak_alloc_mib']:.0f} MiB (setup peaks "
                    f"{z3f['setup_peak_mib']:.0f} vs {f_full['setup_peak_mib']:.0f} MiB)"))
    for shape in suite.shapes:  # `selective` is held to its target on every shape
        of_shape = {r["config"]: r for r in rows if r["shape"] == shape.label and "images_per_sec" in r}
        for stage in (1, 2, 3):
            none, sel = of_shape.get(f"ZeRO-{stage} + none"), of_shape.get(f"ZeRO-{stage} + selective")
            if none and sel and none["activation_mib"]:
                cut = 1 - sel["activation_mib"] / none["activation_mib"]
                slower = none["images_per_sec"] / sel["images_per_sec"] - 1
                out.append((f"Selective, {shape.label.split(',')[0]}, ZeRO-{stage}: activation memory -40% or more "
                            f"at <= 10% step time", cut >= 0.4 and slower <= 0.10,
                            f"activations {sel['activation_mib']:.0f} vs {none['activation_mib']:.0f} MiB "
                            f"({-cut:+.1%}), step time {slower:+.1%}"))
    for r in shape_rows:
        if not r["ac"].startswith("auto") or not r.get("budget_gib"):
            continue
        budget = r["budget_gib"] * 1024
        fixed = [x for x in shape_rows if x["engine"] == "deepspeed" and x["zero_stage"] == r["zero_stage"]
                 and not x["ac"].startswith("auto") and fits(x, budget)]
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
            "peak_source": "bf16 dense, data sheet" if torch.cuda.is_available() else "fp32 GEMM 2048^3, measured here",
            "gemm_samples": [round(g, 1) for g in gemm]}


def write_markdown(path: str, suite_name: str, suite: Suite, rows: list, targets: list, env: dict, minutes: float):
    with open(path, "w") as f:
        f.write(f"# `{suite_name}` suite\n\n![throughput against peak memory](pareto.png)\n\n")
        f.write(f"{env['date']} | commit {env.get('git_commit', 'not recorded')} | {env['gpu'] or env['cpu']}, "
                f"{env['cores']} cores | torch {env['torch']}, deepspeed "
                f"{env['deepspeed']}, transformers {env['transformers']} | {suite.ranks} ranks x "
                f"{env['threads_per_rank']} threads | MFU peak {env['peak_gflops_per_rank']} GFLOP/s per rank "
                f"({env['peak_source']}) | {suite.repeats} repeats in alternating order, {suite.timed_steps} timed steps "
                f"each after {suite.profiled_steps} profiled and {suite.warmup_steps} warm-up ones | {minutes:.0f} min\n\n")
        f.write("## Targets\n\n| target | met | measured |\n|---|---|---|\n")
        for name, ok, figures in targets:
            f.write(f"| {name} | {'yes' if ok else '**missed**'} | {figures} |\n")
        for shape in suite.shapes:
            f.write(f"\n## {shape.label}\n\n| configuration | images/s, median (min-max) | MFU | recompute | peak "
                    f"MiB/rank | planned peak (error) | setup peak | step peak | activations (+ whole weights) | "
                    f"max RSS | loss after {suite.profiled_steps + suite.timed_steps} steps (rel. diff) |\n"
                    "|---|---|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                if r["shape"] != shape.label:
                    continue
                if "images_per_sec" not in r:
                    f.write(f"| {r['config']} | failed ({r['jobs_failed']} jobs, see failed.log) ||||||||||\n")
                    continue
                budget = f" ({r['budget_gib'] * 1024:.0f} MiB)" if r["budget_gib"] else ""
                if r["jobs_failed"]:
                    budget += f" ({r['jobs_ok']} of {r['jobs_ok'] + r['jobs_failed']} jobs; see failed.log)"
                rec = f"{r['recompute_flops_frac']:+.0%}" if r["recompute_flops_frac"] != "" else ""
                f.write(f"| {r['config']}{budget} | {r['images_per_sec']:.2f} ({r['images_per_sec_min']:.2f}-"
                        f"{r['images_per_sec_max']:.2f}) | {r['mfu']:.1%} | {rec} | {r['peak_alloc_mib']:.0f} | "
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
    colors = {"fsdp2": "tab:gray", 1: "tab:green", 2: "tab:blue", 3: "tab:purple"}
    for ax, shape in zip(axes[0], shapes):
        rs = [r for r in rows if r["shape"] == shape.label and "images_per_sec" in r]
        for r in rs:
            c = colors["fsdp2" if r["engine"] == "fsdp2" else r["zero_stage"]]
            marker = "s" if r["engine"] == "fsdp2" else "o"
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
        f_full = next((r for r in rs if r["config"] == fsdp2("full").name), None)
        if f_none and f_full:
            ax.axvline((f_none["peak_alloc_mib"] + f_full["peak_alloc_mib"]) / 2, ls="--", color="tab:red", lw=0.8,
                       label="budget-race budget")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_xlabel("peak allocated per rank (MiB)")
        ax.set_ylabel(f"images/s ({suite.ranks} ranks), median, min-max")
        ax.set_title(shape.label, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("DeepSpeed ZeRO-1/2/3 (green/blue/purple) vs FSDP2 (grey squares): up and left is better",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# Reproduced "within noise", row by row (speed only as a ratio inside one invocation: docs/benchmarks.md). The
# noise is the larger of a floor and the spread (max - min over median) of the configuration's own jobs in
# either run, since some configurations' peaks vary from job to job by more than the floor.
SPEED_NOISE = 0.05  # images/s relative to the run's own FSDP2 no-AC median
PEAK_NOISE = 0.03  # peak allocated bytes


def compare(rows: list, reference: list) -> tuple:
    """Markdown lines comparing a rerun's rows with a reference run's, and the rows not reproduced.

    Speed is compared as each configuration's median images/s over its own run's FSDP2 no-AC median (the
    machine's speed drifts between invocations, the ratio does not); bytes and FLOPs, which do not depend on
    speed, directly. An `auto` row's budget comes from its own run's measured FSDP2 peaks, so when the two
    budgets differ its peak is compared relative to its budget (the row's claim is that it fits it).
    """
    def keyed(rs):
        return {(r["shape"], r["config"]): r for r in rs}

    def baselines(rs):
        return {r["shape"]: float(r["images_per_sec"]) for r in rs if r["config"] == "FSDP2 + no AC"}

    def spread(r, column):
        return (float(r[f"{column}_max"]) - float(r[f"{column}_min"])) / float(r[column])

    new, ref = keyed(rows), keyed(reference)
    base_new, base_ref = baselines(rows), baselines(reference)
    lines = ["| shape | config | images/s vs FSDP2 no-AC: reference -> rerun | change (noise) | peak MiB: reference "
             "-> rerun | change (noise) | recompute FLOPs | reproduced |", "|---|---|---|---|---|---|---|---|"]
    missed = []
    for key, r in new.items():
        old = ref.get(key)
        if old is None or not r.get("images_per_sec") or not old.get("images_per_sec"):
            missed.append(key)
            lines.append(f"| {key[0][:12]} | {key[1]} | missing in one run | | | | | **no** |")
            continue
        a = float(old["images_per_sec"]) / base_ref[key[0]]
        b = float(r["images_per_sec"]) / base_new[key[0]]
        speed_noise = max(SPEED_NOISE, spread(old, "images_per_sec"), spread(r, "images_per_sec"))
        peak_noise = max(PEAK_NOISE, spread(old, "peak_alloc_mib"), spread(r, "peak_alloc_mib"))
        pa, pb, what = float(old["peak_alloc_mib"]), float(r["peak_alloc_mib"]), ""
        if old.get("budget_gib") and r.get("budget_gib") and old["budget_gib"] != r["budget_gib"]:
            ga, gb = float(old["budget_gib"]) * 1024, float(r["budget_gib"]) * 1024
            what = f" (budgets {ga:.0f} -> {gb:.0f} MiB: peak/budget {pa / ga:.3f} -> {pb / gb:.3f})"
            pa, pb = pa / ga, pb / gb
        ok = abs(b / a - 1) <= speed_noise and abs(pb / pa - 1) <= peak_noise
        if not ok:
            missed.append(key)
        plan = f", plan {old['ac_plan']} -> {r['ac_plan']}" if r.get("ac_plan") != old.get("ac_plan") else ""
        same_flops = "same" if old["recompute_flops_frac"] == r["recompute_flops_frac"] else "differ"
        lines.append(f"| {key[0][:12]} | {key[1]}{plan} | {a:.3f} -> {b:.3f} | {b / a - 1:+.1%} ({speed_noise:.0%}) | "
                     f"{float(old['peak_alloc_mib']):.0f} -> {float(r['peak_alloc_mib']):.0f}{what} | "
                     f"{pb / pa - 1:+.1%} ({peak_noise:.0%}) | {same_flops} | {'yes' if ok else '**no**'} |")
    head = (f"{len(new) - len(missed)} of {len(new)} configurations reproduced: speed relative to the same run's "
            f"FSDP2 no-AC and peak memory each within its noise (in brackets: the larger of {SPEED_NOISE:.0%} "
            f"/ {PEAK_NOISE:.0%} and the spread of the configuration's jobs in either run).")
    return [head, ""] + lines, missed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--out", default="", help="output directory (default: benchmarks/results/<suite>)")
    parser.add_argument("--ranks", type=int, default=0, help="override the suite's ranks (a check, not a result)")
    parser.add_argument("--repeats", type=int, default=0, help="override the suite's repeats (a check, not a result)")
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
    if args.suite.startswith("gpu") and torch.cuda.device_count() < suite.ranks:
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
    jobs = [(shape, run) for shape in suite.shapes for run in runs_of(suite, shape)]
    results, measured, budgets = [], {}, {}
    bar = tqdm(total=len(jobs) * suite.repeats, desc=args.suite, dynamic_ncols=True)
    with open(os.path.join(out_dir, "runs.jsonl"), "w") as log:
        for repeat in range(suite.repeats):
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
    return report(out_dir, args.suite, suite, results, gemm, threads, (time.perf_counter() - started) / 60,
                  args.compare)


def report(out_dir: str, suite_name: str, suite: Suite, results: list, gemm: list, threads: int, minutes: float,
           compare_to: str = "", saved_env: dict = None) -> int:
    """Write results.csv/.md, environment.json and pareto.png; `saved_env`: the runs' own environment (a report
    rewritten later keeps the date, commit and versions of the runs)."""
    flops = {s.label: model_flops_per_image(s) for s in suite.shapes}
    env = {k: v for k, v in saved_env.items() if k not in ("suite", "minutes", "model_flops_per_image")} \
        if saved_env else environment(threads, gemm)
    rows = summarise(results, suite.shapes, suite, flops, env["peak_gflops_per_rank"])
    targets = check_targets(rows, suite)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out_dir, "environment.json"), "w") as f:
        json.dump(dict(env, suite=suite_name, minutes=round(minutes, 1),
                       model_flops_per_image={k: v for k, v in flops.items()}), f, indent=1)
    write_markdown(os.path.join(out_dir, "results.md"), suite_name, suite, rows, targets, env, minutes)
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
