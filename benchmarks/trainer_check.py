"""train.py against the benchmark worker on one configuration: the images/s a user gets beside the images/s the
suites report.

    .venv/bin/python -m benchmarks.trainer_check                 # ~35 min on 2 cores (needs `make data`)
    .venv/bin/python -m benchmarks.trainer_check --report_only   # report.md from runs.jsonl
    .venv/bin/python -m benchmarks.trainer_check --smoke --out /tmp/t   # vit-debug, 1 repeat: the harness (~1 min)
    .venv/bin/python -m benchmarks.trainer_check --configs "FSDP2 (resharding) + none" --out benchmarks/results/trainer-fsdp2

Both run ViT-S/8 at 64x64, 32 images per rank and step, ZeRO-2 (or a configuration of CONFIGS), on 2 ranks of one thread each, in alternating
order, 5 repeats. train.py trains on the digits shards through its own loader (decoding and augmentation in its
loader worker), logs every `log_every` steps and neither evaluates nor saves before its last step; its images/s
is its summary's, over the steps after warm-up. The worker trains on random images already in memory, over its
timed steps. Per repeat the ratio train.py / worker; the report gives the geometric mean with a 95% bootstrap
interval and train.py's share of time waiting for data. Target: within 5% of each other.
Writes benchmarks/results/trainer/: runs.jsonl and report.md.
"""
import argparse
import json
import math
import os
import statistics

from tqdm import tqdm

from benchmarks.measure import CPU_ALLOCATOR_ENV, REPO, environment, gemm_gflops
from benchmarks.report import both, fmt_ratio, judged, paired_ratio, render
from benchmarks.train_bench import run_worker
from launch.job import run as launch_train

OUT = os.path.join(REPO, "benchmarks", "results", "trainer")
RANKS, THREADS = 2, 1
LOG_EVERY = 4
CONFIGS = {"ZeRO-2 + none": dict(engine="deepspeed", zero=2, ac="none"),
           "ZeRO-3 + selective": dict(engine="deepspeed", zero=3, ac="selective"),
           "FSDP2 (resharding) + none": dict(engine="fsdp2", zero=3, ac="none")}
TARGET = 0.05
# train.py times the steps after its first two (warm-up and profiled)
FULL = dict(shape=dict(model="vit-small", image_size=64, patch_size=8, micro_batch_size=32), steps=16, repeats=5)
SMOKE = dict(shape=dict(model="vit-debug", image_size=16, patch_size=0, micro_batch_size=8), steps=6, repeats=1)


def run_trainer(shape: dict, steps: int, engine: str, zero: int, ac: str, timeout_s: int = 900) -> dict:
    """train.py under torchrun on the digits shards: its summary, and the mean share of its steps spent waiting
    for data (metrics.jsonl)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), PYTHONWARNINGS="ignore", **CPU_ALLOCATOR_ENV)
    done = launch_train(nproc=RANKS, env=env, timeout=timeout_s, config="configs/digits-vit.yaml", **shape,
                        engine=engine, zero_stage=zero, ac=ac, max_steps=steps, log_every=LOG_EVERY, eval_every=0,
                        save_every=0)
    if not done.ok:
        return {"error": done.output[-3000:]}
    summary = done.summary
    timed = [s for s in done.metrics if "data_wait_frac" in s and s["step"] > 2]
    return {"images_per_sec": summary["images_per_sec"],
            "data_wait_frac": sum(s["data_wait_frac"] for s in timed) / max(len(timed), 1)}


def measure(out_dir: str, plan: dict) -> list:
    jobs = [(name, side) for name in plan["configs"] for side in ("train.py", "worker")]
    results = []
    with open(os.path.join(out_dir, "runs.jsonl"), "w") as log, tqdm(total=plan["repeats"] * len(jobs),
                                                                   desc="train.py against the worker") as bar:
        for repeat in range(plan["repeats"]):
            for name, side in (jobs if repeat % 2 == 0 else jobs[::-1]):
                config = CONFIGS[name]
                if side == "train.py":
                    r = run_trainer(plan["shape"], plan["steps"], **config)
                else:
                    spec = dict(**plan["shape"], **config, reshard=config["zero"] == 3, grad_accum_steps=1,
                                profiled_steps=1,
                                warmup_steps=1, timed_steps=plan["steps"] - 2, count_flops=False)
                    r, _ = run_worker(spec, RANKS, THREADS, 900)
                r = {"config": name, "side": side, "repeat": repeat, **{k: r[k] for k in r if k in (
                    "images_per_sec", "data_wait_frac", "error")}}
                results.append(r)
                log.write(json.dumps(r) + "\n")
                log.flush()
                bar.set_postfix_str(f"{name}, {side}: " + (f"{r['images_per_sec']:.2f} img/s" if "error" not in r
                                                            else "FAILED"))
                bar.update()
    return results


def write_report(out_dir: str, results: list, env: dict, plan: dict):
    shape, steps = plan["shape"], plan["steps"]
    commit = env["git_commit"].split()[0][:7] + (" (with uncommitted changes)" if "uncommitted" in env["git_commit"]
                                                 else "")
    lines = [f"# train.py against the benchmark worker, {env['date']}", "",
             f"- **Machine**: {env['cpu']}, {env['cores']} cores, {RANKS} ranks x {THREADS} thread, fp32. "
             f"**Commit** `{commit}`; torch {env['torch']}, deepspeed {env['deepspeed']}.",
             f"- **Run**: {shape['model']} at {shape['image_size']}x{shape['image_size']}, "
             f"{shape['micro_batch_size']} images per rank and step; train.py for {steps} steps on the digits "
             f"shards (its summary's images/s, after 2 warm-up steps), the worker on random images in memory for "
             f"1 profiled, 1 warm-up and {steps - 2} timed steps; {plan['repeats']} "
             "repeats in alternating order (`python -m benchmarks.trainer_check`).", "",
             "| configuration | train.py images/s (median) | worker images/s (median) | train.py / worker | "
             "train.py waiting for data | within 5% |", "|---|---|---|---|---|---|"]
    for name in plan.get("configs", CONFIGS):
        of = {side: {r["repeat"]: r["images_per_sec"] for r in results if r["config"] == name and r["side"] == side
                     and "error" not in r} for side in ("train.py", "worker")}
        ratio = paired_ratio(of["train.py"], of["worker"])
        wait = [r["data_wait_frac"] for r in results if r["config"] == name and r["side"] == "train.py"
                and "error" not in r]
        # within 5% both ways: the interval's two ends against 1 - 5% and 1 + 5%
        verdict = render(both(judged(ratio, 1 - TARGET, at_least=True), judged(ratio, 1 + TARGET, at_least=False)))
        lines.append(f"| {name} | {statistics.median(of['train.py'].values() or [math.nan]):.2f} | "
                     f"{statistics.median(of['worker'].values() or [math.nan]):.2f} | {fmt_ratio(ratio)} | "
                     f"{sum(wait) / max(len(wait), 1):.1%} | {verdict} |")
    failed = [r for r in results if "error" in r]
    if failed:
        lines += ["", f"{len(failed)} jobs failed: " + ", ".join(f"{r['config']} {r['side']} repeat {r['repeat']}"
                                                                 for r in failed)]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="vit-debug, 6 steps, 1 repeat: checks the harness")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of them, comma-separated")
    a = parser.parse_args(argv)
    plan = dict(SMOKE if a.smoke else FULL, configs=[c for c in CONFIGS if c in a.configs.split(",")])
    if not plan["configs"]:
        parser.error(f"--configs names none of {', '.join(CONFIGS)}")
    os.makedirs(a.out, exist_ok=True)
    if a.report_only:
        with open(os.path.join(a.out, "runs.jsonl")) as f:
            results = [json.loads(line) for line in f]
        with open(os.path.join(a.out, "environment.json")) as f:
            env = json.load(f)
        plan = env.get("plan", plan)
    else:
        env = dict(environment(THREADS, gemm_gflops(THREADS)), plan=plan)
        results = measure(a.out, plan)
        with open(os.path.join(a.out, "environment.json"), "w") as f:
            json.dump(env, f, indent=1)
    write_report(a.out, results, env, plan)
    print(open(os.path.join(a.out, "report.md")).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
