"""Sequence parallelism on CPU: per-rank peak memory and images/s of `sp_size 2` against `sp_size 1`, under FSDP2
(resharding) and ZeRO-3, at a token count where the activations matter, with the planner's peak for each.

    .venv/bin/python -m benchmarks.sequence_bench                 # ~15 min on 2 cores
    .venv/bin/python -m benchmarks.sequence_bench --report_only   # the report from runs.jsonl
    .venv/bin/python -m benchmarks.sequence_bench --share         # ~5 min: the split's collectives' share

Each job is the benchmark worker (benchmarks/bench_worker.py) on 2 ranks: ViT-S/8 at 256 px (1,025 tokens), 2
profiled, 1 warm-up and 3 timed steps. Per engine three configurations: `sp_size 1` at one image per rank (2
images per step), `sp_size 2` at two images per sequence group (the same 2 images per step: the same work), and
`sp_size 2` at one image (one image per step: each rank holds half of one image's tokens, what a split buys
when one image per GPU is the floor). 5 repeats, the configurations in a rotated order each repeat; ratios are
paired within a repeat (the geometric mean of the per-repeat ratios, 95% bootstrap intervals: benchmarks/report.py).
`--share`: the split's own collectives (the attention's all-to-alls and the gather before the final norm) as a
share of a step, `sp_size 2` at two images under each engine, 5 repeats: the worker traces one timed step
(BENCH_TRACE_STEP, the profiler's CPU timeline: a traced step runs slower than an untraced one) and the share is
the time inside those operators over the step's, the mean of the two ranks.
Writes benchmarks/results/sequence/: runs.jsonl, share.jsonl, environment.json, report.md.
"""
import argparse
import json
import os
import statistics
import time

from benchmarks.measure import environment, gemm_gflops
from benchmarks.report import fmt_ratio, peak_of, peak_ratio, speed_ratio
from benchmarks.suites import DEEPSPEED, FSDP2
from benchmarks.train_bench import run_worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "benchmarks", "results", "sequence")
SHAPE = dict(model="vit-small", image_size=256, patch_size=8)
LABEL = "ViT-S/8, 256x256 (1,025 tokens)"
REPEATS = 5
# (name, engine, sp_size, images per sequence group and micro-batch)
CONFIGS = [(f"{label} sp {sp} @ {micro}", engine, sp, micro)
           for engine, label in ((FSDP2, "FSDP2"), (DEEPSPEED, "ZeRO-3")) for sp, micro in ((1, 1), (2, 2), (2, 1))]


def spec(engine: str, sp: int, micro: int) -> dict:
    return dict(engine=engine, **SHAPE, micro_batch_size=micro, grad_accum_steps=1, zero=3, ac="none",
                reshard=True, sp_size=sp, profiled_steps=2, warmup_steps=1, timed_steps=3, count_flops=False)


def planned_peak(engine: str, sp: int, micro: int) -> int:
    """The planner's per-rank peak of a configuration (the configuration alone, on the meta device)."""
    from benchmarks.bench_worker import Spec, run_config
    from engine.build import engine_config
    from models.registry import model_config, width
    from planner.devices import Device
    from planner.estimate import estimate

    cfg = run_config(Spec(**spec(engine, sp, micro)))
    from dataclasses import replace

    cfg = replace(cfg, engine=engine)
    hidden = width(model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size))
    device = Device("cpu", 1e11, 1e6, 10.0, 10.0, 0.0, mem_gbs=10.0)  # the rates play no part in the peak
    return int(estimate(cfg, engine_config(cfg, hidden, 2)[1], "fp32", 2, 2, device)["peak_bytes"])


def run(out: str, repeats: int):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "runs.jsonl")
    env = environment(1, gemm_gflops(1))
    with open(os.path.join(out, "environment.json"), "w") as f:
        json.dump(env, f, indent=1)
    open(path, "w").close()
    start = time.monotonic()
    for repeat in range(repeats):
        order = CONFIGS[repeat % len(CONFIGS):] + CONFIGS[:repeat % len(CONFIGS)]  # rotated: no fixed position
        for name, engine, sp, micro in order:
            result, tail = run_worker(spec(engine, sp, micro), 2, 1, 900)
            result.update(shape=LABEL, run=name, engine=engine, sp_size=sp, micro=micro, repeat=repeat)
            with open(path, "a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"repeat {repeat} {name}: " + (f"{result['images_per_sec']:.2f} images/s, peak "
                                                 f"{peak_of(result) / 2**20:.0f} MiB" if not tail else "FAILED"),
                  flush=True)
    return (time.monotonic() - start) / 60


SHARE_STEP = 5  # a timed step: 2 profiled and 1 warm-up come first
# the operators of the split's collectives in the profiler's timeline: torch's functional collectives, which the
# split alone uses (compat.all_to_all_autograd, all_gather_autograd; FSDP2 and DeepSpeed call c10d's directly):
# the all-to-alls, the all-gather, their backward's, and the waits on them, where a rank waits for the other
COLLECTIVES = ("c10d_functional",)


def collective_share(trace: str, step: int) -> float:
    """The share of traced step `step` spent inside the split's collectives (`COLLECTIVES`), on the thread that
    ran the step: the union of those operators' spans (nested ones counted once) over the step's span."""
    data = json.load(open(trace))
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]
    whole = next(e for e in events if e["name"] == f"bench/step{step}")
    lo, hi = whole["ts"], whole["ts"] + whole["dur"]
    spans = sorted((e["ts"], min(hi, e["ts"] + e["dur"])) for e in events
                   if e.get("tid") == whole.get("tid") and lo <= e["ts"] < hi
                   and any(k in e["name"].lower() for k in COLLECTIVES))
    covered, end = 0.0, lo
    for start, stop in spans:
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered / (hi - lo)


def run_share(out: str, repeats: int):
    """`--share`'s jobs into share.jsonl."""
    import glob
    import tempfile

    path = os.path.join(out, "share.jsonl")
    open(path, "w").close()
    start = time.monotonic()
    for repeat in range(repeats):
        for engine, label in ((FSDP2, "FSDP2"), (DEEPSPEED, "ZeRO-3"))[::1 if repeat % 2 == 0 else -1]:
            with tempfile.TemporaryDirectory() as traces:
                os.environ.update(BENCH_TRACE_STEP=str(SHARE_STEP), BENCH_TRACE_DIR=traces)
                try:
                    result, tail = run_worker(spec(engine, 2, 2), 2, 1, 900)
                finally:
                    del os.environ["BENCH_TRACE_STEP"], os.environ["BENCH_TRACE_DIR"]
                shares = [collective_share(f, SHARE_STEP) for f in sorted(glob.glob(os.path.join(traces, f"*-step{SHARE_STEP}_rank*.json")))]
            record = dict(run=f"{label} sp 2 @ 2", engine=engine, repeat=repeat, shares=shares,
                          **({"error": tail} if tail or len(shares) != 2 else {}))
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"repeat {repeat} {label}: " + (", ".join(f"{x:.1%}" for x in shares) if "error" not in record
                                                  else "FAILED"), flush=True)
    env = environment(1, gemm_gflops(1))
    with open(os.path.join(out, "share-environment.json"), "w") as f:
        json.dump(dict(env, minutes=round((time.monotonic() - start) / 60, 1)), f, indent=1)


def mean_interval(values: list) -> tuple[float, float, float]:
    """(mean, low, high): the mean with its 95% Student-t interval."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def shares(out: str) -> dict:
    """{engine label: each repeat's share (the mean of its two ranks)} from share.jsonl; {} without one."""
    path = os.path.join(out, "share.jsonl")
    if not os.path.exists(path):
        return {}
    records = [json.loads(line) for line in open(path) if line.strip()]
    return {label: [sum(r["shares"]) / len(r["shares"]) for r in records
                    if r["run"] == f"{label} sp 2 @ 2" and "error" not in r] for label in ("FSDP2", "ZeRO-3")}


def share_lines(out: str) -> list:
    measured = shares(out)
    if not measured:
        return ["The split's collectives' share of the step is not measured here (`--share` measures it)."]
    repeats = len([line for line in open(os.path.join(out, "share.jsonl")) if line.strip()]) // len(measured)
    env = json.load(open(os.path.join(out, "share-environment.json")))
    lines = [f"`python -m benchmarks.sequence_bench --share` at commit {env['git_commit'][:7]}"
             + (" (with uncommitted changes)" if "uncommitted" in env["git_commit"] else "")
             + f", {env['date']}, {env['minutes']:g} min. The split's own collectives (the attention's all-to-alls, the gather before the final norm, their "
             "backward's and the waits on them) as a share of a traced step, `sp_size 2` at two images per step "
             "(`--share`: the profiler's timeline of one timed step per job, the mean of the two ranks; "
             f"{repeats} repeats, the engines alternating):", "",
             "| engine | share of the step (mean, 95% t interval) | per repeat |", "|---|---|---|"]
    for label, values in measured.items():
        if not values:
            lines.append(f"| {label} | not measured | |")
            continue
        mean, low, high = mean_interval(values)
        lines.append(f"| {label} | {mean:.1%} [{low:.1%}, {high:.1%}] | {', '.join(f'{x:.1%}' for x in values)} |")
    return lines


def report(out: str, minutes: float | None = None):
    results = [json.loads(line) for line in open(os.path.join(out, "runs.jsonl")) if line.strip()]
    env = json.load(open(os.path.join(out, "environment.json")))
    minutes = minutes or env.get("minutes")
    ok = [r for r in results if "error" not in r]
    lines = [f"# Sequence parallelism on CPU: `sp_size 2` against `sp_size 1` ({env['date']})", "",
             f"`python -m benchmarks.sequence_bench` at commit {env['git_commit'][:7]}"
             + (" (with uncommitted changes)" if "uncommitted" in env["git_commit"] else "")
             + f", {env['cpu']}, 2 ranks x 1 thread, fp32, torch {env['torch']}, deepspeed {env['deepspeed']}"
             + (f"; {minutes:.0f} min" if minutes else "") + f". {LABEL}, `ac none`, the benchmark worker: 2 profiled, "
             f"1 warm-up and 3 timed steps per job, {len({r['repeat'] for r in results})} repeats in rotated order "
             f"({len(results) - len(ok)} of {len(results)} jobs failed). Peak: the larger rank's allocation peak "
             "from the profiler's memory events over the profiled steps; planned: plan.py's estimate of the "
             "configuration alone.", "",
             "| configuration | images per step | images/s (median) | peak MiB (median) | planned peak MiB | planned / measured |",
             "|---|---|---|---|---|---|"]
    for name, engine, sp, micro in CONFIGS:
        mine = [r for r in ok if r["run"] == name]
        if not mine:
            lines.append(f"| {name} | {2 * micro // sp} | not measured | | | |")
            continue
        peak = statistics.median(peak_of(r) for r in mine)
        planned = planned_peak(engine, sp, micro)
        lines.append(f"| {name} | {2 * micro // sp} | {statistics.median(r['images_per_sec'] for r in mine):.2f} | "
                     f"{peak / 2**20:.0f} | {planned / 2**20:.0f} | {planned / peak:.2f} |")
    lines += ["", "Paired ratios, `sp_size 2` against `sp_size 1` under the same engine:", "",
              "| engine | comparison | images/s | peak |", "|---|---|---|---|"]
    for label in ("FSDP2", "ZeRO-3"):
        base = f"{label} sp 1 @ 1"
        for other, what in ((f"{label} sp 2 @ 2", "the same 2 images per step"),
                            (f"{label} sp 2 @ 1", "one image per step, split")):
            lines.append(f"| {label} | {what} | {fmt_ratio(speed_ratio(ok, LABEL, other, base))} | "
                         f"{fmt_ratio(peak_ratio(ok, LABEL, other, base))} |")
    lines += [""] + share_lines(out)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return os.path.join(out, "report.md")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=OUT)
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--report_only", action="store_true")
    p.add_argument("--share", action="store_true", help="measure the split's collectives' share of a step alone")
    a = p.parse_args(argv)
    if a.share:
        run_share(a.out, a.repeats)
    minutes = None if a.report_only or a.share else run(a.out, a.repeats)
    if minutes:  # kept beside the environment, for a report rewritten later
        path = os.path.join(a.out, "environment.json")
        json.dump(dict(json.load(open(path)), minutes=round(minutes, 1)), open(path, "w"), indent=1)
    print(f"written: {report(a.out, minutes)}")


if __name__ == "__main__":
    main()
