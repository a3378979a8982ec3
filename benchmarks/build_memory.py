"""Host memory of building and wrapping a large model under ZeRO-3, with and without partitioned construction.

    .venv/bin/python -m benchmarks.build_memory                    # vit-huge (632M), 2 ranks, 2 repeats
    .venv/bin/python -m benchmarks.build_memory --model vit-base --out /tmp/bm   # quick

Each mode is its own 2-rank torchrun job, in alternating order, `--repeats` times. A job builds the model the way
train.py does (partitioned: inside deepspeed.zero.Init, `build_training_model`; whole: every rank builds all of it,
as plain `build_model`), then wraps it with `build_engine` (ZeRO-3, no checkpointing), reading each rank's peak
resident set (VmHWM) after the imports, after the build and after the wrap. Writes results.json, results.md and
environment.json under benchmarks/results/build-memory/.

The jobs run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_): by default it grows after large frees,
after which freed blocks stay in the process's heap and the resident set keeps memory nothing uses
(benchmarks/results/build-memory/report.md). Fixed, large blocks are mapped and unmapped, and the resident set
follows what is allocated.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # glibc's default start, kept fixed (see above)


def vm(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS: resident now, VmHWM: the peak so far)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def worker(args):
    import torch
    import torch.distributed as dist

    from config import Config
    from loop.distributed import exit_distributed, init_distributed
    from engine.build import build_engine, build_training_model, engine_config
    from models import build_model, model_config

    device = init_distributed(int(os.environ.get("LOCAL_RANK", 0)))
    cfg = Config(model=args.model, num_labels=1000, image_size=224, zero_stage=3, micro_batch_size=2)
    world = dist.get_world_size()
    _, ds_config = engine_config(cfg, model_config(cfg.model, 1000, 224).hidden_size, world)
    figures = [vm("VmHWM")]
    if args.partitioned:
        model, _ = build_training_model(cfg, ds_config)
    else:
        model, _ = build_model(cfg.model, 1000, 224, seed=cfg.seed)
    dist.barrier()
    figures.append(vm("VmHWM"))
    build_engine(model, cfg, world, device.type, log=lambda *a: None)
    dist.barrier()
    figures += [vm("VmHWM"), vm("VmRSS")]
    gathered = [torch.zeros(4, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(figures, dtype=torch.float64))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump([[int(v) for v in g] for g in gathered], f)
    exit_distributed(0)


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, check=True)
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit-huge")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "build-memory"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--partitioned", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import transformers

    from launch.job import command

    os.makedirs(args.out, exist_ok=True)
    jobs = []
    for repeat in range(args.repeats):
        for partitioned in ((1, 0) if repeat % 2 == 0 else (0, 1)):  # alternating order
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "r.json")
                cmd = command("torchrun", 2, script=["-m", "benchmarks.build_memory"]) + [
                    "--worker", "--model", args.model, "--partitioned", str(partitioned), "--out", out]
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **MALLOC_ENV)
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    sys.exit(f"error: job failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
                ranks = json.load(open(out))
            jobs.append({"partitioned": bool(partitioned), "repeat": repeat, "ranks": [
                {"after_imports_hwm": r[0], "after_build_hwm": r[1], "after_wrap_hwm": r[2], "after_wrap_rss": r[3]}
                for r in ranks]})
            print(f"repeat {repeat}, {'partitioned' if partitioned else 'whole'}: peak RSS per rank "
                  + ", ".join(f"{r[2] / MiB:.0f} MiB" for r in ranks), flush=True)
    env = {"date": datetime.date.today().isoformat(), "git_commit": git_commit(), "model": args.model,
           "cores": os.cpu_count(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
           "transformers": transformers.__version__}
    with open("/proc/cpuinfo") as f:
        env["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(jobs, f, indent=1)
    with open(os.path.join(args.out, "environment.json"), "w") as f:
        json.dump(env, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"# Host memory of building and wrapping `{args.model}` under ZeRO-3, 2 ranks\n\n"
                f"{env['date']} | commit {env['git_commit']} | {env['cpu']}, {env['cores']} cores | torch "
                f"{env['torch']}, deepspeed {env['deepspeed']}, transformers {env['transformers']}\n\n"
                "Peak resident set (VmHWM) per rank, MiB, the larger rank of each job; every job listed.\n\n"
                "| construction | repeat | after imports | after build | after wrap (the peak) | resident after wrap |\n"
                "|---|---|---|---|---|---|\n")
        for j in jobs:
            top = {k: max(r[k] for r in j["ranks"]) / MiB for k in j["ranks"][0]}
            f.write(f"| {'partitioned (zero.Init)' if j['partitioned'] else 'whole, then partitioned'} | "
                    f"{j['repeat']} | {top['after_imports_hwm']:.0f} | {top['after_build_hwm']:.0f} | "
                    f"{top['after_wrap_hwm']:.0f} | {top['after_wrap_rss']:.0f} |\n")
    print(open(os.path.join(args.out, "results.md")).read())


if __name__ == "__main__":
    main()
