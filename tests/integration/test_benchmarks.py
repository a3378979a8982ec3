"""The benchmark harness, end to end: the smoke suites and the worker as their own commands run them. The
statistics and verdicts: tests/unit/test_verdicts.py."""
import csv
import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO


# slow (~3 min): the harness end to end; its statistics and verdicts: tests/unit/test_verdicts.py
@pytest.mark.slow
def test_cpu_smoke_suite(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.train_bench", "--suite", "cpu-smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["config"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert set(rows) == {"FSDP2 + none", "FSDP2 + HF full AC", "FSDP2 + selective", "ZeRO-1 + none", "ZeRO-3 + none",
                         "ZeRO-3 + selective", "ZeRO-3 + full", "ZeRO-3 + auto:f0.5"}
    assert all(r["jobs_ok"] == "2" and r["jobs_failed"] == "0" for r in rows.values())
    # same seed, same batches: every engine and policy reaches the same loss (fp32 summation order aside)
    assert all(float(r["loss_rel_diff"]) < 1e-5 for r in rows.values())
    # measured, not copied from a plan: activations kept by the forward shrink with recompute
    act = {k: float(r["activation_mib"]) for k, r in rows.items()}
    assert act["ZeRO-3 + full"] < act["ZeRO-3 + selective"] < act["ZeRO-3 + none"]
    assert act["FSDP2 + HF full AC"] < act["FSDP2 + none"]
    # the same wrapping code under FSDP2: the same activations as under ZeRO-3, and the planner's figures
    assert act["FSDP2 + selective"] == pytest.approx(act["ZeRO-3 + selective"], abs=0.2)
    assert rows["FSDP2 + selective"]["ac_plan"] == rows["ZeRO-3 + selective"]["ac_plan"] == "s/s"
    runs = [json.loads(line) for line in open(tmp_path / "runs.jsonl")]
    # each ratio against plain FSDP2 is the geometric mean of the per-repeat ratios of the jobs' own images/s
    speed = lambda config: {r["repeat"]: r["images_per_sec"] for r in runs if r["run"] == config}  # noqa: E731
    base = speed("FSDP2 + none")
    for name, r in rows.items():
        ratios = [speed(name)[k] / base[k] for k in base]
        assert float(r["speed_vs_fsdp2"]) == pytest.approx(math.prod(ratios) ** (1 / len(ratios)), abs=1e-3)
    # ZeRO-3's forward ends with gathered weights (the backward's first), counted beside the activations, not
    # in them; ZeRO-1 never partitions its weights
    assert all(min(r["forward_weight_bytes"]) > 0 for r in runs if r["run"] == "ZeRO-3 + none")
    assert all(max(r["forward_weight_bytes"]) == 0 for r in runs if r["run"] == "ZeRO-1 + none")
    # recompute FLOPs are counted, not assumed: full recompute repeats the blocks' forward
    assert float(rows["ZeRO-3 + full"]["recompute_flops_frac"]) > 0.1
    # the planner was calibrated for the shape at the start of each repeat, and its predictions use the median
    calibration = json.load(open(tmp_path / "environment.json"))["calibration"]
    assert len(calibration) == 1
    chosen = next(iter(calibration.values()))
    assert chosen["ranks"] == 2 and len(chosen["samples"]) == 2
    assert {k: chosen[k] for k in chosen["samples"][0]} in chosen["samples"]
    assert "| median of 2 measured in the run |" in (tmp_path / "planner.md").read_text()
    # the host probe ran once, in the first repeat (tests/integration/test_planner.py checks its figures), and the planner
    # charges the DeepSpeed rows' host per micro-batch
    assert chosen["host"]["blocks"] == [4, 12]
    predicted = json.load(open(tmp_path / "planner.json"))
    assert predicted and all(r["host_micro_s"] > 0 for r in predicted)
    assert float(rows["ZeRO-3 + none"]["recompute_flops_frac"]) == 0.0
    assert all(0 < float(r["mfu"]) < 1 for r in rows.values())
    # the auto budget came from this invocation's own ZeRO-3 full and none peaks
    budget = float(rows["ZeRO-3 + auto:f0.5"]["budget_gib"]) * 1024
    low, high = float(rows["ZeRO-3 + full"]["peak_alloc_mib"]), float(rows["ZeRO-3 + none"]["peak_alloc_mib"])
    assert abs(budget - (low + high) / 2) < 0.2
    # alternating order: the second repeat ran the configurations in reverse
    first, second = [r["run"] for r in runs if r["repeat"] == 0], [r["run"] for r in runs if r["repeat"] == 1]
    assert second == first[::-1]
    # each job ran its profiled steps, 1 warm-up step, 2 timed ones and, in the first repeat only, the FLOP-counted one
    assert all(len(r["step_seconds"]) == 2 and len(r["losses"]) == 2 + 1 + 2 + (r["repeat"] == 0) for r in runs)
    assert (tmp_path / "pareto.png").stat().st_size > 20_000
    md = (tmp_path / "results.md").read_text()
    assert "## Targets" in md and "ZeRO-3 + selective" in md and "torch 2.13.0" in md
    assert "| vit-debug | selective | ZeRO-3 + selective |" in md and "## The budget race" in md
    # benchmarks.validate on the same rows: its predicted peaks are the ones the runs planned with
    planner = (tmp_path / "planner.md").read_text()
    deepspeed_rows = [r for r in rows.values() if r["engine"] == "deepspeed"]
    assert re.search(rf"\n{len(deepspeed_rows)} rows, \d+ with the calibrated step within 25%; largest peak error",
                     planner)
    for r in deepspeed_rows:
        if r["planned_peak_mib"]:
            assert f"| {r['config']} | {float(r['planned_peak_mib']):.1f} |" in planner, r["config"]


# slow (~4 min): the race's harness end to end, its train.py phase included; its choice of finalists and its
# verdicts: tests/unit/test_verdicts.py
@pytest.mark.slow
def test_race_smoke_suite(tmp_path):
    """The micro-batch race end to end: every configuration screened once, the finalists confirmed, each job
    accumulating its micro-batches to the global batch."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.train_bench", "--suite", "race-smoke", "--out",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in open(tmp_path / "runs.jsonl")]
    screened = {r["run"] for r in runs if r["repeat"] == 0}
    assert len(screened) == 8 and not any("error" in r for r in runs)
    phase = [r for r in runs if r.get("phase") == "train.py"]
    runs = [r for r in runs if "phase" not in r]
    confirmed = {r["run"] for r in runs if r["repeat"] == 1}
    assert confirmed <= screened and {"FSDP2 + none @ micro 4", "FSDP2 + HF full AC @ micro 4"} <= confirmed
    # the last phase: this project's winners through train.py itself, accumulating as the worker does, paired
    # with plain FSDP2's winners through the worker
    trained = [r for r in phase if r["side"] == "train.py"]
    assert trained and {r["config"] for r in phase} <= confirmed and {r["side"] for r in phase} == {"train.py", "worker"}
    for r in trained:
        micro = int(r["config"].rsplit(" ", 1)[1])
        assert (r["micro_batch_size"], r["grad_accum_steps"]) == (micro, 8 // (2 * micro))
        assert r["images_per_sec"] > 0 and r["step_peak_bytes"][0] > 0 and r["loss"] > 0
    for r in runs:  # 8 images per step over 2 ranks: micro 2 accumulates 2, micro 4 once
        micro = int(r["run"].rsplit(" ", 1)[1])
        assert (r["spec"]["micro_batch_size"], r["spec"]["grad_accum_steps"]) == (micro, 8 // (2 * micro))
        assert r["images_per_sec"] == pytest.approx(8 * len(r["step_seconds"]) / sum(r["step_seconds"]))
    # a step's images do not depend on how it is cut: every micro-batch and policy reaches the same loss
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert all(float(r["loss_rel_diff"]) < 1e-5 for r in rows)
    md = (tmp_path / "results.md").read_text()
    assert "## The micro-batch race" in md and "Micro-batch race, vit-debug" in md and "### Through train.py" in md
    assert (tmp_path / "race.png").stat().st_size > 20_000


# slow (~1 min): trainer_check end to end; the worker's timed steps: tests/integration/test_timing.py
@pytest.mark.slow
def test_trainer_check_smoke(tmp_path):
    """train.py and the worker on one configuration each, end to end: both sides measured, the ratio taken from
    the two, train.py's wait for data a share of its steps."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.trainer_check", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in open(tmp_path / "runs.jsonl")]
    assert len(runs) == 6 and not any("error" in r for r in runs)
    for config in ("ZeRO-2 + none", "ZeRO-3 + selective", "FSDP2 (resharding) + none"):
        of = {r["side"]: r for r in runs if r["config"] == config}
        assert of["train.py"]["images_per_sec"] > 0 and of["worker"]["images_per_sec"] > 0
        assert 0 <= of["train.py"]["data_wait_frac"] < 1
        ratio = of["train.py"]["images_per_sec"] / of["worker"]["images_per_sec"]
        assert f"| {config} |" in (tmp_path / "report.md").read_text()
        assert f"{ratio:.3f} [" in (tmp_path / "report.md").read_text()
        # one repeat is no interval: its verdict is not measured, not a collapsed "yes"
        row = next(line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith(f"| {config} |"))
        assert row.endswith("| not measured |") and "(1 pairs)" in row


def test_worker_refuses_a_job_without_timed_steps(tmp_path):
    # its profiler stops when the first timed step starts: without one it would fail inside the profiler
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_worker", "--spec", json.dumps({"timed_steps": 0}),
                           "--out", str(tmp_path / "r.json")], cwd=REPO, env=dict(os.environ, RANK="0", WORLD_SIZE="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "error: a job needs at least one profiled and one timed step (got 2 and 0)"
    assert not (tmp_path / "r.json").exists()


# slow (~1 min): the task-memory harness; the planner against a measured run:
# tests/integration/test_planner.py::test_the_planner_predicts_a_run_no_suite_measures
@pytest.mark.slow
def test_task_memory_measures_each_job_and_predicts_it_again(tmp_path):
    """benchmarks/task_memory.py --quick (two tiny 2-rank jobs, MAE and UperNet) and --report_only: each row has a
    measured peak and the planner's prediction for the DeepSpeed config the job ran, and a rerun of the report
    predicts the same without running anything."""
    from benchmarks import task_memory

    assert task_memory.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.load(open(tmp_path / "results.json"))
    assert [r["task"] for r in rows] == ["mae", "segmentation"]
    assert all(r["peak_measured"] > 0 and r["peak_predicted"] > 0 and r["ds_config"]["zero_optimization"]["stage"] == 3
               for r in rows)
    before = (tmp_path / "results.md").read_text()
    # quick: exit 0 whatever the errors, as long as every job was measured and predicted
    assert task_memory.main(["--report_only", "--quick", "--out", str(tmp_path)]) == 0
    assert [r["peak_predicted"] for r in json.load(open(tmp_path / "results.json"))] == [r["peak_predicted"] for r in rows]
    assert "predicted again" in (tmp_path / "results.md").read_text() and "predicted again" not in before
    broken = json.load(open(tmp_path / "results.json"))
    broken[1]["peak_measured"] = 0  # a job without a measurement: the report is incomplete, whatever --quick says
    json.dump(broken, open(tmp_path / "results.json", "w"))
    assert task_memory.main(["--report_only", "--quick", "--out", str(tmp_path)]) == 1
