"""The micro-batch race, the way GPUs run it: at a fixed global batch and a per-rank memory budget, every
configuration chooses its micro-batch, accumulation and checkpointing policy, and the fastest that fits on
each side is compared.

Plain FSDP2 chooses among no checkpointing and Hugging Face's (full, every N) with and without resharding;
this project chooses any of its policies under DeepSpeed ZeRO-2/3, or under FSDP2. Less activation memory
buys a larger micro-batch, and on a host-bound shape a larger micro-batch is what raises images/s: the claim's
mechanism. A suite with a `global_batch` (benchmarks/suites.py) runs in two phases: one screening repeat
runs every configuration once, which measures its peak (deterministic) and a first images/s; then the
confirmation repeats run, in alternating order, only the finalists: the fastest `FINALISTS` of each side that
fit each budget. The ratios come from the confirmation repeats alone, so the repeat that chose a finalist
does not also judge it. A last phase runs what a user gets: this project's fastest at each budget through
train.py itself (synthetic data, the same micro-batch and accumulation), paired in alternating order with plain
FSDP2's fastest through the worker, and the midpoint's fastest through the worker too (train.py against the
worker on one configuration).
"""
import statistics

from benchmarks.report import both, by_repeat, fmt_ratio, judged, paired_ratio, peak_of, straddles
from benchmarks.suites import DEEPSPEED, MiB, Run, Suite, runs_of

FINALISTS = 2  # per side and budget
BUDGET_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the way from FSDP2 + HF full AC's peak to plain FSDP2's
TARGET = 1.15  # this project's fastest over plain FSDP2's fastest, at the midpoint budget
TRAINER_TOLERANCE = 0.05  # train.py against the worker on the same configuration
TRAINER = " [train.py]"  # a configuration's name in the last phase, run through train.py
BESIDE = " [worker, train.py phase]"  # ... and through the worker in that phase: the repeats train.py pairs with


def largest_micro(suite: Suite, shape) -> int:
    return max(run.micro for run in runs_of(suite, shape))


def side(run: Run) -> str:
    return "plain" if run.plain else "ours"


def budgets(suite: Suite, shape, peaks: dict) -> list:
    """(fraction, MiB) per budget: from plain FSDP2 + HF full AC's peak to plain FSDP2's, both at the largest
    micro-batch; `peaks`: {config name: MiB}. The midpoint (0.5) is the target's."""
    m = largest_micro(suite, shape)
    low = peaks.get(Run("fsdp2", "hf:full", micro=m).name)
    high = peaks.get(Run("fsdp2", "none", micro=m).name)
    if low is None or high is None:
        return []
    return [(f, low + f * (high - low)) for f in BUDGET_FRACTIONS]


def screening(results: list, shape_label: str) -> dict:
    """{config: (peak MiB, images/s)} from the screening repeat (repeat 0)."""
    return {r["run"]: (peak_of(r) / MiB, r["images_per_sec"]) for r in results
            if r["shape"] == shape_label and r["repeat"] == 0 and "error" not in r}


def finalists(suite: Suite, shape, results: list) -> set:
    """The configurations the confirmation repeats run: per budget, the fastest FINALISTS of each side that
    fit it in the screening repeat, and the two that set the budgets."""
    runs = {run.name: run for run in runs_of(suite, shape)}
    screened = {k: v for k, v in screening(results, shape.label).items() if k in runs}
    peaks = {k: v[0] for k, v in screened.items()}
    m = largest_micro(suite, shape)
    chosen = {Run("fsdp2", "hf:full", micro=m).name, Run("fsdp2", "none", micro=m).name} & set(screened)
    for _, budget in budgets(suite, shape, peaks):
        for which in ("plain", "ours"):
            fit = [k for k, (peak, _) in screened.items() if peak <= budget and side(runs[k]) == which]
            chosen.update(sorted(fit, key=lambda k: -screened[k][1])[:FINALISTS])
    return chosen


def confirmed(results: list, shape_label: str, config: str) -> dict:
    """{repeat: images/s} of a configuration's confirmation repeats."""
    return {k: v for k, v in by_repeat(results, shape_label, config, lambda r: r["images_per_sec"]).items() if k > 0}


def race_rows(suite: Suite, rows: list, results: list) -> list:
    """Per shape and budget: plain FSDP2's fastest and this project's fastest that fit (median images/s over
    the confirmation repeats; peaks from every job), their paired ratio with its 95% interval, and this
    project's fastest under DeepSpeed alone."""
    out = []
    for shape in suite.shapes:
        runs = {run.name: run for run in runs_of(suite, shape)}
        have = [r for r in rows if r["shape"] == shape.label and "images_per_sec" in r and r["config"] in runs]
        peaks = {r["config"]: r["peak_alloc_mib"] for r in have}
        speed = {r["config"]: statistics.median(v) for r in have if (v := list(confirmed(results, shape.label,
                                                                                          r["config"]).values()))}
        for fraction, budget in budgets(suite, shape, peaks):
            fit = [k for k in speed if peaks[k] <= budget]
            best = lambda ks: max(ks, key=speed.get) if ks else None  # noqa: E731
            theirs = best([k for k in fit if side(runs[k]) == "plain"])
            ours = best([k for k in fit if side(runs[k]) == "ours"])
            deepspeed = best([k for k in fit if runs[k].engine == DEEPSPEED])
            entry = {"shape": shape.label, "fraction": fraction, "budget_mib": budget, "plain": theirs, "ours": ours,
                     "deepspeed": deepspeed, "speed": speed, "peaks": peaks}
            for key in ("ours", "deepspeed"):
                entry[f"{key}_ratio"] = paired_ratio(confirmed(results, shape.label, entry[key]),
                                                     confirmed(results, shape.label, theirs)) \
                    if entry[key] and theirs else None
            entry.update(trainer_figures(results, shape.label, ours, theirs))
            out.append(entry)
    return out


def trainer_figures(results: list, shape_label: str, ours: str | None, plain: str | None) -> dict:
    """The last phase's figures at one budget: this project's fastest through train.py (median images/s and step
    peak), its ratio to plain FSDP2's fastest through the worker in the same repeats, and to itself through the
    worker (where that ran); None where the phase did not run them."""
    via = confirmed(results, shape_label, ours + TRAINER) if ours else {}
    plain_beside = confirmed(results, shape_label, plain + BESIDE) if plain else {}
    ours_beside = confirmed(results, shape_label, ours + BESIDE) if ours else {}
    peaks = [max(r["step_peak_bytes"]) for r in results
             if r["shape"] == shape_label and ours and r["run"] == ours + TRAINER and "error" not in r]
    return {"trainer_speed": statistics.median(via.values()) if via else None,
            "trainer_step_peak_mib": statistics.median(peaks) / MiB if peaks else None,
            "trainer_ratio": paired_ratio(via, plain_beside) if via and plain_beside else None,
            "trainer_vs_worker": paired_ratio(via, ours_beside) if via and ours_beside else None}


def trainer_jobs(suite: Suite, rows: list, results: list) -> list:
    """The last phase's jobs, from the confirmation repeats' winners: (shape label, configuration, side), side
    `train.py` for this project's fastest at each budget, `worker` for plain FSDP2's fastest at each budget and
    for this project's fastest at the midpoint; each once."""
    jobs = []
    for e in race_rows(suite, rows, results):
        wanted = [(e["ours"], "train.py"), (e["plain"], "worker")] + ([(e["ours"], "worker")] if e["fraction"] == 0.5
                                                                      else [])
        jobs += [(e["shape"], name, side) for name, side in wanted if name]
    return list(dict.fromkeys(jobs))


def race_targets(suite: Suite, rows: list, results: list) -> list:
    """(target, verdict, figures) at the midpoint budget of each shape."""
    out = []
    for e in race_rows(suite, rows, results):
        if e["fraction"] != 0.5:
            continue
        name = (f"Micro-batch race, {e['shape'].split(',')[0]}: at {e['budget_mib']:.0f} MiB, this project's "
                f"fastest / plain FSDP2's fastest >= {TARGET:.2f}x")
        r = e["ours_ratio"]
        if r is None:
            out.append((name, False if not e["ours"] else "not measured", "nothing of this project fits"
                        if not e["ours"] else "no paired confirmation repeats"))
            continue
        out.append((name, judged(r, TARGET, at_least=True),
                    f"{fmt_ratio(r)}{straddles(r, TARGET)}: {e['ours']} {e['speed'][e['ours']]:.2f} img/s at "
                    f"{e['peaks'][e['ours']]:.0f} MiB vs {e['plain']} {e['speed'][e['plain']]:.2f} img/s at "
                    f"{e['peaks'][e['plain']]:.0f} MiB"))
        if not e["ours"]:
            continue
        short = e["shape"].split(",")[0]
        r = e["trainer_ratio"]
        out.append((f"Micro-batch race, {short}, through train.py: at {e['budget_mib']:.0f} MiB, this project's "
                    f"fastest / plain FSDP2's fastest >= {TARGET:.2f}x", judged(r, TARGET, at_least=True),
                    f"{fmt_ratio(r)}{straddles(r, TARGET)}: {e['ours']} through train.py "
                    f"{e['trainer_speed']:.2f} img/s" if r else "the train.py phase did not run it"))
        r = e["trainer_vs_worker"]
        low, high = 1 - TRAINER_TOLERANCE, 1 + TRAINER_TOLERANCE
        verdict = both(judged(r, low, at_least=True), judged(r, high, at_least=False))  # None: not measured
        out.append((f"Micro-batch race, {short}: {e['ours']} through train.py / through the worker within "
                    f"{TRAINER_TOLERANCE:.0%}", verdict, f"{fmt_ratio(r)}{straddles(r, low)}{straddles(r, high)}"
                    if r else "the train.py phase did not run it"))
    return out


def race_markdown(suite: Suite, rows: list, results: list) -> str:
    lines = ["## The micro-batch race: the fastest configuration that fits each budget, on each side", "",
             f"Global batch {suite.global_batch} images per step; budgets from FSDP2 + HF full AC's peak (0) to "
             "plain FSDP2's (1), both at the largest micro-batch. Median images/s over the confirmation repeats; "
             "ratios paired within them, with 95% bootstrap intervals.", "",
             "| shape | budget MiB | plain FSDP2's fastest | images/s | this project's fastest | images/s | ratio | "
             "DeepSpeed's fastest | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    entries = race_rows(suite, rows, results)
    for e in entries:
        s = e["speed"]
        cell = lambda k: f"{k} | {s[k]:.2f}" if k else "none fits |"  # noqa: E731
        lines.append(f"| {e['shape'].split(',')[0]} | {e['budget_mib']:.0f}{' *' if e['fraction'] == 0.5 else ''} | "
                     f"{cell(e['plain'])} | {cell(e['ours'])} | {fmt_ratio(e['ours_ratio'])} | "
                     f"{e['deepspeed'] or 'none fits'} | {fmt_ratio(e['deepspeed_ratio'])} |")
    trained = [e for e in entries if e["trainer_speed"]]
    if trained:
        lines += ["", "### Through train.py", "",
                  "This project's fastest at each budget run through train.py itself (synthetic data: no shards read; "
                  "its schedule, clipping and loop; the loss read once after the untimed steps and once after the timed "
                  "ones), paired in the last phase's repeats with "
                  "plain FSDP2's fastest through the worker; the midpoint's fastest through the worker too. Step "
                  "peak: the profiled step's allocation above what it started with, train.py's against the worker's.",
                  "", "| shape | budget MiB | this project's fastest | train.py images/s | step peak MiB, train.py "
                  "(worker) | ratio to plain FSDP2's fastest | train.py / worker |", "|---|---|---|---|---|---|---|"]
        worker_step = {(r["shape"], r["config"]): r.get("step_peak_mib") for r in rows}
        for e in trained:
            worker = worker_step.get((e["shape"], e["ours"]))
            lines.append(f"| {e['shape'].split(',')[0]} | {e['budget_mib']:.0f}{' *' if e['fraction'] == 0.5 else ''} "
                         f"| {e['ours']} | {e['trainer_speed']:.2f} | {e['trainer_step_peak_mib']:.0f} "
                         f"({worker if worker in ('', None) else f'{worker:.0f}'}) | {fmt_ratio(e['trainer_ratio'])} | "
                         f"{fmt_ratio(e['trainer_vs_worker'])} |")
    return "\n".join(lines) + "\n"


def plot_race(path: str, suite: Suite, rows: list, results: list):
    """Per shape: images/s (left) and peak memory (right) against the micro-batch, one line per engine and
    policy, with the budgets; a larger micro-batch is what less activation memory buys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(suite.shapes), 2, figsize=(13, 5 * len(suite.shapes)), squeeze=False)
    for (ax_speed, ax_peak), shape in zip(axes, suite.shapes):
        runs = runs_of(suite, shape)
        have = {r["config"]: r for r in rows if r["shape"] == shape.label and "images_per_sec" in r}
        lines = {}
        for run in runs:
            lines.setdefault(Run(run.engine, run.ac, run.zero, run.reshard, run.compile).name, []).append(run)
        for i, (label, members) in enumerate(lines.items()):
            pts = [(run.micro, have[run.name]) for run in members if run.name in have]
            if not pts:
                continue
            plain = members[0].plain
            style = dict(ls="--" if plain else "-", marker="s" if plain else "o", color=f"C{i % 10}", label=label)
            xs = [m for m, _ in pts]
            ax_speed.errorbar(xs, [r["images_per_sec"] for _, r in pts], capsize=2, **style,
                              yerr=[[r["images_per_sec"] - r["images_per_sec_min"] for _, r in pts],
                                    [r["images_per_sec_max"] - r["images_per_sec"] for _, r in pts]])
            ax_peak.plot(xs, [r["peak_alloc_mib"] for _, r in pts], **style)
        for fraction, budget in budgets(suite, shape, {k: r["peak_alloc_mib"] for k, r in have.items()}):
            ax_peak.axhline(budget, color="tab:red", lw=1.2 if fraction == 0.5 else 0.5, ls=":",
                            label="budgets (thick: the midpoint)" if fraction == 0 else None)
        for ax, what in ((ax_speed, f"images/s ({suite.ranks} ranks), median, min-max"),
                         (ax_peak, "peak allocated per rank (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"micro-batch per rank (accumulated to {suite.global_batch} images per step)")
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
        ax_speed.set_title(shape.label, fontsize=9)
        ax_peak.legend(fontsize=6, loc="upper left")
    fig.suptitle("Micro-batch race: dashed, plain FSDP2; solid, this project's policies (DeepSpeed or FSDP2)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
