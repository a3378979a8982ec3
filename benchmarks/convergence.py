"""Convergence: the digits job (`configs/digits-vit.yaml`, 900 steps) trained to the end under DeepSpeed ZeRO-2 +
`none`, ZeRO-3 + `selective`, FSDP2, and FSDP2 with each image's tokens split over the two ranks (`sp_size 2`: one
data-parallel rank of 64 images, the same global batch), with 3 seeds each, through the same data path.

    .venv/bin/python -m benchmarks.convergence              # ~40 min on 2 cores
    .venv/bin/python -m benchmarks.convergence --report_only

Every run is `train.py` itself under torchrun, the FSDP2 ones with `--engine fsdp2` (the recipe's `zero_stage` 2:
FSDP2 without resharding after the forward, ZeRO-2's analogue). Writes benchmarks/results/convergence/:
runs.jsonl (each run's per-step losses and accuracy), results.md (val top-1 mean and standard deviation per
engine) and curves.png (the loss curves).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time

from launch.job import run as launch_train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "configs/digits-vit.yaml"
# (label, engine, train.py overrides)
RUNS = [("DeepSpeed ZeRO-2 + none", "deepspeed", ["--zero_stage", "2", "--ac", "none"]),
        ("DeepSpeed ZeRO-3 + selective", "deepspeed", ["--zero_stage", "3", "--ac", "selective"]),
        ("FSDP2 + none", "fsdp2", ["--engine", "fsdp2", "--zero_stage", "2", "--ac", "none"]),
        ("FSDP2 + none, sp_size 2", "fsdp2", ["--engine", "fsdp2", "--zero_stage", "2", "--ac", "none", "--sp_size",
                                              "2", "--micro_batch_size", "64"])]
SEEDS = (0, 1, 2)
SMOOTH = 25  # steps in the plot's moving average


def run_one(label: str, engine: str, overrides: list, seed: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{engine}-{len(os.listdir(tmp))}")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)), DS_ACCELERATOR="cpu",
               PYTHONWARNINGS="ignore")
    done = launch_train(overrides, nproc=2, env=env, config=RECIPE, seed=seed, output_dir=out, progress=False)
    wall = done.seconds
    if not done.ok:
        raise RuntimeError(f"{label}, seed {seed} failed:\n{done.output[-3000:]}")
    losses, summary = [r["loss"] for r in done.metrics], done.summary
    return {"config": label, "engine": engine, "seed": seed, "val_top1": summary["val_top1"],
            "val_top5": summary["val_top5"], "images_per_sec": summary["images_per_sec"], "wall_seconds": wall,
            "losses": losses}


def report(out_dir: str, runs: list, env: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["config"] for r in runs))
    lines = ["# Convergence: the digits job to the end, per engine\n",
             f"{env['date']} | commit {env['git_commit']} | {env['cpu']} | 2 ranks x {env['threads']} threads, fp32 | "
             f"`{RECIPE}` ({len(runs[0]['losses'])} steps), seeds {', '.join(map(str, SEEDS))} | "
             f"{env['minutes']:.0f} min\n",
             "| configuration | val top-1, mean ± std | per seed | final loss (mean of the last 50 steps) | "
             "images/s (median) |", "|---|---|---|---|---|"]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = ["tab:blue", "tab:purple", "tab:gray", "tab:orange"]
    for label, color in zip(labels, colors):
        rs = [r for r in runs if r["config"] == label]
        top1 = [r["val_top1"] for r in rs]
        final = [statistics.fmean(r["losses"][-50:]) for r in rs]
        lines.append(f"| {label} | {statistics.fmean(top1):.2%} ± {statistics.stdev(top1) if len(top1) > 1 else 0:.2%} "
                     f"| {', '.join(f'{t:.2%}' for t in top1)} | {statistics.fmean(final):.4f} ± "
                     f"{statistics.stdev(final) if len(final) > 1 else 0:.4f} | "
                     f"{statistics.median(r['images_per_sec'] for r in rs):.0f} |")
        for i, r in enumerate(rs):
            smooth = [statistics.fmean(r["losses"][max(0, k - SMOOTH + 1):k + 1]) for k in range(len(r["losses"]))]
            ax.plot(range(1, len(smooth) + 1), smooth, color=color, lw=0.9, alpha=0.8, label=label if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({SMOOTH}-step moving average)")
    ax.set_title(f"digits, {len(SEEDS)} seeds per configuration: DeepSpeed, FSDP2 and FSDP2 with the tokens split, "
                 f"through the same data path", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=130)
    plt.close(fig)
    lines.append("\n![loss curves](curves.png)\n")
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "convergence"))
    parser.add_argument("--report_only", action="store_true", help="rewrite results.md and curves.png from runs.jsonl")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        with open(os.path.join(args.out, "runs.jsonl")) as f:
            runs = [json.loads(line) for line in f]
        with open(os.path.join(args.out, "environment.json")) as f:
            return report(args.out, runs, json.load(f))
    from tqdm import tqdm

    started, runs = time.perf_counter(), []
    jobs = [(seed, run) for seed in SEEDS for run in RUNS]  # engines alternate within each seed
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(args.out, "runs.jsonl"), "w") as log:
        for seed, (label, engine, overrides) in tqdm(jobs, desc="convergence"):
            r = run_one(label, engine, overrides, seed, tmp)
            runs.append(r)
            log.write(json.dumps(r) + "\n")
            log.flush()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    env = {"date": datetime.date.today().isoformat(), "git_commit": commit.strip(), "cpu": cpu,
           "threads": max(1, (os.cpu_count() or 2) // 2), "minutes": (time.perf_counter() - started) / 60}
    with open(os.path.join(args.out, "environment.json"), "w") as f:
        json.dump(env, f, indent=1)
    report(args.out, runs, env)


if __name__ == "__main__":
    main()
