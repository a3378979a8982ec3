"""The measured figures of README.md and docs/, rendered from the committed reports.

    .venv/bin/python -m benchmarks.docs            # rewrite every figure block from benchmarks/results/
    .venv/bin/python -m benchmarks.docs --check    # exit 1, naming the blocks, where a doc disagrees with its report
    .venv/bin/python -m benchmarks.docs --stale benchmarks/results/cpu --since d3e7005 --why "the float64 norm"

A figure block in a Markdown file is the text between `<!-- figures: NAME -->` and `<!-- /figures -->`; RENDERERS
maps each NAME to the function that writes it from a report's machine-readable files (runs.jsonl, results.csv,
results.json), with the report's date, and with **stale** when the report's own header says so. A report is
marked stale in its header (`--stale`: a line `**Stale** since <commit>: <why>` under its title) when code on its
measured path changed after it ran; the CHANGELOG says so too. tests/test_docs_figures.py runs `--check`.
"""
import argparse
import csv
import json
import os
import re
import statistics
import sys

from benchmarks.measure import REPO
from benchmarks.report import MIN_REPEATS, fmt_ratio, paired_ratio, speed_ratio

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
            "| a little short of memory, GPU | `light` | norms' and activations' outputs recomputed, no matmul "
            "(ViT-S/8: −37% activations, [docs](docs/activation_checkpointing.md#light-the-same-idea-without-a-"
            "dispatch-mode)); host time per step below |",
            f"| a little short of memory | `selective` | ViT-S: {cell(vit, 'selective')}; Swin-T: "
            f"{cell(swin, 'selective')} |",
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
    return "\n".join(rows)


def h200_line(doc: str) -> str:
    folder, date, jobs, worker = h200_jobs()
    ips = {k: j["images_per_sec"] for k, j in jobs.items() if j.get("images_per_sec")}
    light, none = jobs["fsdp2-zero3-light"], jobs["fsdp2-zero3-none"]
    compiled = jobs.get("fsdp2-zero3-none-compiled")
    peaks = [jobs[f"{e}-zero3-light"]["peak_mem_bytes"] / jobs[f"{e}-zero3-none"]["peak_mem_bytes"]
             for e in ("fsdp2", "deepspeed")]
    steps = [ips[f"{e}-zero3-none"] / ips[f"{e}-zero3-light"] for e in ("fsdp2", "deepspeed")]
    text = (f"- **On one H200** ([GPU check]({link(folder, doc, 'README.md')}), {date}{stale_note(folder)}, ViT-L/16, "
            f"bf16, micro-batch 256 through `train.py`, one repeat each): FSDP2 + `light` {gi(ips['fsdp2-zero3-light'])}"
            f" img/s ({light['mfu']:.1%} MFU)")
    if compiled:
        text += f", with compiled blocks {gi(compiled['images_per_sec'])} ({compiled['mfu']:.1%})"
    text += (f"; DeepSpeed ZeRO-3 {gi(ips['deepspeed-zero3-none'])} ({ips['deepspeed-zero3-none'] / ips['fsdp2-zero3-none']:.2f}× "
             f"FSDP2 at `none`), ZeRO-2 {gi(ips['deepspeed-zero2-none'])}; `light` {pct(max(peaks))} to {pct(min(peaks))} "
             f"peak memory at {pct(min(steps))} to {pct(max(steps))} step time")
    if worker.get("trainer_over_worker"):
        verdict = "met" if abs(worker["trainer_over_worker"] - 1) <= 0.05 else "missed"
        text += (f"; `train.py`'s FSDP2 {worker['trainer_over_worker']:.2f}× the benchmark worker's ({verdict}: "
                 f"within 5%)")
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


RENDERERS = {"policy-table": policy_table, "h200-table": h200_table, "h200-line": h200_line,
             "async-save": async_save, "trainer-line": trainer_line, "planner-suites": planner_suites}


# ----------------------------------------------------------------------------- the command
def render(doc: str, text: str) -> tuple[str, list]:
    """(the text with every figure block rendered again, the names of the blocks whose text changed)."""
    changed = []

    def one(m):
        name = m.group(2)
        if name not in RENDERERS:
            raise KeyError(f"{doc}: unknown figure block {name!r} (known: {', '.join(RENDERERS)})")
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
