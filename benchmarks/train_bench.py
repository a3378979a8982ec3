"""Throughput and peak memory: DeepSpeed ZeRO 1-3 with this project's activation checkpointing, against
plain PyTorch FSDP2 with Hugging Face's own checkpointing. One command per suite:

    .venv/bin/python -m benchmarks.train_bench --suite cpu-smoke   # ~80 s: checks the harness (a test runs it)
    .venv/bin/python -m benchmarks.train_bench --suite cpu         # ~60 min on 2 cores: the committed results
    .venv/bin/python -m benchmarks.train_bench --suite gpu         # one 8-GPU node, bf16 (not run here)
    .venv/bin/python -m benchmarks.train_bench --suite gpu-check   # one GPU, ViT-L, one repeat (gpu_check.sh)
    .venv/bin/python -m benchmarks.train_bench --suite cpu --out /tmp/rerun --compare benchmarks/results/cpu
                                                                   # a rerun, checked against the committed one

Every configuration is its own distributed job (`bench_worker.py` under torchrun); all configurations of a
suite run in one invocation, in alternating order (forward, then reversed, ...), `repeats` times. Writes
benchmarks/results/<suite>/: runs.jsonl (every job), results.csv (median, min, max per configuration),
results.md (tables and the targets, met or missed) and pareto.png (images/s against peak memory).
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.measure import (CPU_ALLOCATOR_ENV, REPO, calibrate, environment, gemm_gflops, gpu_peak_gflops,
                                model_flops_per_image, steady_images_per_sec)
from benchmarks.report import check_targets, compare, peak_of, plot, summarise, write_markdown
from benchmarks.race import BESIDE, TRAINER, finalists, plot_race, race_markdown, race_targets, trainer_jobs
from benchmarks.suites import SUITES, MiB, Run, Shape, Suite, fsdp2, micro_and_accum, runs_of
from benchmarks.validate import write_validation
from launch.job import run as launch_train
from planner.calibration import median_calibration


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
    micro, accum = micro_and_accum(suite, shape, run)
    spec = dict(engine=run.engine, model=shape.model, image_size=shape.image_size, patch_size=shape.patch_size,
                micro_batch_size=micro, grad_accum_steps=accum, zero=run.zero or 3, ac=ac, reshard=run.reshard,
                profiled_steps=suite.profiled_steps, warmup_steps=suite.warmup_steps, timed_steps=suite.timed_steps,
                count_flops=repeat == 0, compile=run.compile)
    result, tail = run_worker(spec, suite.ranks, threads, suite.timeout_s)
    result.update(shape=shape.label, run=run.name, engine=run.engine, zero=run.zero, reshard=run.reshard,
                  ac=run.ac, compile=run.compile, budget_gib=budget_gib, repeat=repeat)
    if tail:
        with open(os.path.join(log_dir, "failed.log"), "a") as f:
            f.write(f"=== {shape.label} | {run.name} | repeat {repeat}\n{tail}\n")
    return result


def run_worker(spec: dict, ranks: int, threads: int, timeout_s: int) -> tuple[dict, str]:
    """One benchmark job: bench_worker.py on `ranks` ranks under torchrun. (result, "") or ({"error": tail}, tail),
    the result with the job's wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1",
                   **CPU_ALLOCATOR_ENV)
        done = launch_train(["--spec", json.dumps(spec), "--out", out], script=["-m", "benchmarks.bench_worker"],
                            nproc=ranks, env=env, timeout=timeout_s)
        failed, tail = done.returncode != 0 or not os.path.exists(out), done.output[-3000:]
        result = {"error": tail} if failed else json.load(open(out))
    result["job_seconds"] = done.seconds
    return result, tail if failed else ""


def run_trainer_job(suite: Suite, shape: Shape, run: Run, threads: int) -> tuple[dict, str]:
    """One configuration through train.py itself under torchrun, as the worker runs it: synthetic data (no shards
    read), the same micro-batch and accumulation; its images/s over the suite's timed steps (from metrics.jsonl),
    its profiled step's peak above what that step started with, and the loss it ended at."""
    micro, accum = micro_and_accum(suite, shape, run)
    # train.py's first step is its warm-up and its second its profiled one (CPU); then the suite's untimed steps,
    # read from the device once at their end, then the timed ones, read at the end
    steps, first = 2 + suite.warmup_steps + suite.timed_steps, 3 + suite.warmup_steps
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1",
               **CPU_ALLOCATOR_ENV)
    done = launch_train(nproc=suite.ranks, env=env, timeout=suite.timeout_s, model=shape.model, num_labels=10,
                        image_size=shape.image_size, patch_size=shape.patch_size, engine=run.engine,
                        zero_stage=run.zero_stage, ac=run.ac, compile=run.compile, micro_batch_size=micro,
                        grad_accum_steps=accum, data_mode="synthetic", max_steps=steps, warmup_steps=20,
                        log_every=first - 1, eval_every=0, save_every=0, progress=False)
    records = done.metrics
    if done.returncode != 0 or not records:
        tail = done.output[-3000:]
        return {"error": tail, "job_seconds": done.seconds}, tail
    steps_of = [r for r in records if "images_per_sec" in r]
    peaks = [r["mem/step_peak_alloc_bytes"] for r in records if "mem/step_peak_alloc_bytes" in r]
    return {"images_per_sec": steady_images_per_sec(steps_of, first),
            "step_peak_bytes": peaks, "loss": steps_of[-1]["loss"], "micro_batch_size": micro, "grad_accum_steps": accum,
            "job_seconds": done.seconds}, ""


def run_trainer_phase(suite: Suite, results: list, threads: int, out_dir: str, log, bar) -> None:
    """The race's last phase (benchmarks/race.py): each winner of the confirmation repeats through train.py or
    the worker again, in alternating order, `suite.repeats` times; appended to `results` and the log."""
    flops = {s.label: model_flops_per_image(s) for s in suite.shapes}
    rows = summarise(results, suite.shapes, suite, flops, 1.0)
    jobs = trainer_jobs(suite, rows, results)
    shapes = {s.label: s for s in suite.shapes}
    runs = {(s.label, run.name): run for s in suite.shapes for run in runs_of(suite, s)}
    bar.total = bar.n + len(jobs) * suite.repeats
    for repeat in range(1, suite.repeats + 1):
        for label, name, side in (jobs if repeat % 2 else jobs[::-1]):
            shape, run = shapes[label], runs[(label, name)]
            bar.set_postfix_str(f"{name} through {side}")
            if side == "train.py":
                r, tail = run_trainer_job(suite, shape, run, threads)
            else:
                r = run_job(suite, shape, run, None, repeat, threads, out_dir)
                tail = ""
            r.update(shape=label, run=name + (TRAINER if side == "train.py" else BESIDE), config=name, side=side,
                     phase="train.py", repeat=repeat)
            if tail:
                with open(os.path.join(out_dir, "failed.log"), "a") as f:
                    f.write(f"=== {label} | {name} through train.py | repeat {repeat}\n{tail}\n")
            results.append(r)
            log.write(json.dumps(r) + "\n")
            log.flush()
            bar.update()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--out", default="", help="output directory (default: benchmarks/results/<suite>)")
    parser.add_argument("--ranks", type=int, default=0, help="override the suite's ranks (a check, not a result)")
    parser.add_argument("--repeats", type=int, default=0, help="override the suite's repeats (a check, not a result)")
    parser.add_argument("--shapes", default="",
                        help="comma-separated models of the suite's shapes to run (say vit-small): a suite too long "
                             "for one sitting runs one shape at a time, each shape's ratios still from one invocation")
    parser.add_argument("--micro_batch_size", type=int, default=0,
                        help="override every shape's micro-batch (gpu_check.sh: the one plan.py picks)")
    parser.add_argument("--compare", default="",
                        help="a results directory of the same suite (say benchmarks/results/cpu): write comparison.md "
                             "against its results.csv and exit non-zero when a configuration is not reproduced")
    parser.add_argument("--no_host_probe", action="store_true",
                        help="calibrate the planner without its host probe (planner/host.py)")
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
    if args.shapes:
        import dataclasses

        wanted = args.shapes.split(",")
        unknown = set(wanted) - {s.model for s in suite.shapes}
        if unknown:
            sys.exit(f"error: --shapes {','.join(sorted(unknown))}: the {args.suite} suite's shapes are "
                     f"{', '.join(s.model for s in suite.shapes)}")
        suite = dataclasses.replace(suite, shapes=[s for s in suite.shapes if s.model in wanted])
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
        return write_report(out_dir, args.suite, suite, results, saved["gemm_samples"], threads, saved["minutes"],
                      args.compare, saved_env=saved)
    if os.path.exists(os.path.join(out_dir, "failed.log")):
        os.remove(os.path.join(out_dir, "failed.log"))
    started = time.perf_counter()
    gemm = gemm_gflops(threads) if not torch.cuda.is_available() else gpu_peak_gflops()
    # what the planner's step time is computed from, per shape (plan.py --calibrate), measured at the start of
    # every repeat, as the jobs are: the machine's speed drifts over a suite; the host probe in the first only
    calibrations = {shape.label: [] for shape in suite.shapes}
    jobs = [(shape, run) for shape in suite.shapes for run in runs_of(suite, shape)]
    results, measured, budgets = [], {}, {}
    # a micro-batch race screens every configuration once, then confirms the finalists (benchmarks/race.py)
    repeats = suite.repeats + bool(suite.global_batch)
    bar = tqdm(total=(len(jobs) + len(suite.shapes)) * repeats, desc=args.suite, dynamic_ncols=True)
    with open(os.path.join(out_dir, "runs.jsonl"), "w") as log:
        for repeat in range(repeats):
            if suite.global_batch and repeat == 1:
                chosen = {shape.label: finalists(suite, shape, results) for shape in suite.shapes}
                jobs = [(shape, run) for shape, run in jobs if run.name in chosen[shape.label]]
                bar.total = bar.n + (len(jobs) + len(suite.shapes)) * (repeats - 1)
            for shape in suite.shapes:
                bar.set_postfix_str(f"calibrating the planner for {shape.model}")
                try:
                    calibrations[shape.label].append(calibrate(
                        shape.model, shape.image_size, shape.patch_size, shape.micro_batch_size, 10, suite.ranks,
                        threads, "bf16" if torch.cuda.is_available() else "fp32", host=repeat == 0 and not args.no_host_probe))
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # benchmarks.validate measures it instead
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
        if suite.global_batch:  # the race's winners through train.py itself
            run_trainer_phase(suite, results, threads, out_dir, log, bar)
    bar.close()
    return write_report(out_dir, args.suite, suite, results, gemm, threads, (time.perf_counter() - started) / 60,
                  args.compare, calibrations={k: median_calibration(v) for k, v in calibrations.items() if v})


def write_report(out_dir: str, suite_name: str, suite: Suite, results: list, gemm: list, threads: int, minutes: float,
           compare_to: str = "", saved_env: dict = None, calibrations: dict = None) -> int:
    """Write results.csv/.md, environment.json and pareto.png; `saved_env`: the runs' own environment (a report
    rewritten later keeps the date, commit and versions of the runs); `calibrations`: the planner's, per shape,
    the median of those measured at the start of each repeat."""
    flops = {s.label: model_flops_per_image(s) for s in suite.shapes}
    env = {k: v for k, v in saved_env.items() if k not in ("suite", "minutes", "model_flops_per_image")} \
        if saved_env else dict(environment(threads, gemm), calibration=calibrations or {})
    rows = summarise(results, suite.shapes, suite, flops, env["peak_gflops_per_rank"])
    targets = check_targets(rows, suite, results) + (race_targets(suite, rows, results) if suite.global_batch else [])
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out_dir, "environment.json"), "w") as f:
        json.dump(dict(env, suite=suite_name, minutes=round(minutes, 1),
                       model_flops_per_image={k: v for k, v in flops.items()}), f, indent=1)
    write_markdown(os.path.join(out_dir, "results.md"), suite_name, suite, rows, targets, env, minutes, results,
                   race_markdown(suite, rows, results) if suite.global_batch else "")
    if suite.global_batch:
        plot_race(os.path.join(out_dir, "race.png"), suite, rows, results)
    else:
        plot(os.path.join(out_dir, "pareto.png"), suite, rows)
    write_validation(out_dir, suite_name)  # plan.py's predictions against these rows: planner.md
    print(open(os.path.join(out_dir, "results.md")).read())
    failed = sum(r.get("jobs_failed", 0) for r in rows)
    if failed:
        print(f"{failed} jobs failed: {os.path.join(out_dir, 'failed.log')}", file=sys.stderr)
    not_reproduced = []
    if compare_to:
        with open(os.path.join(compare_to, "results.csv")) as f:
            shapes = {s.label for s in suite.shapes}  # a run of some of the suite's shapes (--shapes)
            reference = [r for r in csv.DictReader(f) if r["shape"] in shapes]
        # through CSV, as the reference was read: the same strings on both sides
        with open(os.path.join(out_dir, "results.csv")) as f:
            lines, not_reproduced = compare(list(csv.DictReader(f)), reference)
        with open(os.path.join(out_dir, "comparison.md"), "w") as f:
            f.write(f"# {suite_name}: this run against {compare_to}\n\n" + "\n".join(lines) + "\n")
        print("\n".join(lines))
    return 1 if failed or not_reproduced else 0


if __name__ == "__main__":
    sys.exit(main())
