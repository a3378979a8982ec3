"""What a suite measures besides its jobs: the machine's GEMM rate and memory bandwidth, the planner's calibration
of each shape, the model's FLOPs, and the environment recorded beside the results."""
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

import torch

from benchmarks.suites import Shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """GB/s of an elementwise add over 64 MiB fp32 tensors with the ranks' thread count (planner/replay.py)."""
    from planner.replay import stream_gbs

    torch.set_num_threads(threads)
    return [stream_gbs(torch.device("cpu"), reps=1) for _ in range(reps)]


def calibrate(model: str, image_size: int, patch_size: int, micro_batch_size: int, num_labels: int, ranks: int,
              threads: int, precision: str = "fp32", timeout_s: int = 600, host: bool = True) -> dict:
    """`plan.py --calibrate` of one shape under torchrun with the suite's ranks and threads: the planner's
    figures for it, measured with every rank running as in a suite's job (planner/calibration.py); `host`: with
    the host probe (planner/host.py)."""
    from launch.job import command

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calibration.json")
        cmd = command("torchrun", ranks, script=os.path.join(REPO, "plan.py")) + [
            "--calibrate", out, "--model", model, "--image_size", str(image_size), "--patch_size", str(patch_size),
            "--micro_batch_size", str(micro_batch_size), "--num_labels", str(num_labels), "--precision", precision,
            *([] if host else ["--no_host_probe"])]
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
    from loop.timing import clock

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


def steady_images_per_sec(records: list, first: int) -> float | None:
    """train.py's images/s over its steps from `first` on, from its metrics.jsonl records: each step record
    carries its logging interval's images/s, the interval ending at the record's step and starting after the
    previous one's; an interval that starts before `first` is left out."""
    steps = [r for r in records if "images_per_sec" in r]
    spans = [(r["step"] - (prev["step"] if prev else 0), r) for prev, r in zip([None, *steps[:-1]], steps)]
    steady = [(n, r["images_per_sec"]) for n, r in spans if r["step"] - n + 1 >= first]
    # each step is one global batch B: an interval of n steps took n * B / (its images/s) seconds
    return sum(n for n, _ in steady) / sum(n / ips for n, ips in steady) if steady else None


def model_flops_per_image(shape: Shape) -> float:
    """Forward + backward FLOPs of the model as defined (no recompute), counted by torch."""
    import compat
    from models import build_model

    model, _ = build_model(shape.model, 10, shape.image_size, shape.patch_size)
    images = torch.randn(2, 3, shape.image_size, shape.image_size)
    with compat.flop_counter() as counter:
        model(images).logits.sum().backward()
    return counter.get_total_flops() / 2


def cpu_name() -> str:
    """This machine's CPU model, as /proc/cpuinfo names it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def environment(threads: int, gemm: list) -> dict:
    import deepspeed
    import transformers

    cpu = cpu_name()
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
            # what the planner charges memory-bound operators at on CPU (planner/estimate.py)
            "mem_gbs_per_rank": None if torch.cuda.is_available() else round(statistics.median(memory_gbs(threads)), 1),
            "peak_source": "bf16 GEMM 8192^3, measured here" if torch.cuda.is_available() else
            "fp32 GEMM 2048^3, measured here",
            "datasheet_gflops_per_rank": datasheet_gflops() if torch.cuda.is_available() else None,
            "gemm_samples": [round(g, 1) for g in gemm]}
