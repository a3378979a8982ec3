"""The planner's peak memory for the pretraining and segmentation tasks against the peak measured in a training
step, on shapes no other suite runs.

    .venv/bin/python -m benchmarks.task_memory                    # ~15 min on 2 cores: the committed results
    .venv/bin/python -m benchmarks.task_memory --quick --out /tmp/tm   # tiny models, a check of the harness
    .venv/bin/python -m benchmarks.task_memory --report_only      # the planner's predictions again, nothing run

Each configuration is one 2-rank job of bench_worker.py (train.py's own build, wrapping and task loss; fp32 on
CPU): its peak is the largest allocation of either rank over the profiled steps, read from the profiler's memory
events, weights, gradients, optimizer states and activations included. The prediction is `estimate()`'s
`peak_bytes` for the same run config and the DeepSpeed config the job ran with (plan.py's figure). Memory is a
property of the configuration, not a timing: one job per configuration. Writes results.json (each job's
measurements and DeepSpeed config), results.md and environment.json under benchmarks/results/task-memory/;
`--report_only` predicts the stored jobs again with the planner as it is now.
"""
import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

from tqdm import tqdm

MiB = 2**20
TOLERANCE = 0.10  # what the planner's peak is held to


@dataclass
class Case:
    """One configuration: its fields are bench_worker.Spec's of the same names."""
    task: str
    model: str
    image_size: int
    patch_size: int
    micro_batch_size: int
    zero: int
    ac: str
    mask_patch_size: int = 32
    num_labels: int = 10

    @property
    def label(self) -> str:
        return f"{self.task} {self.model} {self.image_size}px/{self.patch_size or 'default'} x{self.micro_batch_size}"


def cases(quick: bool) -> list:
    """MAE ViT-S/8 at 96x96 (144 patches, 36 kept) under ZeRO 1-3 and three policies; SimMIM on ViT-S/8 and a
    Swin; UperNet over the digits Swin and SegFormer-B0 at 128x128."""
    if quick:
        return [Case("mae", "vit-debug", 16, 0, 4, 3, "none", 16), Case("segmentation", "swin-digits", 32, 0, 2, 3,
                                                                        "full")]
    out = [Case("mae", "vit-small", 96, 8, 16, zero, ac) for zero in (1, 2, 3) for ac in ("none", "selective",
                                                                                          "full")]
    out += [Case("simmim", "vit-small", 96, 8, 16, 3, ac) for ac in ("none", "full")]
    out += [Case("simmim", "swin-tiny-w4", 128, 4, 8, 3, ac) for ac in ("none", "full")]
    out += [Case("segmentation", "swin-digits", 128, 0, 8, zero, ac) for zero in (1, 3) for ac in ("none", "full")]
    out += [Case("segmentation", "segformer-b0", 128, 0, 8, 3, ac) for ac in ("none", "full")]
    return out


def predicted(case: Case, ds_config: dict, world_size: int) -> dict:
    """plan.py's memory figures for the case's run config (the bench job's) with the DeepSpeed config it ran."""
    from benchmarks.bench_worker import Spec, run_config
    from planner.devices import Device
    from planner.estimate import estimate

    spec = Spec(**asdict(case))
    device = Device("cpu", 1e11, 1e6, 10, 10, 0.0, mem_gbs=10)  # memory only: its rates do not matter
    est = estimate(run_config(spec), ds_config, "fp32", world_size, world_size, device)
    return {"peak": est["peak_bytes"], "activations": est["memory"]["activations"], "params": est["params"],
            "plan": est["plan"]}


def measure(case: Case, threads: int) -> dict:
    from benchmarks.train_bench import run_worker

    spec = dict(asdict(case), profiled_steps=2, warmup_steps=0, timed_steps=1, count_flops=False)
    result, tail = run_worker(spec, 2, threads, 900)
    if tail:
        sys.exit(f"error: {case.label} ZeRO-{case.zero} {case.ac} failed:\n{tail}")
    return result


def table(rows: list) -> str:
    lines = ["| task, model, image, micro-batch per rank | ZeRO | ac | parameters | peak MiB predicted | measured | "
             "error | activations MiB predicted | measured (forward's) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['zero']} | {r['ac']} | {r['params'] / 1e6:.1f}M | "
                     f"{r['peak_predicted'] / MiB:.1f} | {r['peak_measured'] / MiB:.1f} | {r['error']:+.1%} | "
                     f"{r['activations_predicted'] / MiB:.1f} | {r['activations_measured'] / MiB:.1f} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    return "\n".join(lines) + (f"\n\n{within} of {len(rows)} within {TOLERANCE:.0%}; the largest error "
                               f"{worst['error']:+.1%} ({worst['label']}, ZeRO-{worst['zero']} {worst['ac']}).")


def predict(rows: list) -> list:
    """Each measured job's row with plan.py's prediction for it (from its case and the DeepSpeed config it ran)."""
    out = []
    for row in rows:
        case = Case(**{k: row[k] for k in Case.__dataclass_fields__})
        plan = predicted(case, row["ds_config"], row["world_size"])
        out.append({**row, "params": plan["params"], "plan": plan["plan"], "peak_predicted": plan["peak"],
                    "error": plan["peak"] / row["peak_measured"] - 1 if row["peak_measured"] > 0 else math.nan,
                    "activations_predicted": plan["activations"]})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="", help="output directory (default: benchmarks/results/task-memory)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models: checks the harness, not the planner (exit 0 whatever the errors)")
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--report_only", action="store_true",
                        help="predict the jobs of the out directory's results.json again and rewrite results.md")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from benchmarks.measure import REPO, environment, gemm_gflops

    out = args.out or os.path.join(REPO, "benchmarks", "results", "task-memory")
    os.makedirs(out, exist_ok=True)
    if args.report_only:
        with open(os.path.join(out, "results.json")) as f:
            rows = predict(json.load(f))
        with open(os.path.join(out, "environment.json")) as f:
            env = json.load(f)
    else:
        rows = []
        for case in tqdm(cases(args.quick), desc="task memory", dynamic_ncols=True):
            result = measure(case, args.threads)
            rows += predict([{**asdict(case), "label": case.label, "peak_measured": max(result["peak_alloc_bytes"]),
                              "activations_measured": max(result["activation_bytes"]),
                              "losses": result["losses"], "world_size": result["world_size"],
                              "ds_config": result["ds_config"]}])
        env = environment(args.threads, gemm_gflops(args.threads))
        with open(os.path.join(out, "environment.json"), "w") as f:
            json.dump(env, f, indent=1)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"# The planner's peak memory per task against a measured step\n\n`python -m benchmarks.task_memory`"
                f" | {env['date']} | commit {env['git_commit']} | {env['cpu']}, 2 ranks x {args.threads} thread | "
                f"torch {env['torch']}, deepspeed {env['deepspeed']}, transformers {env['transformers']} | fp32\n\n"
                f"Measured: the larger rank's peak allocation over two training steps (the profiler's memory "
                f"events). Predicted: plan.py's peak for the same configuration and the DeepSpeed config the job ran"
                f"{' (predicted again with `--report_only`)' if args.report_only else ''}. Activations: the planned "
                f"peak, and what the measured forward left allocated for the backward.\n\n{table(rows)}\n")
    print(table(rows))
    # every job measured and predicted (--quick checks only that: tiny models are not what the planner is held to)
    if not rows or not all(r.get("peak_measured", 0) > 0 and r.get("peak_predicted", 0) > 0 for r in rows):
        return 1
    return 0 if args.quick or all(abs(r["error"]) <= TOLERANCE for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
