"""The measured figures of README.md and docs/, rendered from the committed reports.

    .venv/bin/python -m benchmarks.docs            # rewrite every figure block from benchmarks/results/
    .venv/bin/python -m benchmarks.docs --check    # exit 1, naming the blocks, where a doc disagrees with its report
    .venv/bin/python -m benchmarks.docs --stale benchmarks/results/cpu --since d3e7005 --why "the float64 norm"

A figure block in a Markdown file is the text between `<!-- figures: NAME -->` and `<!-- /figures -->`; RENDERERS
maps each NAME to the function that writes it from a report's machine-readable files (runs.jsonl, results.csv,
results.json), with the report's date, and with **stale** when the report's own header says so. A report is
marked stale in its header (`--stale`: a line `**Stale** since <commit>: <why>` under its title) when code on its
measured path changed after it ran; the CHANGELOG says so too. tests/unit/test_docs_figures.py runs `--check`.
"""
import argparse
import functools
import json
import os
import math
import re
import statistics
import sys
import textwrap

from benchmarks.measure import REPO
from benchmarks.report import MIN_REPEATS, fmt_ratio, paired_ratio, speed_ratio
from benchmarks.suites import DEEPSPEED, FSDP2

RESULTS = os.path.join(REPO, "benchmarks", "results")
DOCS = ["README.md"] + [os.path.join("docs", name) for name in sorted(os.listdir(os.path.join(REPO, "docs")))
                        if name.endswith(".md")]
BLOCK = re.compile(r"(<!-- figures: ([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)
STALE = re.compile(r"^\*\*Stale\*\* since `?(\w+)`?: (.+)$", re.M)


# ----------------------------------------------------------------------------- reading reports
def report_dir(*parts) -> str:
    return os.path.join(RESULTS, *parts)


def stale_note(folder: str) -> str:
    """' (**stale** since <commit>)' when the report's header says it is stale (its reason is there), else ''."""
    for name in ("report.md", "results.md", "README.md"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            head = open(path).read().split("\n## ", 1)[0]
            if m := STALE.search(head):
                return f", **stale** since `{m.group(1)}`"
            return ""
    return ""


def runs(folder: str) -> list:
    with open(os.path.join(folder, "runs.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def env_date(folder: str) -> str:
    for name in ("environment.json", "results.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return json.load(open(path))["date"]
    raise FileNotFoundError(f"{folder}: no environment.json or results.json with a date")


def link(folder: str, doc: str, name: str = "report.md") -> str:
    """A relative link from `doc` (a path under the repository) to a report file."""
    return os.path.relpath(os.path.join(folder, name), os.path.dirname(os.path.join(REPO, doc)))


def by_repeat(results: list, key: str, value, **match) -> dict:
    return {r["repeat"]: value(r) for r in results
            if all(r.get(k) == v for k, v in match.items()) and "error" not in r}


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.0f}%".replace("-", "−")


def pct1(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%".replace("-", "−")


def interval_pct(r) -> str:
    """A ratio's change as a percentage with its interval: +9% [+5, +14]."""
    lo, hi = pct(r.low), pct(r.high)
    return f"{pct(r.ratio)} [{lo.rstrip('%')}, {hi}]"


def gi(n: float) -> str:
    return f"{n:,.0f}"


# ----------------------------------------------------------------------------- the renderers
def policy_table(doc: str) -> str:
    """README's table of the checkpointing policies: activations and step time against `none` under FSDP2 on 2
    CPU ranks (the cpu suite), each a paired ratio over the suite's repeats."""
    folder = report_dir("cpu")
    results = runs(folder)
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    vit, swin = (next(s for s in shapes if s.startswith(p)) for p in ("ViT-S", "Swin-T"))

    def figures(shape, ac):
        none = {"shape": shape, "run": "FSDP2 + none"}
        this = {"shape": shape, "run": f"FSDP2 + {ac}"}
        acts = paired_ratio(by_repeat(results, "activation_bytes", lambda r: max(r["activation_bytes"]), **this),
                            by_repeat(results, "activation_bytes", lambda r: max(r["activation_bytes"]), **none))
        return acts, speed_ratio(results, shape, none["run"], this["run"])  # step time: none's images/s over ac's

    def cell(shape, ac, name=""):
        acts, step = figures(shape, ac)
        if acts is None or step is None:
            return f"{name}not measured"
        few = f" ({step.n} repeats)" if step.n < MIN_REPEATS else ""
        return f"{name}{pct(acts.ratio)} activations, step time {interval_pct(step)}{few}"

    date = env_date(folder)
    rows = [f"| your situation | `ac` | cost under FSDP2, 2 CPU ranks, fp32 ([cpu report]({link(folder, doc)}), "
            f"{date}{stale_note(folder)}; step time: 95% interval over the repeats) |", "|---|---|---|",
            "| the batch fits | `none` | — |",
            "| a little short of memory | `light` | norms' and activations' outputs recomputed, no matmul "
            "([docs](docs/activation_checkpointing.md#light-and-selective-recipes-not-a-dispatch-mode)); host time "
            "per step below |",
            f"| a little shorter, ViT | `selective` | `light` and the residual sums, rerunning ViT's out-projection "
            f"(on Swin as `light`); ViT-S: {cell(vit, 'selective')}; Swin-T: {cell(swin, 'selective')} |",
            "| short of memory, want the least recompute that fits a per-rank budget | `auto:GB` (e.g. `auto:60`) | "
            "plans each block against the budget ([docs](docs/activation_checkpointing.md)) |",
            f"| much shorter, ViT | `hierarchical` | ViT-S: {cell(vit, 'hierarchical')} |",
            f"| as little memory as possible | `full` | ViT-S: {cell(vit, 'full')}; Swin-T: {cell(swin, 'full')} |",
            "| GPU, host memory to spare | `offload` | activations in pinned host memory, no recompute |"]
    host = report_dir("host-light")
    hl = host_light(host)
    return "\n".join(rows) + (f"\n\nHost time per step against `none` (a host-bound shape; [host-light]"
                              f"({link(host, doc, 'results.md')}), {env_date(host)}{stale_note(host)}): {hl}.")


def host_light(folder: str) -> str:
    """light's and selective's host seconds per step over none's, under FSDP2 and ZeRO-3 (the host-light suite)."""
    results = runs(folder)
    parts = []
    shape = results[0]["shape"]
    for ac in ("light", "selective"):
        for engine, prefix in (("FSDP2", "FSDP2"), ("ZeRO-3", "ZeRO-3")):
            r = speed_ratio(results, shape, f"{prefix} + none", f"{prefix} + {ac}")  # the suite's own target
            parts.append(f"`{ac}` {fmt_ratio(r).split(' (')[0]}× under {engine}" if r else f"`{ac}` under {engine} "
                         f"not measured")
    return "; ".join(parts)


def h200_jobs() -> tuple:
    """The second GPU check's train.py jobs (parts 7 and 8) and its date, and the worker's images/s."""
    folder = report_dir("gpu-check", "2026-12-04-v2")
    first = json.load(open(os.path.join(folder, "results.json")))
    second = json.load(open(os.path.join(folder, "part8", "results.json")))
    trainer = first["parts"].get("trainer", {}).get("figures") or {}
    jobs = dict(trainer.get("jobs") or {})
    jobs.update((second["parts"].get("compiled", {}).get("figures") or {}).get("jobs") or {})
    # MFU against the GEMM of the same call (part 1), at 3 forward passes' FLOPs per image
    gemm = first["parts"]["machine"]["figures"]["gemm"]["tflops_median"] * 1e12
    for j in jobs.values():
        if j.get("images_per_sec") and j.get("mfu") is None:
            j["mfu"] = j["images_per_sec"] * 3 * trainer["forward_flops_per_image"] / gemm
    worker = (first["parts"].get("worker", {}).get("figures") or {})
    return folder, first["date"], jobs, worker


H200_ROWS = [("fsdp2-zero3-none", "FSDP2 (resharding) + none"), ("fsdp2-zero3-light", "FSDP2 + `light`"),
             ("fsdp2-zero3-selective", "FSDP2 + `selective`"), ("fsdp2-zero3-none-compiled",
                                                                  "FSDP2 + none, blocks compiled"),
             ("deepspeed-zero3-none", "DeepSpeed ZeRO-3 + none"), ("deepspeed-zero3-light",
                                                                   "DeepSpeed ZeRO-3 + `light`"),
             ("deepspeed-zero2-none", "DeepSpeed ZeRO-2 + none"), ("deepspeed-zero1-none", "DeepSpeed ZeRO-1 + none")]


def h200_table(doc: str) -> str:
    folder, date, jobs, worker = h200_jobs()
    rows = [f"On one H200 ({date}{stale_note(folder)}, ViT-L/16 at 224², bf16, micro-batch 256 through `train.py` on "
            f"synthetic data, one repeat each: points, not intervals; [report]({link(folder, doc, 'README.md')})):",
            "", "| configuration | images/s | MFU | peak GiB |", "|---|---|---|---|"]
    for key, name in H200_ROWS:
        j = jobs.get(key)
        if not j or not j.get("images_per_sec"):
            rows.append(f"| {name} | not measured | | |")
            continue
        mfu = f"{j['mfu']:.1%}" if j.get("mfu") is not None else "—"
        rows.append(f"| {name} | {gi(j['images_per_sec'])} | {mfu} | {j['peak_mem_bytes'] / 2**30:.1f} |")
    if worker.get("images_per_sec"):
        rows.append(f"| the benchmark worker's plain FSDP2 (resharding) + none | {gi(worker['images_per_sec'])} | | |")
    ips = lambda key: (jobs.get(key) or {}).get("images_per_sec")  # noqa: E731
    ratios = [f"{ips(f'deepspeed-zero3-{ac}') / ips(f'fsdp2-zero3-{ac}'):.2f}× FSDP2's images/s at `{ac}`"
              for ac in ("none", "light") if ips(f"deepspeed-zero3-{ac}") and ips(f"fsdp2-zero3-{ac}")]
    first = report_dir("gpu-check", "2026-12-04-parts-1-4")
    old = {r["config"]: float(r["images_per_sec"]) for r in json.load(open(os.path.join(first, "vit-l-results.json")))
           ["parts"]["vit-l"]["figures"]["rows"] if r.get("images_per_sec")}
    rows += ["", f"At this micro-batch ZeRO-3 runs at {', '.join(ratios)}; at micro-batch 32 the "
             f"same GPU put it at {old['ZeRO-3 + none'] / old['FSDP2 + none']:.2f}× ([the first check]"
             f"({link(first, doc, 'vit-l-report.md')}), older DeepSpeed sizes)."]
    return "\n".join(rows)


def h200_line(doc: str) -> str:
    folder, date, jobs, worker = h200_jobs()
    ips = {k: j["images_per_sec"] for k, j in jobs.items() if j.get("images_per_sec")}
    light = jobs["fsdp2-zero3-light"]
    compiled = jobs.get("fsdp2-zero3-none-compiled")
    peaks = [jobs[f"{e}-zero3-light"]["peak_mem_bytes"] / jobs[f"{e}-zero3-none"]["peak_mem_bytes"]
             for e in (FSDP2, DEEPSPEED)]
    steps = [ips[f"{e}-zero3-none"] / ips[f"{e}-zero3-light"] for e in (FSDP2, DEEPSPEED)]
    text = (f"- **On one H200** ([GPU check]({link(folder, doc, 'README.md')}), {date}{stale_note(folder)}, ViT-L/16, "
            f"bf16, micro-batch 256 through `train.py`, one repeat each): FSDP2 + `light` {gi(ips['fsdp2-zero3-light'])}"
            f" img/s ({light['mfu']:.1%} MFU)")
    if compiled:
        text += f", with compiled blocks {gi(compiled['images_per_sec'])} ({compiled['mfu']:.1%})"
    text += (f"; DeepSpeed ZeRO-3 {gi(ips['deepspeed-zero3-none'])} ({ips['deepspeed-zero3-none'] / ips['fsdp2-zero3-none']:.2f}× "
             f"FSDP2 at `none`), ZeRO-2 {gi(ips['deepspeed-zero2-none'])}; `light` {pct(max(peaks))} to {pct(min(peaks))} "
             f"peak memory at {pct(min(steps))} to {pct(max(steps))} step time")
    if worker.get("trainer_over_worker"):
        side = "inside" if abs(worker["trainer_over_worker"] - 1) <= 0.05 else "outside"
        text += (f"; `train.py`'s FSDP2 {worker['trainer_over_worker']:.2f}× the benchmark worker's (one repeat, a "
                 f"point {side} the within-5% target: no interval, no verdict)")
    return text + "."


def async_save(doc: str) -> str:
    folder = report_dir("async-save")
    results = runs(folder)
    env = json.load(open(os.path.join(folder, "environment.json")))
    plan = env["plan"]
    of = lambda side, key: by_repeat(results, key, lambda r: r[key], side=side)  # noqa: E731
    ckpt = paired_ratio(of("async", "checkpoint_s"), of("sync", "checkpoint_s"))
    wall = paired_ratio(of("async", "wall_s"), of("sync", "wall_s"))
    med = lambda side: statistics.median(of(side, "checkpoint_s").values())  # noqa: E731
    size = statistics.median(r["checkpoint_bytes"] for r in results if "error" not in r) / 2**20
    return (f"What the background write buys, measured on 2 CPU ranks ({env['date']}{stale_note(folder)}, "
            f"{plan['model']} at {plan['image_size']}², a {size:.0f} MiB checkpoint every 4 steps, {ckpt.n} "
            f"alternating repeats; [report]({link(folder, doc)})): the loop's seconds in checkpoint calls "
            f"{fmt_ratio(ckpt)}× of foreground saves ({med('async'):.2f} s against {med('sync'):.2f} s), the "
            f"launch's wall time {fmt_ratio(wall)}×.")


def trainer_line(doc: str) -> str:
    """train.py against the benchmark worker, per configuration measured (trainer_check's reports)."""
    parts = []
    for sub, name in (("trainer", "ZeRO-2 + none"), (os.path.join("trainer", "zero3-selective"), "ZeRO-3 + selective"),
                      ("trainer-fsdp2", "FSDP2 (resharding) + none")):
        folder = report_dir(sub)
        if not os.path.exists(os.path.join(folder, "environment.json")):  # not run, or still running
            continue
        results = runs(folder)
        of = lambda side: by_repeat(results, "images_per_sec", lambda r: r["images_per_sec"],  # noqa: E731
                                    config=name, side=side)
        r = paired_ratio(of("train.py"), of("worker"))
        if r is None:
            continue
        within = "yes" if r.low >= 0.95 and r.high <= 1.05 else "no" if r.high < 0.95 or r.low > 1.05 else "undecided"
        parts.append(f"{fmt_ratio(r)}× under {name} ([report]({link(folder, doc)}), {env_date(folder)}"
                     f"{stale_note(folder)}; within 5%: {within})")
    return "`train.py` against the benchmark worker's images/s on ViT-S/8, 2 CPU ranks: " + "; ".join(parts) + "."


def planner_suites(doc: str) -> str:
    """plan.py against the committed CPU suites: each suite's planner.json (benchmarks.validate's rows), its peak
    and calibrated step errors and how many rows are within the step target."""
    from benchmarks.validate import STEP_TOLERANCE, unmeasured

    lines = []
    for suite, what in (("cpu", "compute-bound, ViT-S and Swin-T"), ("host", "host-bound, 24 blocks of width 64"),
                        ("race", "host-bound, micro-batches 4-32"), ("host-light", "host-bound, `light`")):
        folder = report_dir(suite)
        rows = json.load(open(os.path.join(folder, "planner.json")))
        missing = unmeasured(os.path.join(folder, "results.csv"))
        if not rows:
            lines.append(f"- `{suite}`: no DeepSpeed row measured")
            continue
        peaks, steps = [r["peak_error"] for r in rows], [r["step_error"] for r in rows]
        within = sum(abs(e) <= STEP_TOLERANCE for e in steps)
        lines.append(f"- `{suite}` ({what}; [planner.md]({link(folder, doc, 'planner.md')}), {env_date(folder)}"
                     f"{stale_note(folder)}): {len(rows) + len(missing)} DeepSpeed rows"
                     + (f" ({len(missing)} not measured)" if missing else "") +
                     f"; peaks {pct1(1 + min(peaks))} to {pct1(1 + max(peaks))} of the measured; calibrated steps "
                     f"{pct1(1 + min(steps))} to {pct1(1 + max(steps))}, {within} of {len(rows) + len(missing)} within "
                     f"{STEP_TOLERANCE:.0%}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the CPU suites, rebuilt from runs
_SUITES = {}


def suite_report(name: str) -> tuple:
    """(folder, suite, rows, results) of a committed train_bench suite: its rows summarised again from runs.jsonl
    with the suite's definition and the runs' own GEMM and FLOP counts, as `train_bench --report_only` does."""
    if name not in _SUITES:
        from benchmarks.report import summarise
        from benchmarks.suites import SUITES

        folder, suite = report_dir(name), SUITES[name]
        results = runs(folder)
        env = json.load(open(os.path.join(folder, "environment.json")))
        flops = env["model_flops_per_image"]  # as the run counted them
        _SUITES[name] = folder, suite, summarise(results, suite.shapes, suite, flops, env["peak_gflops_per_rank"]), \
            results
    return _SUITES[name]


def span(values, fmt=lambda v: f"{v:.2f}") -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"


def short(shape: str) -> str:
    return shape.split(",")[0].split(" (")[0]


def cut(this: dict, none: dict) -> float:
    return 1 - this["activation_mib"] / none["activation_mib"]


def equal_policy(doc: str, bullet: bool = False) -> str:
    """DeepSpeed against FSDP2 at equal policy in the cpu suite: speed and peak ratio ranges."""
    from benchmarks.report import engine_table

    folder, suite, rows, results = suite_report("cpu")
    table = [e for e in engine_table(results, rows, suite) if e["speed"] and not e["policy"].startswith("auto")]
    z3 = [e for e in table if e["ours"]["zero_stage"] == 3]
    z2 = [e for e in table if e["ours"]["zero_stage"] == 2]
    slower = [f"{short(e['shape'])} + {e['policy']}" for e in z3 if e["speed"].high < 1]
    rest = [f"{short(e['shape'])} + {e['policy']}" for e in z3 if e["speed"].high >= 1]
    if not slower:
        verdict = "none decidedly slower"
    elif len(slower) > len(rest):  # the shorter list reads
        verdict = (f"decidedly slower at {len(slower)} of {len(z3)}, all but {', '.join(rest)}" if rest else
                   f"decidedly slower at all {len(z3)}")
    else:
        verdict = f"decidedly slower only at {', '.join(slower)}"
    where = f"[ViT-S, Swin-T]({link(folder, doc)}), {env_date(folder)}{stale_note(folder)}"
    return ((f"- **Compute-bound, at equal policy** ({where}): " if bullet else
             f"On 2 CPU ranks in fp32, compute-bound ({where}; the benchmark worker's FSDP2): ")
            + f"ZeRO-3 {span([e['speed'].ratio for e in z3])}× FSDP2's images/s ("
            + verdict
            + f") at {span([e['memory'].ratio for e in z3])}× its peak; ZeRO-2 {span([e['speed'].ratio for e in z2])}× "
            f"FSDP2 without resharding.")


def benchmark_lines(doc: str) -> str:
    """README's lines on the CPU suites: the engines at equal policy and what the checkpointing buys (cpu), the
    host-bound step and the micro-batch race (host, race)."""
    from benchmarks.race import race_rows
    from benchmarks.report import engine_table, race_table, speed_ratio

    folder, suite, rows, results = suite_report("cpu")
    out = [equal_policy(doc, bullet=True)]
    by = {(r["shape"], r["config"]): r for r in rows if "images_per_sec" in r}
    cuts, steps = [], []
    for shape in suite.shapes:
        for engine in ("FSDP2", "ZeRO-3"):
            none, sel = by.get((shape.label, f"{engine} + none")), by.get((shape.label, f"{engine} + selective"))
            if none and sel and (r := speed_ratio(results, shape.label, none["config"], sel["config"])):
                cuts.append(cut(sel, none))
                steps.append(r.ratio)
    races = [e for e in race_table(results, rows, suite) if e["midpoint"] and e["either_speed"]]
    race = "; ".join(f"{short(e['shape'])} {fmt_ratio(e['either_speed'])}× (ours: {e['either']['config']}, "
                     f"plain: {e['fsdp2']['config']})" for e in races)
    out.append(f"- **The checkpointing, under either engine**: `selective` cuts activations "
               f"{span([100 * c for c in cuts], lambda v: f'{v:.0f}')}% for {pct(min(steps))} to {pct(max(steps))} step time; at the "
               f"midpoint budget between Hugging Face's full checkpointing and none, this project's fastest against "
               f"plain FSDP2's fastest (both at micro-batch 32): {race}.")
    folder, suite, rows, results = suite_report("host")
    host = {e["ours"]["config"]: speed_ratio(results, e["shape"], e["fsdp2"]["config"], e["ours"]["config"])
            for e in engine_table(results, rows, suite) if e["speed"]}
    rfolder, rsuite, rrows, rresults = suite_report("race")
    mid = [e for e in race_rows(rsuite, rrows, rresults) if e["fraction"] == 0.5]
    low = [e for e in race_rows(rsuite, rrows, rresults) if e["fraction"] == 0]
    text = (f"- **Host-bound** ([host]({link(folder, doc)}), {env_date(folder)}{stale_note(folder)}; [race]"
            f"({link(rfolder, doc)}), {env_date(rfolder)}{stale_note(rfolder)}): host time per step against FSDP2's, "
            f"ZeRO-2 {fmt_ratio(host['ZeRO-2 + none'])}×, ZeRO-3 {fmt_ratio(host['ZeRO-3 + none'])}× (`none`)")
    for e in mid:
        if e["ours_ratio"]:
            text += (f"; free to pick the micro-batch at the midpoint budget ({e['budget_mib']:.0f} MiB), this "
                     f"project's best ({e['ours']}) is {fmt_ratio(e['ours_ratio'])}× plain FSDP2's ({e['plain']})")
        if e["trainer_ratio"]:  # the race's last phase: the same configuration run by train.py itself
            text += (f", and {fmt_ratio(e['trainer_ratio'])}× run by train.py itself ({e['trainer_speed']:.1f} "
                     f"images/s, {fmt_ratio(e['trainer_vs_worker'])}× the worker's)")
    for e in low:
        if e["ours_ratio"]:
            text += f"; at the smallest budget ({e['budget_mib']:.0f} MiB) {fmt_ratio(e['ours_ratio'])}×"
    out.append(text + ".")
    return "\n".join(out)


def ac_costs(doc: str) -> str:
    """docs/activation_checkpointing.md's table: each policy's activations and step time against `none`, per
    shape and engine, in the cpu suite."""
    from benchmarks.report import speed_ratio

    folder, suite, rows, results = suite_report("cpu")
    by = {(r["shape"], r["config"]): r for r in rows if "images_per_sec" in r}
    lines = [f"Measured in the `cpu` suite ({env_date(folder)}{stale_note(folder)}, 2 CPU ranks, fp32, micro-batch 32; "
             f"[report]({link(folder, doc)})): activation bytes (the profiler's) and step time against `none` under the "
             "same engine, the step time as a paired ratio with its 95% interval over the repeats.", "",
             "| shape | policy | FSDP2: activations | FSDP2: step time | ZeRO-3: activations | ZeRO-3: step time |",
             "|---|---|---|---|---|---|"]
    for shape in suite.shapes:
        for ac in ("selective", "every_n:2", "hierarchical", "full"):
            cells = []
            for engine in ("FSDP2", "ZeRO-3"):
                none, this = by.get((shape.label, f"{engine} + none")), by.get((shape.label, f"{engine} + {ac}"))
                r = speed_ratio(results, shape.label, none["config"], this["config"]) if none and this else None
                cells += [f"{-cut(this, none):+.0%}".replace("-", "−"), fmt_ratio(r) + "×"] if r else ["", ""]
            if any(cells):
                lines.append(f"| {short(shape.label)} | `{ac}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def light_figures(doc: str) -> str:
    """`light` against `none` and `selective` on the host-bound shape (host-light): activations and host time."""
    from benchmarks.report import speed_ratio

    folder = report_dir("host-light")
    results = runs(folder)
    shape = results[0]["shape"]
    acts = lambda run: statistics.median(max(r["activation_bytes"]) for r in results  # noqa: E731
                                         if r["run"] == run and "error" not in r)
    parts = []
    for engine in ("FSDP2", "ZeRO-3"):
        none = acts(f"{engine} + none")
        parts.append(f"{engine}: `light` {1 - acts(f'{engine} + light') / none:.0%} fewer activation bytes than `none` "
                     f"(`selective` {1 - acts(f'{engine} + selective') / none:.0%}), host time per step "
                     f"{fmt_ratio(speed_ratio(results, shape, f'{engine} + none', f'{engine} + light'))}× `none`'s "
                     f"(`selective` {fmt_ratio(speed_ratio(results, shape, f'{engine} + none', f'{engine} + selective'))}×)")
    return (f"On the host-bound shape ({shape.split(',')[0]}, 2 CPU ranks, fp32, {env_date(folder)}"
            f"{stale_note(folder)}, `train_bench --suite host-light`, [report]({link(folder, doc, 'results.md')})): "
            + "; ".join(parts) + ".")


def planner_cpu_rows(doc: str) -> str:
    """docs/planner.md: the cpu suite's FSDP2 rows against what they planned with, and `auto:B` against its
    budget and against its engine's fastest fixed policy that fits."""
    from benchmarks.report import speed_ratio

    folder, suite, rows, results = suite_report("cpu")
    have = [r for r in rows if "images_per_sec" in r]
    fsdp2 = [r["planned_error"] for r in have if r["engine"] == FSDP2 and not r["ac"].startswith("hf:")
             and r.get("planned_error") not in (None, "")]
    autos = []
    for r in (r for r in have if r["ac"].startswith("auto") and r.get("budget_gib")):
        budget = r["budget_gib"] * 1024
        fixed = [x for x in have if x["shape"] == r["shape"] and (x["engine"], x["zero_stage"], x["reshard"]) ==
                 (r["engine"], r["zero_stage"], r["reshard"]) and not x["ac"].startswith(("auto", "hf:"))
                 and x["peak_alloc_mib"] <= budget]
        fastest = max(fixed, key=lambda x: x["images_per_sec"]) if fixed else None
        ratio = speed_ratio(results, r["shape"], r["config"], fastest["config"]) if fastest else None
        autos.append(f"{r['config'].split(' + ')[0]} {pct1(r['peak_alloc_mib'] / budget)} of its {budget:.0f} MiB "
                     + (f"at {fmt_ratio(ratio)}× the images/s of {fastest['config']}" if ratio else
                        "(no fixed policy of its engine fits)"))
    return (f"In the `cpu` suite ({env_date(folder)}{stale_note(folder)}; [results]({link(folder, doc, 'results.md')}))"
            f" the FSDP2 rows with this project's checkpointing were planned (FSDP2's accounting) at {pct1(1 + min(fsdp2))}"
            f" to {pct1(1 + max(fsdp2))} of their measured peaks (results.csv's `planned_error`), and `auto:B` peaked at "
            + "; ".join(autos) + ".")


@functools.cache
def h200_planner_errors() -> tuple:
    """(folder, date, {job: (peak error, step error)}): plan.py's estimate of each train.py job of the second GPU
    check (uncalibrated, the H200's datasheet, 40% MFU) against what the job measured."""
    from config import Config
    from engine.registry import engine_class
    from planner.devices import DEVICES
    from planner.estimate import estimate

    folder = report_dir("gpu-check", "2026-12-04-v2")
    report = json.load(open(os.path.join(folder, "results.json")))
    out = {}
    for name, job in report["parts"]["trainer"]["figures"]["jobs"].items():
        cfg = Config(model="vit-large", image_size=224, patch_size=16, num_labels=1000, precision="bf16",
                     engine=job["engine"], zero_stage=job["zero_stage"], ac=job["ac"],
                     micro_batch_size=job["micro_batch_size"])
        engine_config = engine_class(cfg.engine).engine_config(cfg, 1024, 1, "bf16", 1, gpu=True)
        e = estimate(cfg, engine_config, "bf16", 1, 1, DEVICES["h200"])
        out[name] = (e["peak_bytes"] / job["peak_mem_bytes"] - 1,
                     e["step_s"] / (job["micro_batch_size"] / job["images_per_sec"]) - 1)
    return folder, report["date"], out


def planner_h200(doc: str) -> str:
    folder, date, errors = h200_planner_errors()
    parts = []
    for engine, what in (("deepspeed", "DeepSpeed"), ("fsdp2", "FSDP2")):
        mine = {k: v for k, v in errors.items() if k.startswith(engine)}
        peaks, steps = [v[0] for v in mine.values()], [v[1] for v in mine.values()]
        parts.append(f"{what} ({', '.join(sorted(k.split('-', 1)[1] for k in mine))}) within {pct1(1 + min(peaks))} "
                     f"to {pct1(1 + max(peaks))} of the allocator's peak and {pct1(1 + min(steps))} to "
                     f"{pct1(1 + max(steps))} of the step")
    return (f"On one H200 ({date}{stale_note(folder)}, ViT-L/16 at 224², bf16, micro-batch 256 through train.py, "
            f"uncalibrated: 40% MFU assumed; [report]({link(folder, doc, 'README.md')})): " + "; ".join(parts) +
            " (`tests/unit/test_planner_model.py::test_the_planner_predicts_the_h200_runs` holds them to 5% and 25%).")


def task_memory(doc: str) -> str:
    folder = report_dir("task-memory")
    jobs = [j for j in json.load(open(os.path.join(folder, "results.json"))) if j.get("error") is not None]
    date = json.load(open(os.path.join(folder, "environment.json")))["date"]
    mae = [j["error"] for j in jobs if j["task"] == "mae"]
    rest = [j["error"] for j in jobs if j["task"] != "mae"]
    return (f"The other tasks, on shapes no suite runs (`python -m benchmarks.task_memory`, {date}{stale_note(folder)}, "
            f"[report]({link(folder, doc)})): {len(mae)} MAE ViT-S/8 jobs under ZeRO 1-3 and three policies within "
            f"{pct1(1 + min(mae))} to {pct1(1 + max(mae))} of the measured peak; {len(rest)} SimMIM (ViT-S, Swin-T), "
            f"UperNet and SegFormer-B0 jobs within {pct1(1 + min(rest))} to {pct1(1 + max(rest))}.")


def planner_line(doc: str) -> str:
    """README's line on the planner: the committed suites' planner.json and the H200 jobs."""
    from benchmarks.validate import STEP_TOLERANCE

    def rows_of(suite):
        return json.load(open(os.path.join(report_dir(suite), "planner.json")))

    cpu = rows_of("cpu")
    host = rows_of("host") + rows_of("race")
    within = sum(abs(r["step_error"]) <= STEP_TOLERANCE for r in host)
    saved = [os.path.join(report_dir(suite), "calibration.json") for suite in ("host", "race")]
    reprobed = any(c.get("host_replaces_run") for path in saved if os.path.exists(path)
                   for c in json.load(open(path)).values())
    probe = ("the host probed at validation, in place of the runs' own probes ([why](benchmarks/results/"
             "planner-analysis/2026-12-03.md))" if reprobed else "the runs' own host probe")
    _, date, errors = h200_planner_errors()
    return (f"- **Plan before you run** ([planner](docs/planner.md)): on the compute-bound `cpu` suite, peaks "
            f"{pct1(1 + min(r['peak_error'] for r in cpu))} to {pct1(1 + max(r['peak_error'] for r in cpu))} and "
            f"calibrated steps {pct1(1 + min(r['step_error'] for r in cpu))} to "
            f"{pct1(1 + max(r['step_error'] for r in cpu))} of the measured; host-bound steps within "
            f"{STEP_TOLERANCE:.0%} in {within} of {len(host)} rows with {probe} (the host-bound peaks"
            f", tens of MiB, {pct(1 + min(r['peak_error'] for r in host))} to "
            f"{pct(1 + max(r['peak_error'] for r in host))}); on one H200 ({date}) at ViT-L/16's micro-batch 256, "
            f"peaks {pct1(1 + min(e[0] for e in errors.values()))} to {pct1(1 + max(e[0] for e in errors.values()))}"
            f" and steps {pct1(1 + min(e[1] for e in errors.values()))} to "
            f"{pct1(1 + max(e[1] for e in errors.values()))} ({len(errors)} configurations, both engines).")


def digits_tasks(doc: str) -> str:
    """docs/models.md: each task's digits recipe trained to the end (benchmarks.digits_tasks's runs)."""
    folder = report_dir("digits-tasks")
    date = re.search(r"\((\d{4}-\d\d-\d\d)\)", open(os.path.join(folder, "results.md")).readline()).group(1)
    lines = [f"`python -m benchmarks.digits_tasks` trains each task's digits recipe to the end on 2 CPU ranks "
             f"([report]({link(folder, doc, 'results.md')}), {date}{stale_note(folder)}, one seed each):", "",
             "| run | recipe | steps | result |", "|---|---|---|---|"]
    for r in runs(folder):
        ev, last = r["evals"], r["evals"][-1]
        recipe = f"`{r['recipe']}`" + (f" `{' '.join(o for o in r['overrides'] if not o.startswith('/'))}`"
                                       if r["overrides"] and r["overrides"][0] == "--model" and
                                       not r["overrides"][1].startswith("/") else "")
        if "val_loss" in last:
            result = f"val loss {ev[0]['val_loss']:.3f} at step {ev[0]['step']}, {last['val_loss']:.3f} at {last['step']}"
        elif "val_miou" in last:
            result = f"val mIoU {last['val_miou']:.2%}, pixel accuracy {last['val_pixel_acc']:.2%}"
        else:
            result = f"val top-1 {last['val_top1']:.2%} ({ev[0]['val_top1']:.2%} at step {ev[0]['step']})"
        lines.append(f"| {r['label']} | {recipe} | {r['summary']['step']} | {result} |")
    tuned = [r for r in runs(folder) if r["recipe"].endswith("mae-finetune.yaml")]
    if len(tuned) == 2:  # from the MAE encoder, then from random weights
        first, last = (100 * (tuned[0]["evals"][i]["val_top1"] - tuned[1]["evals"][i]["val_top1"]) for i in (0, -1))
        lines += ["", f"The pretrained encoder starts fine-tuning {first:.0f} points ahead (step "
                      f"{tuned[0]['evals'][0]['step']}) and ends {last:.1f} points ahead at step "
                      f"{tuned[0]['evals'][-1]['step']}; one seed, so the gap is indicative, not a measured effect size."]
    return "\n".join(lines)


def scaling(doc: str) -> str:
    """docs/sweeps.md: the scaling-law fits on the digits (benchmarks.scaling's analysis.json): each law's held-out
    prediction, its interval and verdict (met, missed, degenerate or not measured)."""
    folder = report_dir("scaling")
    a = json.load(open(os.path.join(folder, "analysis.json")))
    grid = runs(folder)
    steps = sorted({r["steps"] for r in grid})
    seeds = sorted({r.get("seed", 0) for r in grid})
    sizes = sorted({r["size"] for r in grid}, key=lambda s: next(r["params"] for r in grid if r["size"] == s))
    noise = math.expm1(math.sqrt(a["noise"]["variance_of_a_mean"]))

    def law(name: str, f: dict) -> str:
        held = f["held_out"]
        said = f"**{f['verdict']}**" + (f" ({f['why']})" if f["why"] else "")
        return (f"the {name} predicts {held['size']} at {held['steps']} steps at {f['predicted']:.3f} "
                f"[{f['interval'][0]:.3f}, {f['interval'][1]:.3f}], measured {held['error']:.3f}: {said}")

    text = (f"**The digits, {a['date']}** ([report]({link(folder, doc)}){stale_note(folder)}, {len(grid)} runs: "
            f"{', '.join(sizes)} x {', '.join(map(str, steps))} steps x {len(seeds)} seeds; a point's error varies "
            f"by about {noise:.0%} from seed to seed): {law('two-term law', a['two_term'])}; "
            f"{law('frontier law', a['frontier'])}")
    cov = a.get("coverage")
    if cov:
        def held(name):
            said = cov[name]
            measured = said.get("met", 0) + said.get("missed", 0)
            return (f"{said.get('met', 0)} of {measured} measured ({said.get('degenerate', 0)} of "
                    f"{sum(said.values())} degenerate)")

        text += (f". On synthetic grids of this design and noise drawn from known laws, the two-term law's interval "
                 f"held the held-out point in {held('two_term')}, the frontier law's in {held('frontier')}")
    if a["optimal"].get("at_bound"):
        text += "; fitted on every point the two-term law is degenerate too, so it names no compute-optimal size"
    elif a["optimal"].get("at_edge"):
        text += "; the two-term law names no compute-optimal size (its minimum lies at the search's edge)"
    return text + "."


def sequence_line(doc: str) -> str:
    """docs/sequence_parallel.md: sp_size 2 against sp_size 1 on CPU (benchmarks.sequence_bench's runs), and the
    digits job split over two ranks against it on one (benchmarks/results/sequence/digits)."""
    from benchmarks.report import peak_ratio
    from benchmarks.sequence_bench import LABEL, mean_interval, shares

    folder = report_dir("sequence")
    results = [r for r in runs(folder) if "error" not in r]
    parts = []
    for label in ("FSDP2", "ZeRO-3"):
        base = f"{label} sp 1 @ 1"
        same = (speed_ratio(results, LABEL, f"{label} sp 2 @ 2", base),
                peak_ratio(results, LABEL, f"{label} sp 2 @ 2", base))
        half = peak_ratio(results, LABEL, f"{label} sp 2 @ 1", base)
        parts.append(f"under {label}, the same two images per step {fmt_ratio(same[0])}× the images/s at "
                     f"{fmt_ratio(same[1])}× the peak, one image split over the two ranks {fmt_ratio(half)}× the peak")
    measured = {label: mean_interval(values) for label, values in shares(folder).items() if values}
    if measured:
        parts.append("the split's own collectives (the all-to-alls, the gather and the waits on them) "
                     + ", ".join(f"{m:.1%} [{lo:.1%}, {hi:.1%}] of a traced step under {label}"
                                 for label, (m, lo, hi) in measured.items()))
    digits = os.path.join(folder, "digits")
    ends = {name: json.load(open(os.path.join(digits, f"{name}.json"))) for name in ("split", "one-rank")}
    conv = report_dir("convergence")
    top1 = {}
    for r in runs(conv):
        top1.setdefault(r["config"], []).append(r["val_top1"])
    seeds = "; ".join(f"{label} {statistics.fmean(v):.2%} ± {statistics.stdev(v):.2%}" for label, v in top1.items()
                      if label.startswith("FSDP2"))
    return (f"On 2 CPU ranks ({LABEL}, [report]({link(folder, doc)}), {env_date(folder)}{stale_note(folder)}): "
            + "; ".join(parts) + f". The digits job to the end (900 steps, global batch 64): split over two ranks "
            f"{ends['split']['val_top1']:.2%} val top-1, on one rank without the split "
            f"{ends['one-rank']['val_top1']:.2%} ([runs]({link(digits, doc, 'README.md')})); over "
            f"{len(next(iter(top1.values())))} seeds each ([convergence]({link(conv, doc, 'results.md')}), "
            f"{env_date(conv)}{stale_note(conv)}): {seeds}.")


def ds_tuning(doc: str) -> str:
    """docs/benchmarks.md: each DeepSpeed knob against the config as shipped (benchmarks.ds_tuning's runs), on
    ViT-S and on the host-bound shape, and no persistent parameters under ZeRO-3."""
    from benchmarks.report import peak_of

    lines = ["| shape | ZeRO | variant | images/s vs shipped | peak vs shipped |", "|---|---|---|---|---|"]
    sources = []
    for sub, shape in (("ds-tuning-vit-s", "ViT-S/8"), ("ds-tuning-host", "host"),
                       (os.path.join("ds-tuning-persistence", "vit-s"), "ViT-S/8"),
                       (os.path.join("ds-tuning-persistence", "host"), "host")):
        folder = report_dir(sub)
        results = runs(folder)
        head = open(os.path.join(folder, "report.md")).read()
        date = re.search(r"\d{4}-\d\d-\d\d", head).group(0)
        sources.append(f"[{sub.replace(os.sep, '/')}]({link(folder, doc)}) ({date}{stale_note(folder)})")
        for stage in sorted({r["stage"] for r in results}):
            of = lambda name, value: by_repeat(results, "variant", value, stage=stage, variant=name)  # noqa: E731
            for name in dict.fromkeys(r["variant"] for r in results if r["stage"] == stage):
                if name == "as shipped":
                    continue
                speed = paired_ratio(of(name, lambda r: r["images_per_sec"]),
                                     of("as shipped", lambda r: r["images_per_sec"]))
                peak = paired_ratio(of(name, peak_of), of("as shipped", peak_of))
                lines.append(f"| {shape} | {stage} | {name} | {fmt_ratio(speed)} | {fmt_ratio(peak)} |")
    return ("Each variant against the config as shipped at the time, 2 CPU ranks, fp32, 5 alternating repeats, "
            "paired ratios with 95% intervals (above 1: faster, or larger); reports: " + ", ".join(sources) +
            ".\n\n" + "\n".join(lines))


def clean_clone(doc: str) -> str:
    """README's quick start: the newest clean clone whose `make train` output is committed beside the clean-clone
    report (make-train-<commit>.txt): its two commands' times, the range of the main job's val top-1 over every
    clean clone recorded, and that output."""
    folder = report_dir("clean-clone")
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in open(os.path.join(folder, "report.md"))
             if line.startswith("| 20")]
    top1 = [float(m.group(1)) for row in table if (m := re.match(r"(\d+\.\d+)%", row[4]))]
    output = lambda row: os.path.join(folder, f"make-train-{row[1].split()[0]}.txt")  # noqa: E731
    row = next(row for row in reversed(table) if os.path.exists(output(row)))
    date, commit, train, steps, _, test = row
    commit, duration = commit.split()[0], r"(\d+m\d+s)"
    with open(output(row)) as f:
        printed = f.read().rstrip("\n").splitlines()
    shown = [line for line in printed if len(line) <= 160]  # the start-up line (model, engine, batch) left out
    text = (f"From a clean clone of `{commit}` ({date}), `make train` took {re.search(duration, train).group(1)} with "
            f"the install (its 900 steps {re.search(duration, steps).group(1)}) and `make test` "
            f"{re.search(r'in ' + duration, test).group(1)}. The last bits of a CPU's fp32 rounding steer the run, "
            f"which has ended between {min(top1):.2f}% and {max(top1):.2f}% in the {len(top1)} clean clones recorded "
            f"([timings]({link(folder, doc)})). That clone's `make train` ended:")
    return "\n".join(textwrap.wrap(text, 116, break_long_words=False, break_on_hyphens=False)) + "\n\n```\n" + "\n".join(shown) + "\n```"


def faults_line(doc: str) -> str:
    """README: the fault-injection reports' totals (benchmarks.fault_injection's episodes.jsonl), per engine."""
    parts = []
    for sub, engine in (("faults", "DeepSpeed"), ("faults-fsdp2", "FSDP2")):
        folder = report_dir(sub)
        episodes = runs_of_file(os.path.join(folder, "episodes.jsonl"))
        date = re.search(r"\d{4}-\d\d-\d\d", open(os.path.join(folder, "report.md")).readline()).group(0)
        losses = [e for e in episodes if e.get("losses_equal") is not None]
        weights = [e for e in episodes if e.get("weights_equal") is not None]
        parts.append(f"{engine}: {len(episodes)} episodes of {len({e['kind'] for e in episodes})} kinds "
                     f"([report]({link(folder, doc)}), {date}{stale_note(folder)}), {sum(bool(e['finished']) for e in episodes)}"
                     f" finished, losses equal to the uninterrupted run in {sum(bool(e['losses_equal']) for e in losses)}"
                     f" of {len(losses)} compared, weights in {sum(bool(e['weights_equal']) for e in weights)} of "
                     f"{len(weights)}, {sum(bool(e['lost']) for e in episodes)} with anything lost")
    return "Measured: " + "; ".join(parts) + "."


def runs_of_file(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def convergence_line(doc: str) -> str:
    """README: the digits job to the end per engine (benchmarks.convergence's runs), val top-1 mean ± std."""
    folder = report_dir("convergence")
    results, env = runs(folder), json.load(open(os.path.join(folder, "environment.json")))
    cells = []
    for label in dict.fromkeys(r["config"] for r in results):
        top1 = [r["val_top1"] for r in results if r["config"] == label]
        cells.append(f"{label} {statistics.fmean(top1):.2%} ± {statistics.stdev(top1):.2%}")
    seeds = len({r["seed"] for r in results})
    return (f"- **Convergence** ([report]({link(folder, doc, 'results.md')}), {env['date']}{stale_note(folder)}): the "
            f"digits job to the end, {seeds} seeds each, val top-1 mean ± standard deviation: " + "; ".join(cells) +
            ".")


def sweep_digits(doc: str) -> str:
    """docs/sweeps.md: the shipped digits study's last run, from the report sweep.py wrote (its trial count, the
    recipe against the trials that beat it, what the planner screened out) and its pictures."""
    folder = report_dir("sweep-digits")
    text = open(os.path.join(folder, "report.md")).read()
    started = re.search(r"^Started (\S+) \S+ at commit (\w+)", text, re.M)
    counts = re.search(r"^(\d+ trials: [^.]*)\.", text, re.M).group(1)
    wanted = [line for line in text.splitlines() if line.startswith(("The recipe's own values", "Screened by",
                                                                    "Best"))]
    pictures = [name for name in ("pareto.png", "importances.png", "history.png")
                if os.path.exists(os.path.join(folder, name))]
    return (f"**The shipped study, {started.group(1)}** (`configs/sweeps/digits.yaml` at `{started.group(2)}`"
            f"{stale_note(folder)}; [report]({link(folder, doc)})): {counts}. " + " ".join(wanted) + "\n\n" +
            " ".join(f"![{name}]({link(folder, doc, name)})" for name in pictures))


RENDERERS = {"policy-table": policy_table, "h200-table": h200_table, "h200-line": h200_line,
             "async-save": async_save, "trainer-line": trainer_line, "planner-suites": planner_suites,
             "benchmark-lines": benchmark_lines, "ac-costs": ac_costs, "light-figures": light_figures,
             "equal-policy": equal_policy, "planner-cpu-rows": planner_cpu_rows, "planner-h200": planner_h200,
             "task-memory": task_memory, "planner-line": planner_line, "digits-tasks": digits_tasks,
             "scaling": scaling, "ds-tuning": ds_tuning,
             "clean-clone": clean_clone, "faults-line": faults_line,
             "convergence-line": convergence_line, "sweep-digits": sweep_digits, "sequence-line": sequence_line}


def worked_plan(doc: str, name: str) -> str:
    """docs/planner.md: a worked plan's search as plan.py --out kept it (docs/plans/<name>/search.md): the command,
    the table of the fastest configurations, the fastest of each tensor-parallel size and engine, and why the best
    won."""
    folder = os.path.join(REPO, "docs", "plans", name)
    command, _, searched = open(os.path.join(folder, "search.md")).read().partition("\n\n")
    lines = searched.rstrip("\n").split("\n")
    table = [line for line in lines if line.startswith("|")]
    picks, keep = [], False
    for line in lines:
        if line.startswith("the fastest of each"):
            keep = True
        elif line == "best:":
            keep = False
        if keep or line.startswith(("why:", "passed over:")):
            picks.append(line)
    words, wrapped = command.split(" "), [""]
    for word in words:  # the command, wrapped at 110 characters with shell continuations
        if len(wrapped[-1]) + len(word) > 110:
            wrapped[-1] += "\\"
            wrapped.append("    ")
        wrapped[-1] += word + " "
    return "\n".join(["```", "\n".join(w.rstrip() if not w.endswith("\\") else w for w in wrapped), "```", "",
                      lines[0], "", *table, "", "```", *[p for p in picks if p], "```"])


# ----------------------------------------------------------------------------- the command
def render(doc: str, text: str) -> tuple[str, list]:
    """(the text with every figure block rendered again, the names of the blocks whose text changed)."""
    changed = []

    def one(m):
        name = m.group(2)
        if name.startswith("plan-"):  # a worked plan: docs/plans/<name>/search.md
            body = worked_plan(doc, name[len("plan-"):]).rstrip("\n") + "\n"
        elif name not in RENDERERS:
            raise KeyError(f"{doc}: unknown figure block {name!r} (known: {', '.join(RENDERERS)}, plan-<dir>)")
        else:
            body = RENDERERS[name](doc).rstrip("\n") + "\n"
        if body != m.group(3):
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def mark_stale(folder: str, since: str, why: str):
    """Write `**Stale** since <commit>: <why>` under the title of the report in `folder` (replacing an older one)."""
    for name in ("report.md", "results.md", "README.md"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            break
    else:
        raise FileNotFoundError(f"{folder}: no report.md, results.md or README.md")
    text = open(path).read()
    line = f"**Stale** since `{since}`: {why}"
    if STALE.search(text.split("\n## ", 1)[0]):
        text = STALE.sub(line, text, count=1)
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{line}\n{rest}"
    with open(path, "w") as f:
        f.write(text)
    return path


def main(argv=None, root: str = REPO):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a block disagrees")
    parser.add_argument("--stale", metavar="DIR", help="mark the report in DIR stale (with --since and --why)")
    parser.add_argument("--since", help="the commit that changed the report's measured path")
    parser.add_argument("--why", help="what changed, in a few words")
    a = parser.parse_args(argv)
    if a.stale:
        if not (a.since and a.why):
            parser.error("--stale needs --since COMMIT and --why TEXT")
        print(f"marked stale: {mark_stale(a.stale, a.since, a.why)} (the docs' figures from it say so once rewritten)")
        return 0
    disagree = []
    for doc in DOCS:
        path = os.path.join(root, doc)
        text = open(path).read()
        new, changed = render(doc, text)
        if changed:
            disagree += [f"{doc}: {name}" for name in changed]
            if not a.check:
                with open(path, "w") as f:
                    f.write(new)
    if a.check:
        if disagree:
            print("figures that disagree with their reports (python -m benchmarks.docs rewrites them):\n  "
                  + "\n  ".join(disagree), file=sys.stderr)
            return 1
        print("every figure block agrees with its report")
        return 0
    print("rewritten: " + (", ".join(disagree) if disagree else "nothing (every block agreed)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
