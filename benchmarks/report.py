"""A suite's statistics and reports: paired ratios with bootstrap intervals, the tables, the targets' verdicts,
results.md, the Pareto plot and the comparison of a rerun with a committed run."""
import math
import statistics
from typing import NamedTuple

from benchmarks.suites import DEEPSPEED, FSDP2, MiB, Run, Suite, fsdp2, micro_and_accum, runs_of


def peak_of(result: dict) -> int:
    """Peak allocated bytes of a job: the largest rank's."""
    return max(result["peak_alloc_bytes"])


# ----------------------------------------------------------------------------- statistics
BOOTSTRAP_RESAMPLES = 10_000


def by_repeat(results: list, shape: str, config: str, value) -> dict:
    """{repeat: value(job)} of a configuration's successful jobs."""
    return {r["repeat"]: value(r) for r in results
            if r["shape"] == shape and r["run"] == config and "error" not in r}


MIN_REPEATS = 5  # the method's repeats (docs/benchmarks.md): a ratio over fewer pairs is not a verdict


class Ratio(NamedTuple):
    """A paired ratio: the point, its 95% bootstrap interval, the pairs it is read from, and the repeats left
    out (a value <= 0, or a repeat that ran on one side only)."""
    ratio: float
    low: float
    high: float
    n: int
    dropped: int = 0


_PAIRED = {}  # (a, b, seed) -> its Ratio: the bootstrap is deterministic and ~40 ms a ratio


def paired_ratio(a: dict, b: dict, seed: int = 0):
    """Ratio of a over b, both {repeat: value}: the geometric mean of the per-repeat ratios (a and b of one repeat
    ran in the same sweep of the alternating order, so the machine's drift between sweeps cancels), with a 95%
    percentile bootstrap interval over the repeats. Every repeat left out is counted in `dropped`. None without
    a common repeat."""
    import random

    memo = (tuple(sorted(a.items())), tuple(sorted(b.items())), seed)
    if memo in _PAIRED:
        return _PAIRED[memo]
    keys = set(a) | set(b)
    logs = [math.log(a[k] / b[k]) for k in sorted(set(a) & set(b)) if a[k] > 0 and b[k] > 0]
    if not logs:
        return None
    rng = random.Random(seed)
    n = len(logs)  # fsum / n is statistics.fmean, bit for bit, without its per-call checks
    means = sorted([math.fsum(rng.choices(logs, k=n)) / n for _ in range(BOOTSTRAP_RESAMPLES)])
    lo, hi = means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]
    _PAIRED[memo] = Ratio(math.exp(statistics.fmean(logs)), math.exp(lo), math.exp(hi), len(logs),
                          len(keys) - len(logs))
    return _PAIRED[memo]


def fmt_ratio(r) -> str:
    if not r:
        return "n/a"
    text = f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"
    if isinstance(r, Ratio) and (r.dropped or r.n < MIN_REPEATS):
        text += f" ({r.n} pairs" + (f", {r.dropped} repeats dropped" if r.dropped else "") + ")"
    return text


def speed_ratio(results, shape, a, b):
    return paired_ratio(by_repeat(results, shape, a, lambda r: r["images_per_sec"]),
                        by_repeat(results, shape, b, lambda r: r["images_per_sec"]))


def peak_ratio(results, shape, a, b):
    return paired_ratio(by_repeat(results, shape, a, peak_of), by_repeat(results, shape, b, peak_of))


def engine_table(results: list, rows: list, suite: Suite) -> list:
    """Table 1: DeepSpeed against FSDP2 at the same checkpointing policy (ZeRO-3 against resharding FSDP2,
    ZeRO-2 against FSDP2 without resharding), per shape: dicts with the two rows and both ratios."""
    out = []
    for shape in suite.shapes:
        have = {r["config"]: r for r in rows if r["shape"] == shape.label and "images_per_sec" in r}
        for run in runs_of(suite, shape):
            if run.engine != DEEPSPEED or run.zero == 1:
                continue
            other = fsdp2(run.ac, reshard=run.zero == 3, compile=run.compile)
            if run.name in have and other.name in have:
                out.append({"shape": shape.label, "policy": run.ac, "ours": have[run.name], "fsdp2": have[other.name],
                            "speed": speed_ratio(results, shape.label, run.name, other.name),
                            "memory": peak_ratio(results, shape.label, run.name, other.name)})
    return out


def race_table(results: list, rows: list, suite: Suite) -> list:
    """Table 2, the budget race: at each budget (every plain FSDP2 configuration's peak, and the midpoint between
    FSDP2 + HF full AC's and plain FSDP2's peaks that `auto:race` was given), the fastest configuration with
    this project's checkpointing that fits (DeepSpeed's, and on either engine) against plain FSDP2's fastest
    that fits, with the paired speed ratio."""
    out = []
    for shape in suite.shapes:
        have = [r for r in rows if r["shape"] == shape.label and "images_per_sec" in r]
        plain_names = {run.name for run in runs_of(suite, shape) if run.plain}
        plain = [r for r in have if r["config"] in plain_names]
        budgets = sorted({r["peak_alloc_mib"] for r in plain})
        f_none = next((r for r in plain if r["config"] == fsdp2("none").name), None)
        f_full = next((r for r in plain if r["config"] == fsdp2("hf:full").name), None)
        midpoint = (f_none["peak_alloc_mib"] + f_full["peak_alloc_mib"]) / 2 if f_none and f_full else None
        if midpoint:
            budgets = sorted(budgets + [midpoint])
        for budget in budgets:
            fits = [r for r in have if r["peak_alloc_mib"] <= budget]
            best = lambda rs: max(rs, key=lambda r: r["images_per_sec"]) if rs else None  # noqa: E731
            theirs = best([r for r in fits if r["config"] in plain_names])
            ours = best([r for r in fits if r["engine"] == DEEPSPEED])
            either = best([r for r in fits if r["config"] not in plain_names])
            if not theirs:
                continue
            entry = {"shape": shape.label, "budget_mib": budget, "midpoint": budget == midpoint, "fsdp2": theirs,
                     "ours": ours, "either": either}
            for key in ("ours", "either"):
                entry[f"{key}_speed"] = speed_ratio(results, shape.label, entry[key]["config"], theirs["config"]) \
                    if entry[key] else None
            out.append(entry)
    return out


# ----------------------------------------------------------------------------- summarising
def summarise(results: list, shapes: list, suite: Suite, flops: dict, peak_gflops: float) -> list:
    rows = []
    for shape in shapes:
        reference_loss = None
        for run in runs_of(suite, shape):
            jobs = [r for r in results if r["shape"] == shape.label and r["run"] == run.name and "error" not in r]
            failed = [r for r in results if r["shape"] == shape.label and r["run"] == run.name and "error" in r]
            row = {"shape": shape.label, "config": run.name, "engine": run.engine, "zero_stage": run.zero or "",
                   "reshard": run.reshard if run.engine == FSDP2 else "", "ac": run.ac, "compile": run.compile,
                   "jobs_ok": len(jobs),
                   "jobs_failed": len(failed)}
            if not jobs:
                rows.append(row)
                continue
            speeds = [r["images_per_sec"] for r in jobs]
            peaks = [peak_of(r) for r in jobs]
            first = jobs[0]
            hardware = next((r["hardware_flops_per_step"] for r in jobs if r["hardware_flops_per_step"]), 0)
            micro, accum = micro_and_accum(suite, shape, run)
            per_step = micro * accum * suite.ranks  # images
            model_per_step = flops[shape.label] * per_step
            med = statistics.median(speeds)
            # the loss of the same step in every job (the first repeat's also run a FLOP-counted step, last)
            loss = statistics.median(r["losses"][suite.profiled_steps + suite.timed_steps - 1] for r in jobs)
            if reference_loss is None:
                reference_loss = loss
            row.update(
                budget_gib=round(first["budget_gib"], 4) if first["budget_gib"] else "",
                images_per_sec=round(med, 3), images_per_sec_min=round(min(speeds), 3),
                images_per_sec_max=round(max(speeds), 3),
                micro_batch=micro, grad_accum=accum, step_ms=round(1000 * per_step / med, 2),
                mfu=round(flops[shape.label] * med / (peak_gflops * 1e9 * suite.ranks), 4),
                recompute_flops_frac=round(hardware / model_per_step - 1, 4) if hardware else "",
                peak_alloc_mib=round(statistics.median(peaks) / MiB, 1),
                peak_alloc_mib_min=round(min(peaks) / MiB, 1), peak_alloc_mib_max=round(max(peaks) / MiB, 1),
                setup_peak_mib=round(statistics.median(max(r["setup_peak_bytes"]) for r in jobs) / MiB, 1),
                step_peak_mib=median_mib(jobs, "step_peak_bytes"), activation_mib=median_mib(jobs, "activation_bytes"),
                # the whole weights that forward left beside them (absent from older runs.jsonl files: 0)
                forward_weights_mib=round(statistics.median(max(r.get("forward_weight_bytes", [0])) for r in jobs)
                                          / MiB, 1),
                max_rss_mib=round(statistics.median(max(r["max_rss_bytes"]) for r in jobs) / MiB, 1),
                final_loss=round(loss, 6), loss_rel_diff=f"{abs(loss - reference_loss) / abs(reference_loss):.1e}",
                ac_plan="/".join(f"{p[0]}" for p in first.get("ac_plan", {}).get("blocks", [])))
            # images/s over the same repeats' plain FSDP2 (at the same micro-batch), with its interval: what
            # `--compare` checks
            vs = speed_ratio(results, shape.label, run.name, Run("fsdp2", "none", micro=run.micro).name)
            if vs:
                row.update(speed_vs_fsdp2=round(vs[0], 4), speed_vs_fsdp2_low=round(vs[1], 4),
                           speed_vs_fsdp2_high=round(vs[2], 4))
            plan = first.get("ac_plan", {})
            if plan.get("peak_bytes_planned") is not None:  # the planner's prediction, against the peak
                planned = plan["peak_bytes_planned"] / MiB
                row.update(planned_peak_mib=round(planned, 1),
                           planned_error=round(planned / row["peak_alloc_mib"] - 1, 4))
            rows.append(row)
    return rows


def median_mib(jobs: list, key: str):
    """The median over jobs of a figure's largest value over ranks, in MiB; "" where it was not measured (the
    activation and step-peak figures come from the CPU profiler's timeline: none on GPUs)."""
    if any(None in r[key] or r.get("device") == "cuda" for r in jobs):  # a GPU job's 0 there is no measurement
        return ""
    return round(statistics.median(max(r[key]) for r in jobs) / MiB, 1)


def mib(value) -> str:
    return "" if value == "" else f"{value:.0f}"


def straddles(r, threshold: float) -> str:
    """A note when a ratio's interval contains the target's threshold."""
    return " (the interval straddles the target)" if r and r[1] <= threshold <= r[2] else ""


UNDECIDED, NOT_MEASURED, REPORTED = "undecided (the interval straddles)", "not measured", "reported"


def judged(r, threshold: float, at_least: bool):
    """A ratio's verdict against its threshold, read from its 95% interval (point, low, high[, n, dropped]): met
    or missed when the whole interval lies on one side, undecided when it straddles the threshold; not measured
    without a ratio or from fewer pairs than the method's MIN_REPEATS (one pair's "interval" is its point)."""
    if r is None or (isinstance(r, Ratio) and r.n < MIN_REPEATS):
        return NOT_MEASURED
    low, high = r[1], r[2]
    if at_least:
        return True if low >= threshold else False if high < threshold else UNDECIDED
    return True if high <= threshold else False if low > threshold else UNDECIDED


def not_slower(r):
    """"Not slower" (one-sided, no margin): missed when the whole interval lies below 1, met otherwise; not
    measured as `judged` says."""
    verdict = judged(r, 1.0, at_least=True)
    return True if verdict == UNDECIDED else verdict


def both(*verdicts):
    """Met only if every part is met; otherwise the worst part: missed, then undecided, then not measured."""
    for worst in (False, UNDECIDED, NOT_MEASURED):
        if any(v is worst if isinstance(worst, bool) else v == worst for v in verdicts):
            return worst
    return True


def render(verdict) -> str:
    if verdict is True:
        return "yes"
    if verdict is False:
        return "**missed**"
    return "-" if verdict == REPORTED else verdict


def memory_target(results: list, shape: str, rows: list, z3: dict) -> tuple:
    """(target, verdict, figures): the DeepSpeed configuration with the lowest peak among those whose median
    images/s is at least 0.9x plain ZeRO-3's (`z3`, its row) uses at most 0.7x its peak. The configuration is
    chosen on medians; its verdict reads the paired intervals of both of its ratios."""
    fast = [r for r in rows if r["engine"] == DEEPSPEED and r["images_per_sec"] >= 0.9 * z3["images_per_sec"]]
    best = min(fast, key=lambda r: r["peak_alloc_mib"])
    memory = peak_ratio(results, shape, best["config"], z3["config"])
    speed = speed_ratio(results, shape, best["config"], z3["config"])
    return ("Memory: best-memory config at >= 0.9x ZeRO-3's images/s uses <= 0.7x its peak",
            both(judged(memory, 0.7, at_least=False), judged(speed, 0.9, at_least=True)),
            f"{best['config']}: {fmt_ratio(memory)}x the peak{straddles(memory, 0.7)} ({best['peak_alloc_mib']:.0f} "
            f"vs {z3['peak_alloc_mib']:.0f} MiB) at {fmt_ratio(speed)}x the images/s{straddles(speed, 0.9)}")


def check_targets(rows: list, suite: Suite, results: list) -> list:
    """(target, verdict, figures): DeepSpeed against FSDP2 at equal policy and `selective` on every shape; the
    budget race, memory and `auto` targets on the targets shape, the race reported on the others
    (docs/benchmarks.md lists them). A ratio's verdict reads its 95% interval (`judged`); a target with nothing
    to compare is not measured."""
    label = next((s.label for s in suite.shapes if s.model == suite.targets_shape), None)
    shape_rows = [r for r in rows if r["shape"] == label and "images_per_sec" in r]
    by = {r["config"]: r for r in shape_rows}
    out = []

    def fits(r, budget_mib):
        return r["peak_alloc_mib"] <= budget_mib

    for e in engine_table(results, rows, suite):
        speed, memory = e["speed"], e["memory"]
        if not speed or not memory:  # a side with no paired repeat: said, not skipped
            out.append((f"{e['ours']['config']} against {e['fsdp2']['config']} ({e['shape'].split(',')[0]})",
                        NOT_MEASURED, "no paired repeats of both"))
            continue
        if suite.host:  # the time per step is the host's: DeepSpeed's at most 1.2x FSDP2's
            step = speed_ratio(results, e["shape"], e["fsdp2"]["config"], e["ours"]["config"])
            out.append((f"Host time per step, {e['ours']['config']} against {e['fsdp2']['config']}: <= 1.20x",
                        judged(step, 1.20, at_least=False), f"{fmt_ratio(step)}x{straddles(step, 1.20)} "
                                                             f"({e['ours']['step_ms']:.1f} vs "
                                                             f"{e['fsdp2']['step_ms']:.1f} ms)"))
            continue
        out.append((f"Equal policy, {e['shape'].split(',')[0]}, {e['ours']['config']} against "
                    f"{e['fsdp2']['config']}: images/s >= 0.98x, peak <= 1.00x",
                    both(judged(speed, 0.98, at_least=True), judged(memory, 1.0, at_least=False)),
                    f"images/s {fmt_ratio(speed)}{straddles(speed, 0.98)}; peak {fmt_ratio(memory)}"
                    f"{straddles(memory, 1.0)} ({e['ours']['peak_alloc_mib']:.0f} vs "
                    f"{e['fsdp2']['peak_alloc_mib']:.0f} MiB)"))
    for e in race_table(results, rows, suite) if not (suite.host or suite.global_batch) else []:
        if not e["midpoint"]:
            continue
        checked = e["shape"] == label
        name = (f"Budget race, {e['shape'].split(',')[0]}: at {e['budget_mib']:.0f} MiB, our fastest that fits / "
                f"plain FSDP2's fastest that fits" + (" >= 1.10x" if checked else " (reported)"))
        if not e["ours"] or not e["fsdp2"]:  # a side with nothing that fits: no ratio to read
            out.append((name, (False if not e["ours"] else NOT_MEASURED) if checked else REPORTED,
                        "no DeepSpeed configuration fits" if not e["ours"] else "no plain FSDP2 configuration fits"))
            continue
        r = e["ours_speed"]
        if r is None:
            out.append((name, NOT_MEASURED if checked else REPORTED, "no paired repeats to compare"))
            continue
        out.append((name, judged(r, 1.10, at_least=True) if checked else REPORTED,
                    f"{fmt_ratio(r)}{straddles(r, 1.10) if checked else ''}: {e['ours']['config']} "
                    f"{e['ours']['images_per_sec']:.2f} img/s at {e['ours']['peak_alloc_mib']:.0f} MiB vs "
                    f"{e['fsdp2']['config']} {e['fsdp2']['images_per_sec']:.2f} img/s at "
                    f"{e['fsdp2']['peak_alloc_mib']:.0f} MiB"))
    z3 = by.get("ZeRO-3 + none")
    if z3 and not suite.host:
        out.append(memory_target(results, label, shape_rows, z3))
    for shape in suite.shapes:  # `selective` is held to its target on every shape and engine
        of_shape = {r["config"]: r for r in rows if r["shape"] == shape.label and "images_per_sec" in r}
        for engine in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2", "ZeRO-3 (compiled)", "FSDP2 (compiled)"):
            base, compiled = engine.split(" (")[0], " + compile" if "compiled" in engine else ""
            none, sel = of_shape.get(f"{base} + none{compiled}"), of_shape.get(f"{base} + selective{compiled}")
            light = of_shape.get(f"{base} + light{compiled}")
            if suite.host and none and light:  # `light`: the same host target as selective's
                step = speed_ratio(results, shape.label, none["config"], light["config"])
                out.append((f"Host time per step, {engine}: light <= 1.10x none", judged(step, 1.10, at_least=False),
                            f"{fmt_ratio(step)}x{straddles(step, 1.10)} ({light['step_ms']:.1f} vs "
                            f"{none['step_ms']:.1f} ms)"))
            if none and sel:
                step = speed_ratio(results, shape.label, none["config"], sel["config"])  # step time, sel / none
                if not suite.host and (none["activation_mib"] == "" or sel["activation_mib"] == ""):
                    out.append((f"Selective, {shape.label.split(',')[0]}, {engine}: activation memory -40% or "
                                f"more at <= 10% step time", NOT_MEASURED, "activations not measured on this device"))
                    continue
                cut = 1 - sel["activation_mib"] / none["activation_mib"]
                if suite.host:
                    out.append((f"Host time per step, {engine}: selective <= 1.10x none",
                                judged(step, 1.10, at_least=False),
                                f"{fmt_ratio(step)}x{straddles(step, 1.10)} ({sel['step_ms']:.1f} vs "
                                f"{none['step_ms']:.1f} ms)"))
                    continue
                out.append((f"Selective, {shape.label.split(',')[0]}, {engine}: activation memory -40% or more "
                            f"at <= 10% step time", both(cut >= 0.4, judged(step, 1.10, at_least=False)),
                            f"activations {sel['activation_mib']:.0f} vs {none['activation_mib']:.0f} MiB "
                            f"({-cut:+.1%}), step time {fmt_ratio(step)}x{straddles(step, 1.10)}"))
    for r in shape_rows:
        if not r["ac"].startswith("auto") or not r.get("budget_gib"):
            continue
        budget = r["budget_gib"] * 1024
        fixed = [x for x in shape_rows if (x["engine"], x["zero_stage"], x["reshard"], x["compile"]) == (
                 r["engine"], r["zero_stage"], r["reshard"], r["compile"]) and not x["ac"].startswith(("auto", "hf:"))
                 and fits(x, budget)]
        fastest = max(fixed, key=lambda x: x["images_per_sec"]) if fixed else None
        out.append((f"{r['config']} (budget {budget:.0f} MiB): peak at most 5% above the budget",
                    r["peak_alloc_mib"] <= 1.05 * budget,
                    f"peak {r['peak_alloc_mib']:.0f} MiB ({r['peak_alloc_mib'] / budget - 1:+.1%} of the budget), "
                    f"plan {r['ac_plan']}"))
        # "not slower": missed only when the paired interval lies wholly below 1 (decidedly slower)
        r_speed = speed_ratio(results, label, r["config"], fastest["config"]) if fastest else None
        out.append((f"{r['config']} (budget {budget:.0f} MiB): not slower than the fastest fixed policy that fits",
                    not_slower(r_speed) if fastest else NOT_MEASURED,
                    f"{fmt_ratio(r_speed)}x the images/s of {fastest['config']}" if fastest
                    else "no fixed policy of its engine fits the budget"))
    return out


def write_markdown(path: str, suite_name: str, suite: Suite, rows: list, targets: list, env: dict, minutes: float,
                   results: list, race: str = ""):
    """results.md; `race`: a micro-batch race's own section (benchmarks/race.py), in place of the tables at
    equal policy and the budget race at the shape's micro-batch."""
    with open(path, "w") as f:
        picture = "![images/s and peak memory against the micro-batch](race.png)" if race \
            else "![throughput against peak memory](pareto.png)"
        f.write(f"# `{suite_name}` suite\n\n{picture}\n\n")
        f.write(f"{env['date']} | commit {env.get('git_commit', 'not recorded')} | {env['gpu'] or env['cpu']}, "
                f"{env['cores']} cores | torch {env['torch']}, deepspeed "
                f"{env['deepspeed']}, transformers {env['transformers']} | {suite.ranks} ranks x "
                f"{env['threads_per_rank']} threads | MFU peak {env['peak_gflops_per_rank']} GFLOP/s per rank "
                f"({env['peak_source']}) | {suite.repeats} repeats in alternating order, {suite.timed_steps} timed steps "
                f"each after {suite.profiled_steps} profiled and {suite.warmup_steps} warm-up ones | {minutes:.0f} min\n\n")
        f.write("Ratios: the geometric mean over repeats of the ratio within each repeat, with a 95% bootstrap "
                "interval over the repeats in brackets.\n\n")
        f.write("## Targets\n\n| target | met | measured |\n|---|---|---|\n")
        for name, ok, figures in targets:
            f.write(f"| {name} | {render(ok)} | {figures} |\n")
        if race:
            f.write("\n" + race)
        else:
            write_equal_policy_and_race(f, suite, rows, results)
        write_rows(f, suite, rows)


def write_equal_policy_and_race(f, suite: Suite, rows: list, results: list):
    f.write("\n## DeepSpeed against FSDP2 at the same checkpointing policy\n\nZeRO-3 against FSDP2 resharding "
            "after the forward, ZeRO-2 against FSDP2 without; the same `apply_ac` wraps both engines' blocks.\n\n"
            "| shape | policy | DeepSpeed | images/s | FSDP2 | images/s | speed ratio | peak MiB | FSDP2 peak | "
            "memory ratio |\n|---|---|---|---|---|---|---|---|---|---|\n")
    for e in engine_table(results, rows, suite):
        o, t = e["ours"], e["fsdp2"]
        f.write(f"| {e['shape'].split(',')[0]} | {e['policy']} | {o['config']} | {o['images_per_sec']:.2f} | "
                f"{t['config']} | {t['images_per_sec']:.2f} | {fmt_ratio(e['speed'])} | "
                f"{o['peak_alloc_mib']:.0f} | {t['peak_alloc_mib']:.0f} | {fmt_ratio(e['memory'])} |\n")
    f.write("\n## The budget race: this project's fastest against plain FSDP2's fastest at each budget\n\n"
            "Budgets: each plain FSDP2 configuration's peak and the midpoint (*) between FSDP2 + HF full AC's "
            "and plain FSDP2's. Plain FSDP2: no checkpointing or Hugging Face's. Ours: DeepSpeed with this "
            "project's checkpointing; *either engine*: this project's checkpointing under DeepSpeed or FSDP2.\n\n"
            "| shape | budget MiB | plain FSDP2's fastest | images/s | DeepSpeed's fastest | images/s | ratio | "
            "either engine's fastest | ratio |\n|---|---|---|---|---|---|---|---|---|\n")
    for e in race_table(results, rows, suite):
        t, o, x = e["fsdp2"], e["ours"], e["either"]
        f.write(f"| {e['shape'].split(',')[0]} | {e['budget_mib']:.0f}{' *' if e['midpoint'] else ''} | "
                f"{t['config']} | {t['images_per_sec']:.2f} | "
                + (f"{o['config']} | {o['images_per_sec']:.2f} | {fmt_ratio(e['ours_speed'])}" if o else "none fits | |")
                + " | " + (f"{x['config']} | {fmt_ratio(e['either_speed'])}" if x else "none fits |") + " |\n")


def write_rows(f, suite: Suite, rows: list):
    for shape in suite.shapes:
        f.write(f"\n## {shape.label}\n\n| configuration | images/s, median (min-max) | ms/step | MFU | recompute | peak "
                f"MiB/rank | planned peak (error) | setup peak | step peak | activations (+ whole weights) | "
                f"max RSS | loss after {suite.profiled_steps + suite.timed_steps} steps (rel. diff) |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if r["shape"] != shape.label:
                continue
            if "images_per_sec" not in r:
                f.write(f"| {r['config']} | failed ({r['jobs_failed']} jobs, see failed.log) |||||||||||\n")
                continue
            budget = f" ({r['budget_gib'] * 1024:.0f} MiB)" if r["budget_gib"] else ""
            if r["jobs_failed"]:
                budget += f" ({r['jobs_ok']} of {r['jobs_ok'] + r['jobs_failed']} jobs; see failed.log)"
            rec = f"{r['recompute_flops_frac']:+.0%}" if r["recompute_flops_frac"] != "" else ""
            f.write(f"| {r['config']}{budget} | {r['images_per_sec']:.2f} ({r['images_per_sec_min']:.2f}-"
                    f"{r['images_per_sec_max']:.2f}) | {r['step_ms']:.1f} | {r['mfu']:.1%} | {rec} | "
                    f"{r['peak_alloc_mib']:.0f} | "
                    + (f"{r['planned_peak_mib']:.0f} ({r['planned_error']:+.1%})" if "planned_peak_mib" in r else "")
                    + f" | {r['setup_peak_mib']:.0f} | {mib(r['step_peak_mib'])} | {mib(r['activation_mib'])}"
                    + (f" (+{r['forward_weights_mib']:.0f})" if r["forward_weights_mib"] else "") + " | "
                    f"{r['max_rss_mib']:.0f} | {r['final_loss']:.5f} ({r['loss_rel_diff']}) |\n")


def plot(path: str, suite: Suite, rows: list):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in suite.shapes if any(r["shape"] == s.label and "images_per_sec" in r for r in rows)]
    fig, axes = plt.subplots(1, len(shapes), figsize=(7.5 * len(shapes), 5.5), squeeze=False)
    colors = {"fsdp2": "tab:gray", "ours-fsdp2": "tab:orange", 1: "tab:green", 2: "tab:blue", 3: "tab:purple"}
    for ax, shape in zip(axes[0], shapes):
        rs = [r for r in rows if r["shape"] == shape.label and "images_per_sec" in r]
        for r in rs:
            plain = r["engine"] == FSDP2 and (r["ac"] == "none" or r["ac"].startswith("hf:"))
            c = colors[r["zero_stage"] if r["engine"] == DEEPSPEED else "fsdp2" if plain else "ours-fsdp2"]
            marker = "o" if r["engine"] == DEEPSPEED else "s" if plain else "^"
            ax.errorbar(r["peak_alloc_mib"], r["images_per_sec"], fmt=marker, color=c, ms=6,
                        mfc="white" if r["compile"] else c,  # hollow: compiled
                        yerr=[[r["images_per_sec"] - r["images_per_sec_min"]],
                              [r["images_per_sec_max"] - r["images_per_sec"]]], capsize=2)
            ax.annotate(r["config"].replace(" + ", "\n"), (r["peak_alloc_mib"], r["images_per_sec"]), fontsize=6,
                        xytext=(4, 2), textcoords="offset points", color=c)
        # the Pareto front: no configuration is both faster and smaller
        front = sorted((r["peak_alloc_mib"], r["images_per_sec"]) for r in rs)
        best, line = -1.0, []
        for x, y in front:
            if y > best:
                best = y
                line.append((x, y))
        ax.step(*zip(*line), where="post", color="black", lw=0.8, alpha=0.5)
        f_none = next((r for r in rs if r["config"] == fsdp2("none").name), None)
        f_full = next((r for r in rs if r["config"] == fsdp2("hf:full").name), None)
        if f_none and f_full:
            ax.axvline((f_none["peak_alloc_mib"] + f_full["peak_alloc_mib"]) / 2, ls="--", color="tab:red", lw=0.8,
                       label="budget-race budget")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_xlabel("peak allocated per rank (MiB)")
        ax.set_ylabel(f"images/s ({suite.ranks} ranks), median, min-max")
        ax.set_title(shape.label, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("DeepSpeed ZeRO-1/2/3 (green/blue/purple) vs plain FSDP2 (grey squares) and FSDP2 with this "
                 "project's checkpointing (orange triangles); hollow: compiled. Up and left is better",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# Reproduced, row by row: speed as each configuration's images/s over its own run's plain FSDP2 (paired within
# repeats, with its bootstrap interval: the machine's speed drifts between invocations, the ratio does not), and
# peak bytes, which do not depend on speed, directly. The peak's noise is the larger of a floor and the spread
# (max - min over median) of the configuration's own jobs in either run.
PEAK_NOISE = 0.03


def compare(rows: list, reference: list) -> tuple:
    """Markdown lines comparing a rerun's rows with a reference run's, and the rows not reproduced.

    A row is reproduced when its speed intervals against plain FSDP2 overlap in the two runs and its peaks
    agree within the noise. An `auto` row's budget comes from its own run's measured FSDP2 peaks, so when the
    two budgets differ its peak is compared relative to its budget (the row's claim is that it fits it).
    """
    def keyed(rs):
        return {(r["shape"], r["config"]): r for r in rs}

    def spread(r, column):
        return (float(r[f"{column}_max"]) - float(r[f"{column}_min"])) / float(r[column])

    def interval(r):
        return float(r["speed_vs_fsdp2_low"]), float(r["speed_vs_fsdp2_high"])

    new, ref = keyed(rows), keyed(reference)
    lines = ["| shape | config | images/s vs plain FSDP2: reference -> rerun [95% intervals] | intervals overlap | "
             "peak MiB: reference -> rerun | change (noise) | recompute FLOPs | reproduced |",
             "|---|---|---|---|---|---|---|---|"]
    missed = []
    for key, r in new.items():
        old = ref.get(key)
        if old is None or not r.get("speed_vs_fsdp2") or not old.get("speed_vs_fsdp2"):
            missed.append(key)
            why = "missing in the reference" if old is None else "no images/s ratio in one run"
            lines.append(f"| {key[0][:12]} | {key[1]} | {why} | | | | | **no** |")
            continue
        (a_lo, a_hi), (b_lo, b_hi) = interval(old), interval(r)
        overlap = a_lo <= b_hi and b_lo <= a_hi
        peak_noise = max(PEAK_NOISE, spread(old, "peak_alloc_mib"), spread(r, "peak_alloc_mib"))
        pa, pb, what = float(old["peak_alloc_mib"]), float(r["peak_alloc_mib"]), ""
        if old.get("budget_gib") and r.get("budget_gib") and old["budget_gib"] != r["budget_gib"]:
            ga, gb = float(old["budget_gib"]) * 1024, float(r["budget_gib"]) * 1024
            what = f" (budgets {ga:.0f} -> {gb:.0f} MiB: peak/budget {pa / ga:.3f} -> {pb / gb:.3f})"
            pa, pb = pa / ga, pb / gb
        ok = overlap and abs(pb / pa - 1) <= peak_noise
        if not ok:
            missed.append(key)
        plan = f", plan {old['ac_plan']} -> {r['ac_plan']}" if r.get("ac_plan") != old.get("ac_plan") else ""
        same_flops = "same" if old["recompute_flops_frac"] == r["recompute_flops_frac"] else "differ"
        lines.append(f"| {key[0][:12]} | {key[1]}{plan} | {float(old['speed_vs_fsdp2']):.3f} [{a_lo:.3f}, {a_hi:.3f}] "
                     f"-> {float(r['speed_vs_fsdp2']):.3f} [{b_lo:.3f}, {b_hi:.3f}] | {'yes' if overlap else 'no'} | "
                     f"{float(old['peak_alloc_mib']):.0f} -> {float(r['peak_alloc_mib']):.0f}{what} | "
                     f"{pb / pa - 1:+.1%} ({peak_noise:.0%}) | {same_flops} | {'yes' if ok else '**no**'} |")
    for key in sorted(ref.keys() - new.keys()):  # in the reference, absent from the rerun: not reproduced either
        missed.append(key)
        lines.append(f"| {key[0][:12]} | {key[1]} | missing in the rerun | | | | | **no** |")
    total = len(new.keys() | ref.keys())
    head = (f"{total - len(missed)} of {total} configurations reproduced: the 95% intervals of images/s "
            f"relative to the same run's plain FSDP2 overlap, and the peaks agree within their noise (in brackets: "
            f"the larger of {PEAK_NOISE:.0%} and the spread of the configuration's jobs in either run).")
    return [head, ""] + lines, missed
