"""DeepSpeed's knobs, each measured: variants of the DeepSpeed config this project writes, each against the config
as shipped, on one shape and ZeRO stage at a time, in one invocation, in alternating order, with paired ratios
and 95% bootstrap intervals (the method of docs/benchmarks.md).

    .venv/bin/python -m benchmarks.ds_tuning                  # ViT-S/8 (the cpu suite's shape), ZeRO-2 and 3: ~35 min
    .venv/bin/python -m benchmarks.ds_tuning --shape host     # the host suite's narrow ViT, where a step is host work

A variant is a set of values written into the stage's template (ds_configs/zero<N>.json) before train.py's
config fills its "auto" fields, so an explicit value replaces what this project would choose. Writes
benchmarks/results/ds-tuning/: runs.jsonl (every job) and report.md.
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from benchmarks.measure import REPO, environment, gemm_gflops
from benchmarks.report import fmt_ratio, peak_of, peak_ratio, speed_ratio
from benchmarks.suites import SUITES, VIT_S, MiB
from benchmarks.train_bench import run_worker
from engine.ds_config import BLOCK_PARAMS_PER_HIDDEN_SQ, DS_CONFIG_DIR
from models.registry import model_config

SHIPPED = "as shipped"
SHAPES = {"vit-s": (VIT_S, 2, 1, 3), "host": (SUITES["host"].shapes[0], 2, 5, 30)}  # shape, profiled, warm-up, timed


def variants(stage: int, hidden: int) -> dict:
    """{name: {dotted key: value}} for a stage; the values that depend on the model are sized from its hidden
    size (a transformer block holds ~12 h^2 parameters)."""
    block = BLOCK_PARAMS_PER_HIDDEN_SQ * hidden * hidden
    common = {"AdamW fused (torch's GPU default)": {"optimizer.params.fused": True}}
    if stage == 3:
        return {**common,
                "sub_group_size: DeepSpeed's 1e9": {"zero_optimization.sub_group_size": 10**9},
                "buckets of one block": {"zero_optimization.reduce_bucket_size": block,
                                         "zero_optimization.stage3_prefetch_bucket_size": block},
                "live parameters: 4 blocks": {"zero_optimization.stage3_max_live_parameters": 4 * block},
                "overlap_comm on": {"zero_optimization.overlap_comm": True},
                # small tensors (biases, norms) are gathered with their block instead of kept whole; whole ones
                # are all-gathered again after every optimizer step, one collective per tensor
                "no persistent parameters": {"zero_optimization.stage3_param_persistence_threshold": 0}}
    return {**common,
            "overlap_comm on": {"zero_optimization.overlap_comm": True},
            "buckets of one block": {"zero_optimization.reduce_bucket_size": block,
                                     "zero_optimization.allgather_bucket_size": block}}


def template(stage: int, values: dict, folder: str, index: int) -> str:
    """The stage's template with `values` set, written to `folder`; its path."""
    with open(os.path.join(DS_CONFIG_DIR, f"zero{stage}.json")) as f:
        ds = json.load(f)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = ds
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    out = os.path.join(folder, f"zero{stage}-{index}.json")
    with open(out, "w") as f:
        json.dump(ds, f, indent=1)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vit-s")
    parser.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--ac", default="none", help="the checkpointing policy every job runs")
    parser.add_argument("--variants", default="", help="only these variants (names, comma-separated)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default="", help="default: benchmarks/results/ds-tuning-<shape>")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        raise SystemExit("error: ds_tuning measures on CPU ranks (fp32); on GPUs run the gpu suite")
    args.out = args.out or os.path.join(REPO, "benchmarks", "results", f"ds-tuning-{args.shape}")
    os.makedirs(args.out, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    shape, profiled, warmup, timed = SHAPES[args.shape]
    hidden = model_config(shape.model, 10, shape.image_size, shape.patch_size).hidden_size
    stages = [int(s) for s in args.stages.split(",")]
    from tqdm import tqdm

    started, results = time.perf_counter(), []
    gemm = gemm_gflops(threads)
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(args.out, "runs.jsonl"), "w") as log:
        chosen = set(args.variants.split(",")) if args.variants else None
        jobs = [(stage, name, template(stage, values, tmp, i) if values else "")
                for stage in stages for i, (name, values) in enumerate({SHIPPED: {}, **variants(stage, hidden)}.items())
                if chosen is None or name in chosen or name == SHIPPED]
        bar = tqdm(total=len(jobs) * args.repeats, desc="ds_tuning", dynamic_ncols=True)
        for repeat in range(args.repeats):
            for stage, name, path in (jobs if repeat % 2 == 0 else jobs[::-1]):
                spec = dict(engine="deepspeed", model=shape.model, image_size=shape.image_size,
                            patch_size=shape.patch_size, micro_batch_size=shape.micro_batch_size, zero=stage,
                            ac=args.ac, profiled_steps=profiled, warmup_steps=warmup, timed_steps=timed,
                            count_flops=False, ds_config=path)
                result, tail = run_worker(spec, args.ranks, threads, 600)
                # shape and run: the keys report.py pairs the repeats of two configurations by
                result.update(shape=shape.label, run=f"ZeRO-{stage} {name}", stage=stage, variant=name, repeat=repeat)
                results.append(result)
                log.write(json.dumps(result) + "\n")
                log.flush()
                bar.set_postfix_str(f"ZeRO-{stage} {name}: " + (
                    f"{result['images_per_sec']:.1f} img/s, {peak_of(result) / MiB:.0f} MiB" if not tail else "FAILED"))
                bar.update()
            gemm += gemm_gflops(threads)
        bar.close()
    env = environment(threads, gemm)
    lines = [f"# DeepSpeed's knobs on {shape.label}, `ac {args.ac}`, {args.ranks} CPU ranks, fp32",
             "", f"{env['date']}, {env['cpu']}, commit {env['git_commit']}, {args.repeats} repeats in "
             f"alternating order, {(time.perf_counter() - started) / 60:.0f} min. Each variant against the "
             f"config as shipped: paired ratios (geometric mean of the per-repeat ratios) with 95% bootstrap "
             f"intervals; above 1 the variant is faster (images/s) or larger (peak).", "",
             "| ZeRO | variant | images/s (median) | images/s vs shipped | peak MiB (median) | peak vs shipped | failed |",
             "|---|---|---|---|---|---|---|"]
    for stage, name, _ in jobs:
        ok = [r for r in results if r["stage"] == stage and r["variant"] == name and "error" not in r]
        run, shipped = f"ZeRO-{stage} {name}", f"ZeRO-{stage} {SHIPPED}"
        speed = speed_ratio(results, shape.label, run, shipped)
        peak = peak_ratio(results, shape.label, run, shipped)
        lines.append(f"| {stage} | {name} | {statistics.median(r['images_per_sec'] for r in ok):.1f} | "
                     f"{'' if name == SHIPPED else fmt_ratio(speed)} | "
                     f"{statistics.median(peak_of(r) for r in ok) / MiB:.1f} | "
                     f"{'' if name == SHIPPED else fmt_ratio(peak)} | {args.repeats - len(ok)} |" if ok
                     else f"| {stage} | {name} | | | | | {args.repeats} |")
    lines += ["", "The variants' values: " + "; ".join(
        f"ZeRO-{s}: {n}: {json.dumps(v)}" for s in stages for n, v in variants(s, hidden).items()
        if any(j[:2] == (s, n) for j in jobs))]
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
