"""The planner against a benchmark suite's measurements: every DeepSpeed row of a suite's results.csv predicted from
its configuration, with the errors of its peak memory and step time.

    python -m benchmarks.validate benchmarks/results/cpu/results.csv          # a markdown table
    python -m benchmarks.validate benchmarks/results/cpu/results.csv --json   # the rows

The suites call `write_validation` after a run: planner.md and planner.json beside its results.csv.
"""
import argparse
import csv
import datetime
import json
import os
import statistics

import torch

from benchmarks.bench_worker import Spec, run_config
from benchmarks.measure import calibrate as calibrate_job, cpu_name, memory_gbs
from benchmarks.suites import DEEPSPEED
from engine.ds_config import build_ds_config
from planner.calibration import CALIBRATION_RATES, calibrated
from planner.devices import Device
from planner.estimate import estimate
from models.registry import model_config, width


STEP_TOLERANCE = 0.25  # what the planner's calibrated step time is held to on the measured suites


def validate(results_csv: str, mfu: float = 1.0, intra_gbs: float = 10.0, save: bool = False,
             reprobe: bool = False) -> list:
    """The planner's predictions for every DeepSpeed row of a benchmark suite's results.csv (runs.jsonl and
    environment.json beside it give each row's configuration and what was measured in the same run), with the
    measured peak memory and step time and the errors. Two step times: `assumed`, every FLOP at the GEMM rate
    measured in the run (`mfu` of it), memory-bound operators at a streaming add's bandwidth and the ranks'
    collectives at `intra_gbs`; and `calibrated`, each shape's own calibration (calibrate(): its operators'
    rates, the all-gather bandwidth and the engine's host seconds (planner/host.py), measured with all ranks
    running), recorded in the run or, for a run that did not record one (or its host probe), in
    calibration.json beside it, or else measured now on this machine (and, with `save`, written there, dated,
    so that the validation's figures can be reproduced). `reprobe`: probe the host now for every shape, on a
    CPU of the run's model, in place of the run's own probe (one made by code with a fault); saved, it replaces
    the run's in later validations too."""
    folder = os.path.dirname(os.path.abspath(results_csv))
    with open(results_csv) as f:
        # eager rows only: the planner models the eager step (a compiled one fuses what it counts)
        rows = [r for r in csv.DictReader(f) if r["engine"] == DEEPSPEED and r["jobs_ok"] != "0"
                and r.get("compile") != "True"]
    with open(os.path.join(folder, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f]
    with open(os.path.join(folder, "environment.json")) as f:
        env = json.load(f)
    threads = env.get("threads_per_rank", 1)
    # the memory bandwidth measured in the same run, or (older runs) now, on this machine
    mem_gbs = env.get("mem_gbs_per_rank") or statistics.median(memory_gbs(threads))
    calibrations, sources = dict(env.get("calibration") or {}), {}
    sources.update((shape, f"median of {len(c['samples'])} measured in the run" if c.get("samples")
                    else "measured in the run") for shape, c in calibrations.items())
    later, saved = os.path.join(folder, "calibration.json"), {}
    if os.path.exists(later):
        with open(later) as f:
            saved = json.load(f)
    for shape, c in saved.items():
        if shape not in calibrations:
            calibrations[shape], sources[shape] = c, f"measured at validation on {c['date']}"
        elif c.get("host") and (not calibrations[shape].get("host") or c.get("host_replaces_run")):
            # a run whose calibration has no host probe, or one re-probed (--reprobe)
            calibrations[shape] = {**calibrations[shape], "host": c["host"]}
            sources[shape] += f"; the host probed at validation on {c.get('host_date', c['date'])}" + (
                " in place of the run's probe" if c.get("host_replaces_run") else "")
    added = {}
    out = []
    for row in rows:
        jobs = [r for r in runs if r["shape"] == row["shape"] and r["run"] == row["config"]]
        if not jobs:
            continue
        spec = Spec(**{k: v for k, v in jobs[0]["spec"].items() if k in Spec.__dataclass_fields__})
        cfg = run_config(spec)
        world, device_type = jobs[0]["world_size"], jobs[0]["device"]
        precision = "fp32" if device_type == "cpu" else "bf16"
        # the CPU runs each operator as it is dispatched: its launch cost is inside the measured rates; the
        # memory (1e6 GiB) is not the question here
        device = Device(device_type, env["peak_gflops_per_rank"] * 1e9, 1e6, intra_gbs, intra_gbs, 0.0,
                        mem_gbs=mem_gbs)
        hidden = width(model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size))
        ds_config = jobs[0].get("ds_config")  # as the run had it
        if ds_config is None:  # a run that did not record it: torch's unfused AdamW, DeepSpeed's sub-groups
            ds_config = build_ds_config(cfg, hidden, world, precision)
            ds_config["optimizer"]["params"]["fused"] = False
            ds_config["zero_optimization"].pop("sub_group_size", None)
        assumed = estimate(cfg, ds_config, precision, world, world, device, mfu, mbu=1.0)
        # a run without a host probe is probed now only on a CPU of the model it ran on (the host's speed is the
        # CPU's); on another, its step is predicted without the host term
        here = not env.get("gpu") and env.get("cpu") == cpu_name()
        if row["shape"] in calibrations and not calibrations[row["shape"]].get("host") and not here:
            if "host" not in sources[row["shape"]]:
                sources[row["shape"]] += f"; no host probe (the run's CPU is not this machine's, {cpu_name()})"
        elif not (calibrations.get(row["shape"]) or {}).get("host") or (reprobe and here
                                                                        and row["shape"] not in added):
            now = dict(calibrate_job(cfg.model, cfg.image_size, cfg.patch_size, cfg.micro_batch_size, cfg.num_labels,
                                     world, threads, precision), date=datetime.date.today().isoformat())
            # saved with the rates it was used with: the run's own stay in environment.json
            added[row["shape"]] = {**(saved.get(row["shape"]) or now), "host": now["host"], "host_date": now["date"],
                                   "host_replaces_run": reprobe}
            if row["shape"] in calibrations:  # the run's rates, with the host probed now
                calibrations[row["shape"]] = {**calibrations[row["shape"]], "host": now["host"]}
                sources[row["shape"]] = sources[row["shape"]].split("; the host probed")[0] + (
                    f"; the host probed at validation on {now['date']}"
                    + (" in place of the run's probe" if reprobe else ""))
            else:
                calibrations[row["shape"]] = now
                sources[row["shape"]] = f"measured at validation on {now['date']}"
        calibration = calibrations[row["shape"]]
        cal_device, rates = calibrated(device, calibration)
        est = estimate(cfg, ds_config, precision, world, world, cal_device, mbu=1.0, rates=rates)
        step_s = statistics.median(statistics.median(r["step_seconds"]) for r in jobs)
        measured_peak = float(row["peak_alloc_mib"]) * 2**20
        out.append({"shape": row["shape"], "config": row["config"], "zero_stage": cfg.zero_stage, "ac": cfg.ac,
                    "peak_predicted": est["peak_bytes"], "peak_measured": measured_peak,
                    "peak_error": est["peak_bytes"] / measured_peak - 1, "step_measured": step_s,
                    "step_predicted": est["step_s"], "step_error": est["step_s"] / step_s - 1,
                    "compute_s": est["compute_s"], "memory_bound_s": est["memory_bound_s"],
                    "comm_s": est["comm_s"] + est["tp_comm_s"], "tp_size": cfg.tp_size,
                    "host_micro_s": est["host"]["micro_s"], "host_bound": est["host"]["bound"],
                    "micro_batch_size": cfg.micro_batch_size, "grad_accum_steps": cfg.grad_accum_steps,
                    "step_assumed": assumed["step_s"], "step_error_assumed": assumed["step_s"] / step_s - 1,
                    "mem_gbs": mem_gbs, "mem_gbs_source": "measured in the run" if env.get("mem_gbs_per_rank")
                    else "measured at validation",
                    "calibration": {k: calibration[k] for k in CALIBRATION_RATES},
                    "calibration_samples": calibration.get("samples", []),
                    "calibration_source": sources[row["shape"]],
                    "calibration_failed_ops": len(calibration["failed_ops"])})
    if save and added:
        with open(later, "w") as f:
            json.dump({**saved, **added}, f, indent=1)
    return out


def unmeasured(results_csv: str) -> list:
    """(shape, configuration) of the eager DeepSpeed rows of a suite's results.csv whose every job failed: rows
    the planner has nothing to be compared with, counted as not measured."""
    with open(results_csv) as f:
        return [(r["shape"], r["config"]) for r in csv.DictReader(f)
                if r["engine"] == DEEPSPEED and r["jobs_ok"] == "0" and r.get("compile") != "True"]


def validation_table(rows: list, missing: list = ()) -> str:
    """plan.py's predictions against a benchmark suite's measurements, as a markdown table and a summary line;
    `missing`: the rows not measured (unmeasured()), counted in the summary and named."""
    failed = ", ".join(f"{config} at {shape}" for shape, config in missing)
    gone = f"; {len(missing)} of them not measured (every job failed: {failed})" if missing else ""
    if not rows:
        return "no DeepSpeed rows to compare" + (f": {len(missing)} not measured (every job failed: {failed})"
                                                 if missing else "")
    lines = ["| shape | configuration | peak MiB predicted | measured | error | step s calibrated (compute with "
             "host, of it memory-bound; communication) | host s per micro-batch | assumed | measured | error "
             "calibrated | error assumed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['config']} | {r['peak_predicted'] / 2**20:.1f} | "
                     f"{r['peak_measured'] / 2**20:.1f} | {r['peak_error']:+.1%} | {r['step_predicted']:.3f} "
                     f"({r['compute_s']:.3f}, {r['memory_bound_s']:.3f}; {r['comm_s']:.3f}) | {r['host_micro_s']:.3f}"
                     f"{' (bound)' if r['host_bound'] else ''} | {r['step_assumed']:.3f} | "
                     f"{r['step_measured']:.3f} | {r['step_error']:+.1%} | {r['step_error_assumed']:+.1%} |")
    worst_peak = max(rows, key=lambda r: abs(r["peak_error"]))
    worst_step = max(rows, key=lambda r: abs(r["step_error"]))
    worst_assumed = max(rows, key=lambda r: abs(r["step_error_assumed"]))
    within = sum(abs(r["step_error"]) <= STEP_TOLERANCE for r in rows)
    return ("\n".join(lines) + f"\n\n{len(rows) + len(missing)} rows, {within} with the calibrated step within "
            f"{STEP_TOLERANCE:.0%}; largest peak error {worst_peak['peak_error']:+.1%} "
            f"({worst_peak['config']}, {worst_peak['shape']}); largest step-time error calibrated "
            f"{worst_step['step_error']:+.1%} ({worst_step['config']}, {worst_step['shape']}), assumed "
            f"{worst_assumed['step_error_assumed']:+.1%} ({worst_assumed['config']}, {worst_assumed['shape']})"
            + gone)


def calibration_table(rows: list) -> str:
    """Each shape's calibration, as the validation used it."""
    lines = ["| shape | operators GFLOP/s | operators GB/s | operators not replayed | streaming GB/s | "
             "all-gather GB/s per rank | source |", "|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        r = next(r for r in rows if r["shape"] == shape)
        c, samples = r["calibration"], r.get("calibration_samples") or []

        def rate(key):  # the rate used, and the range of the samples it is the median of
            values = [x[key] / 1e9 for x in samples]
            return f"{c[key] / 1e9:.1f}" + (f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else "")

        lines.append(f"| {shape} | {rate('flops_per_s')} | {rate('bytes_per_s')} | "
                     f"{r['calibration_failed_ops']} | {c['stream_gbs']:.1f} | "
                     f"{c['comm_gbs']:.2f} | {r['calibration_source']} |")
    return "\n".join(lines)


def write_validation(results_dir: str, suite_name: str):
    """planner.md (and planner.json) beside a benchmark suite's results.csv: the predictions for its rows and their
    errors."""
    rows = validate(os.path.join(results_dir, "results.csv"), save=True)
    with open(os.path.join(results_dir, "planner.json"), "w") as f:  # the same rows, for programs to read
        json.dump(rows, f, indent=1)
    with open(os.path.join(results_dir, "planner.md"), "w") as f:
        f.write(f"# {suite_name}: plan.py's predictions against these measurements\n\n"
                f"`python -m benchmarks.validate {os.path.relpath(results_dir)}/results.csv`. Two step times per row:\n\n"
                f"- **calibrated**: what `plan.py --calibrate` measured for the shape with every rank running (the "
                f"model's own operators replayed forward and backward at the micro-batch, the optimizer's streaming "
                f"bandwidth, the all-gather bandwidth between the ranks, and the engine's host seconds per block "
                f"and per step, probed on the model's structure at width 32: planner/host.py), in the planner's "
                f"step model; a suite calibrates at the start of each repeat and uses the median (the range in "
                f"brackets), and probes the host once;\n"
                f"- **assumed**: every FLOP at the 2048^3 GEMM rate measured in the run, memory-bound operators at "
                f"a streaming add's bandwidth, the collectives at 10 GB/s.\n\n"
                f"{calibration_table(rows) if rows else ''}\n\n"
                f"{validation_table(rows, unmeasured(os.path.join(results_dir, 'results.csv')))}\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results_csv", help="a suite's results.csv (benchmarks/results/<suite>/)")
    parser.add_argument("--mfu", type=float, default=1.0, help="the assumed step time's fraction of the run's GEMM rate")
    parser.add_argument("--intra_gbs", type=float, default=10.0, help="the assumed step time's collective bandwidth")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--reprobe", action="store_true",
                        help="probe the host now (on a CPU of the run's model) in place of the run's own probe, save "
                             "it to calibration.json beside results.csv and rewrite planner.md with it")
    a = parser.parse_args(argv)
    if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, named: it would print that it guessed it
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if a.reprobe:
        validate(a.results_csv, mfu=a.mfu, intra_gbs=a.intra_gbs, save=True, reprobe=True)
        folder = os.path.dirname(os.path.abspath(a.results_csv))
        with open(os.path.join(folder, "environment.json")) as f:
            write_validation(folder, json.load(f)["suite"])
    rows = validate(a.results_csv, mfu=a.mfu, intra_gbs=a.intra_gbs)
    print(json.dumps(rows, indent=1) if a.json else validation_table(rows, unmeasured(a.results_csv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
