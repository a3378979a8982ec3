"""What a checkpoint costs the training loop, written in the foreground or in the background (`async_save`, FSDP2).

    .venv/bin/python -m benchmarks.async_save                 # ~10 min on 2 cores
    .venv/bin/python -m benchmarks.async_save --report_only   # report.md from runs.jsonl
    .venv/bin/python -m benchmarks.async_save --smoke --out /tmp/a   # vit-debug, 1 repeat: the harness

train.py with the FSDP2 engine (resharding) on 2 ranks of one thread each, on synthetic data (no loader cost),
saving every SAVE_EVERY steps; the same job with `async_save` false and true, in alternating order, 5 repeats.
Per run: the seconds its loop spent in checkpoint calls (summary.json's checkpoint_seconds_this_launch: in the
background case the copies to host memory and the commits, which wait for the thread; the last checkpoint is
written in the foreground in both), and the launch's wall seconds. The report gives the paired ratios async /
sync with 95% bootstrap intervals (benchmarks/report.py). Writes benchmarks/results/async-save/.
"""
import argparse
import json
import os
import statistics
import tempfile

from tqdm import tqdm

from benchmarks.measure import CPU_ALLOCATOR_ENV, REPO, environment, gemm_gflops
from benchmarks.report import fmt_ratio, judged, paired_ratio, render
from launch.job import run as launch_train

OUT = os.path.join(REPO, "benchmarks", "results", "async-save")
RANKS, THREADS = 2, 1
SAVE_EVERY = 4
FULL = dict(model="vit-small", image_size=32, patch_size=4, micro_batch_size=8, steps=17, repeats=5)
SMOKE = dict(model="vit-debug", image_size=16, patch_size=0, micro_batch_size=8, steps=9, repeats=1)
SIDES = ("sync", "async")


def run(plan: dict, background: bool, timeout_s: int = 900) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), PYTHONWARNINGS="ignore", **CPU_ALLOCATOR_ENV)
        done = launch_train(nproc=RANKS, env=env, timeout=timeout_s, config="configs/digits-vit.yaml",
                            data_mode="synthetic", engine="fsdp2", zero_stage=3, model=plan["model"],
                            image_size=plan["image_size"], patch_size=plan["patch_size"],
                            micro_batch_size=plan["micro_batch_size"], max_steps=plan["steps"], warmup_steps=2,
                            save_every=SAVE_EVERY, eval_every=0, keep_last=2, async_save=background, progress=False,
                            report_to="none", output_dir=tmp)
        if not done.ok:
            return {"error": done.output[-3000:]}
        summary = done.summary
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(tmp, "checkpoints"))
                   for f in fs) // 2  # the two checkpoints kept
        return {"checkpoint_s": summary["checkpoint_seconds_this_launch"], "wall_s": summary["seconds_this_launch"],
                "images_per_sec": summary["images_per_sec"], "checkpoint_bytes": size}


def measure(out_dir: str, plan: dict) -> list:
    results = []
    with open(os.path.join(out_dir, "runs.jsonl"), "w") as log, \
            tqdm(total=plan["repeats"] * 2, desc="checkpoints: foreground against background") as bar:
        for repeat in range(plan["repeats"]):
            for side in (SIDES if repeat % 2 == 0 else SIDES[::-1]):
                r = {"side": side, "repeat": repeat, **run(plan, side == "async")}
                results.append(r)
                log.write(json.dumps(r) + "\n")
                log.flush()
                bar.set_postfix_str(f"{side}: " + (f"{r['checkpoint_s']:.2f} s in checkpoints" if "error" not in r
                                                   else "FAILED"))
                bar.update()
    return results


def write_report(out_dir: str, results: list, env: dict, plan: dict):
    commit = env["git_commit"].split()[0][:7] + (" (with uncommitted changes)" if "uncommitted" in env["git_commit"]
                                                 else "")
    saves = len(range(SAVE_EVERY, plan["steps"], SAVE_EVERY))
    lines = [f"# Checkpoints in the foreground and in the background (FSDP2, async_save), {env['date']}", "",
             f"- **Machine**: {env['cpu']}, {env['cores']} cores, {RANKS} ranks x {THREADS} thread, fp32. "
             f"**Commit** `{commit}`; torch {env['torch']}.",
             f"- **Run**: train.py, FSDP2 resharding, {plan['model']} at {plan['image_size']}x{plan['image_size']} "
             f"(patch {plan['patch_size'] or 'the model default'}), {plan['micro_batch_size']} synthetic images per rank and step, "
             f"{plan['steps']} steps, a checkpoint every {SAVE_EVERY} ({saves} in the loop, in the background with "
             f"async_save) and the last one in the foreground either way; {plan['repeats']} repeats in alternating "
             "order (`python -m benchmarks.async_save`).", "",
             "| measure | sync (median) | async (median) | async / sync [95% interval] | async lower |",
             "|---|---|---|---|---|"]
    for key, what in (("checkpoint_s", "seconds in checkpoint calls"), ("wall_s", "launch wall seconds")):
        of = {side: {r["repeat"]: r[key] for r in results if r["side"] == side and "error" not in r}
              for side in SIDES}
        ratio = paired_ratio(of["async"], of["sync"])
        lines.append(f"| {what} | {statistics.median(of['sync'].values() or [float('nan')]):.2f} | "
                     f"{statistics.median(of['async'].values() or [float('nan')]):.2f} | {fmt_ratio(ratio)} | "
                     f"{render(judged(ratio, 1.0, at_least=False))} |")
    sizes = [r["checkpoint_bytes"] for r in results if "error" not in r]
    if sizes:
        lines += ["", f"A checkpoint: {statistics.median(sizes) / 2**20:.0f} MiB (weights and AdamW's moments, "
                      f"2 ranks' shards)."]
    failed = [r for r in results if "error" in r]
    if failed:
        lines += ["", f"{len(failed)} jobs failed: " + ", ".join(f"{r['side']} repeat {r['repeat']}" for r in failed)]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="vit-debug, 1 repeat: checks the harness")
    a = parser.parse_args(argv)
    plan = SMOKE if a.smoke else FULL
    os.makedirs(a.out, exist_ok=True)
    if a.report_only:
        results = [json.loads(line) for line in open(os.path.join(a.out, "runs.jsonl"))]
        env = json.load(open(os.path.join(a.out, "environment.json")))
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
