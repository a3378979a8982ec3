"""plan.py's command line and the runs it predicts: plans at scale, bad input, `benchmarks.validate` against the
committed suites, a run no suite measures, `--calibrate` under torchrun. The planner's model in this process:
tests/unit/test_planner_model.py."""
import json
import os
import re

import pytest
from ac.profile import PROFILE_BATCH
from conftest import REPO, fork_launch, launch, run_entry, run_plan as plan


def test_plan_vit_22b_on_1024_gpus(tmp_path):
    """The ViT-22B paper's scale, planned in seconds on this host: the best configuration fits, is written as
    a recipe train.py reads, and a configuration that cannot fit says which cluster would."""
    out = tmp_path / "plan"
    proc = plan("--model", "vit-22b", "--image_size", 224, "--num_labels", 1000, "--precision", "bf16",
                "--world_size", 1024, "--ranks_per_node", 8, "--device", "h100-80gb", "--global_batch", 65536,
                "--tp_sizes", 1, "--json", "--out", out)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    best = result["best"]
    assert best["fits"] and best["peak_bytes"] <= best["capacity_bytes"] and best["global_batch"] == 65536
    assert best["params"] == pytest.approx(21.7e9, rel=0.01)
    times = [e["step_s"] for e in result["feasible"]]
    assert times == sorted(times) and len(times) > 1
    from config import parse

    cfg = parse(["--config", str(out / "config.yaml")])
    assert (cfg.zero_stage, cfg.micro_batch_size, cfg.ac) == (best["zero_stage"], best["micro_batch_size"], best["ac"])
    # across 128 nodes, without tensor parallelism, ZeRO++ (hpZ within the node, quantized communication) is the
    # fastest, but it changes the arithmetic: the pick is the fastest that does not, unless it is allowed
    assert not best["numerics"] and not best["zeropp"]
    assert result["feasible"][0]["zeropp"] and "int8 weights" in result["feasible"][0]["numerics"]
    assert "--nnodes 128 --nproc_per_node 8" in (out / "launch.sh").read_text()
    allowed = tmp_path / "allowed"
    proc = plan("--model", "vit-22b", "--image_size", 224, "--num_labels", 1000, "--precision", "bf16",
                "--world_size", 1024, "--ranks_per_node", 8, "--device", "h100-80gb", "--global_batch", 65536,
                "--tp_sizes", 1, "--json", "--out", allowed, "--allow_quantized")
    best = json.loads(proc.stdout)["best"]
    cfg = parse(["--config", str(allowed / "config.yaml")])
    assert best["zeropp"] and cfg.ds_config == str(allowed / "ds_config.json")
    # the template as it is: train.py fills its optimizer, batch and precision from the run's keys
    ds = json.loads((allowed / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["optimizer"]["params"]["lr"] == "auto"
    assert ds["train_batch_size"] == ds["bf16"]["enabled"] == "auto"

    # one node of 8 x 40 GB holds ViT-22B only with ZeRO-Offload (18 bytes per parameter in host memory)...
    proc = plan("--model", "vit-22b", "--image_size", 224, "--precision", "bf16", "--world_size", 8, "--device",
                "a100-40gb", "--global_batch", 64, "--json")
    assert proc.returncode == 0, proc.stderr
    feasible = json.loads(proc.stdout)["feasible"]
    assert feasible and all(e["offload"]["optimizer"] and e["offload"]["params"] for e in feasible)
    assert feasible[0]["offload"]["host_bytes_per_node"] == pytest.approx(18 * feasible[0]["params"], rel=1e-6)
    # ... which needs host memory: with 64 GiB per node, no configuration fits, and the error names the cluster
    proc = plan("--model", "vit-22b", "--image_size", 224, "--precision", "bf16", "--world_size", 8, "--device",
                "a100-40gb", "--global_batch", 64, "--host_memory_gb", 64)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no configuration of vit-22b fits 8 x a100-40gb")
    assert "the smallest cluster on which it fits at all (ZeRO-3, full recompute, micro-batch 1) is 16 ranks" \
        in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("args,message", [
    (["--model", "vit-gigantic"], "error: unknown model 'vit-gigantic'"),
    (["--device", "tpu-v9"], "error: unknown device 'tpu-v9'"),
    (["--device", "cpu"], "error: device cpu: give --device_tflops and --device_memory_gb"),
    (["--ac", "auto:0.001", "--model", "vit-base", "--image_size", 224], "error: ac 'auto:0.001'"),
    (["--calibrate", "calibration.json"], "error: calibrating bf16 needs the GPU it would run on"),
    (["--calibrate", "calibration.json", "--precision", "fp32", "--host_rounds", "0"],
     "error: --host_rounds must be at least 1"),
    (["--calibration", "no-such-calibration.json"], "error: cannot read the calibration no-such-calibration.json"),
    (["--calibrate", "calibration.json", "--precision", "fp32", "--tp_size", "2"],
     "error: a calibration measures the model unsplit"),
    (["--model", "vit-22b", "--image_size", 224, "--world_size", 64, "--global_batch", 64, "--tp_sizes", "3"],
     "error: tp_size 3 must divide the ranks per node (8)"),
    (["--global_batch", 64, "--tp_sizes", "two"], "error: --tp_sizes takes positive integers"),
    (["--model", "vit-22b", "--image_size", 224, "--tp_size", "5"],
     "error: tp_size 5 does not divide the 48 attention heads"),
])
def test_plan_bad_input_is_one_line(args, message):
    """plan.py's main, in this process (the same code path as the command line, without a new interpreter)."""
    proc = plan(*args)
    err = proc.stderr
    assert proc.returncode == 2 and err.startswith(message) and len(err.splitlines()) == 1, err


def test_validate_predicts_the_cpu_suite_within_its_targets():
    """`python -m benchmarks.validate` on the committed cpu suite: every DeepSpeed row is predicted from its configuration
    alone (meta device). Every peak is within ±10% of the measured one; on ViT-S, where the peak is not late in
    the backward, the prediction is the very peak the run planned with on the real model. The step times, from
    the calibration the suite measured for each shape (environment.json), are closer than the assumed ones and
    short of the measured ones (the ranks' lockstep at blocking reductions is not modelled: docs/planner.md):
    within the ±25% target on ViT-S; Swin-T's ZeRO-3 rows miss it in the committed run (its planner.md), so
    there they are held within ±35%."""
    import csv

    proc = run_entry("benchmarks.validate", "benchmarks/results/cpu/results.csv", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    with open(f"{REPO}/benchmarks/results/cpu/results.csv") as f:
        planned = {(r["shape"], r["config"]): float(r["planned_peak_mib"]) for r in csv.DictReader(f)
                   if r["engine"] == "deepspeed"}
    assert len(rows) == len(planned) >= 12
    for r in rows:
        assert abs(r["peak_error"]) <= 0.10, (r["config"], r["shape"], r["peak_error"])
        if r["shape"].startswith("ViT"):
            assert r["peak_predicted"] / 2**20 == pytest.approx(planned[r["shape"], r["config"]], abs=0.06)
        assert 0 < r["step_predicted"]
        # the shape's own operators, replayed, and the measured all-gather: closer than the square GEMM's rate
        assert r["calibration_failed_ops"] == 0 and r["calibration"]["comm_gbs"] > 0
        assert abs(r["step_error"]) < abs(r["step_error_assumed"]), (r["config"], r["shape"])
        bound = 0.25 if r["shape"].startswith("ViT") else 0.35
        assert -bound <= r["step_error"] < 0, (r["config"], r["shape"], r["step_error"])


def test_validate_predicts_the_host_bound_suite_with_the_host_probe():
    """The `host` suite's eager DeepSpeed rows (24 blocks of width 64, 2 images per rank: a step of host work),
    predicted with the host probe the run measured in its first repeat: the probe's host seconds carry the
    prediction most of the way, where the operators alone (the assumed step) fall more than 80% short, and
    ZeRO-3's micro-batches are host-bound. Whether each step lands within the ±25% target is the committed run's
    figure, rendered into README and docs/planner.md, not this test's."""
    proc = run_entry("benchmarks.validate", "benchmarks/results/host/results.csv", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["config"] for r in rows} == {"ZeRO-2 + none", "ZeRO-3 + none", "ZeRO-3 + selective", "ZeRO-3 + full"}
    for r in rows:
        assert r["calibration_source"].startswith("median of 5 measured in the run"), r["calibration_source"]
        assert r["host_micro_s"] > 0 and r["step_error_assumed"] < -0.8, (r["config"], r["step_error_assumed"])
        # the probe closes at least half of what the operators alone leave out
        assert abs(r["step_error"]) < abs(r["step_error_assumed"]) / 2, (r["config"], r["step_error"])
        assert r["host_bound"] or r["zero_stage"] != 3, r["config"]


# ZeRO-3 with tensor parallelism under -m slow: the default run plans and runs tensor parallelism (ZeRO-1) and
# selective (ZeRO-2); ZeRO-3 planned against measured runs: test_validate_predicts_the_cpu_suite_within_its_targets
@pytest.mark.parametrize("zero,ac,tp,sp", [(2, "selective", 1, 1), (1, "none", 2, 1),
                                          pytest.param(3, "none", 1, 2, marks=pytest.mark.slow),
                                          pytest.param(3, "selective", 2, 1, marks=pytest.mark.slow)],
                         ids=["zero2 selective", "zero1 none tp2", "zero3 none sp2", "zero3 selective tp2"])
def test_the_planner_predicts_a_run_no_suite_measures(tmp_path, zero, ac, tp, sp):
    """Configurations no committed suite runs (ViT-S/8 at 64 px, micro-batch 8; ZeRO-2 + `selective`, under
    DeepSpeed's AutoTP over both ranks, and with the tokens split over both ranks), measured now by the benchmark
    worker on 2 ranks: the planner's peak, from the configuration alone on the meta device (one tensor rank's
    share of the model under TP, one sequence rank's share of the tokens under SP), is within docs/planner.md's
    ±10% of the measured one."""
    from benchmarks.bench_worker import Spec, run_config
    from engine.ds_config import build_ds_config
    from models.registry import model_config
    from planner.devices import Device
    from planner.estimate import estimate

    spec = Spec(model="vit-small", image_size=64, patch_size=8, micro_batch_size=8, zero=zero, ac=ac, tp_size=tp,
                sp_size=sp, profiled_steps=2, timed_steps=1, count_flops=False)
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = fork_launch(["--spec", json.dumps(spec.__dict__), "--out", out], 2, env, 300,
                       module="benchmarks.bench_worker")
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = max(json.loads(out.read_text())["peak_alloc_bytes"])
    cfg = run_config(spec)
    hidden = model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size).hidden_size
    device = Device("cpu", 1e11, 1e6, 10.0, 10.0, 0.0, mem_gbs=10.0)  # the rates play no part in the peak
    predicted = estimate(cfg, build_ds_config(cfg, hidden, 2, "fp32"), "fp32", 2, 2, device)["peak_bytes"]
    assert abs(predicted / measured - 1) <= 0.10, (predicted / 2**20, measured / 2**20)


def test_calibrate_on_two_ranks_and_plan_with_it(tmp_path):
    """plan.py --calibrate on 2 ranks (forked, with the variables torchrun sets): both ranks measure, rank 0
    writes the slowest rank's replay and host probe and the lowest bandwidths; an estimate with --calibration charges the model's operators exactly the
    replayed seconds (the step without recompute is the replay plus the host's share beyond the bare model plus
    the optimizer's stream plus the all-gathers at the measured bandwidth; exactly at the profile's own batch,
    PROFILE_BATCH, which the planner's profile is scaled from). The host is probed under ZeRO-2 alone
    (--host_stages): a plan at another stage assumes the host's share.
    A calibration of another configuration is refused in one line."""
    from planner.host import host_seconds

    out = tmp_path / "calibration.json"
    keys = ["--model", "vit-debug", "--image_size", "16", "--micro_batch_size", str(PROFILE_BATCH), "--num_labels", "10",
            "--precision", "fp32"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    proc = fork_launch(["--calibrate", out, "--host_stages", 2, "--host_rounds", 1, *keys], 2, env, 300, module="plan")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cal = json.loads(out.read_text())
    assert cal["ranks"] == 2 and len(cal["per_rank"]) == 2 and cal["failed_ops"] == []
    assert cal["replay_seconds"] == max((r["replay_seconds"] for r in cal["per_rank"]), key=lambda s: sum(s.values()))
    for k in ("stream_gbs", "comm_gbs"):
        assert cal[k] == min(r[k] for r in cal["per_rank"]) > 0, k
    cluster = ["--world_size", "2", "--ranks_per_node", "2", "--device", "cpu", "--device_tflops", "0.1",
               "--device_memory_gb", "8"]
    proc = plan(*keys, *cluster, "--calibration", out, "--json")
    assert proc.returncode == 0, proc.stderr
    e = json.loads(proc.stdout)
    # the host probe: the slowest rank's seconds, each rising with the depth; charged after the operators
    host = cal["host"]
    assert host["blocks"] == [4, 12] and set(host["stages"]) == {"2"} and host["rounds"] == 1 and e["zero_stage"] == 2
    for stage, figures in host["stages"].items():
        for policy in ("none", "selective", "full"):
            seconds, bare = figures["micro"][policy], figures["plain"][policy]
            assert 0 < seconds[0] < seconds[1] and 0 < bare[0] < bare[1], (stage, policy, seconds, bare)
            assert seconds == [max(v) for v in zip(*(r["host"]["stages"][stage]["micro"][policy]
                                                     for r in cal["per_rank"]))]
        assert all(s > 0 for s in figures["step"])
    charged = host_seconds(host, e["zero_stage"], ["none"] * 2, serial=True)
    assert e["host"]["measured"] and e["host"]["micro_s"] == pytest.approx(charged["micro_s"])
    optimizer_s = 100 * e["params"] / 2 / (cal["stream_gbs"] * 1e9) + charged["step_s"]
    assert e["compute_s"] - optimizer_s - charged["micro_s"] == pytest.approx(sum(cal["replay_seconds"].values()),
                                                                             rel=1e-6)
    assert e["comm_s"] == pytest.approx(e["comm_bytes_per_step_per_rank"] / (cal["comm_gbs"] * 1e9), rel=1e-6)
    assert "as calibrated" in plan(*keys, *cluster, "--calibration", out).stdout
    # a search with it tries the calibrated micro-batch only, every candidate charged at its rates
    proc = plan(*keys, *cluster, "--calibration", out, "--global_batch", 8 * PROFILE_BATCH, "--json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["feasible"]
    assert found and {f["micro_batch_size"] for f in found} == {PROFILE_BATCH}
    assert all(f["calibrated"]["flops_per_s"] == cal["flops_per_s"] for f in found)
    assert {f["zero_stage"] for f in found} == {1, 2, 3}
    # the probe measured DeepSpeed's ZeRO-2 host time: FSDP2's candidates are charged the launch cost instead
    assert all(f["host"]["measured"] == (f["engine"] == "deepspeed" and f["zero_stage"] == 2) for f in found)
    assert {f["engine"] for f in found} == {"deepspeed", "fsdp2", "ddp"}
    proc = plan(*keys[:4], "--micro_batch_size", "8", *keys[6:], *cluster, "--calibration", out)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and \
        proc.stderr.startswith(f"error: {out} calibrated another configuration: micro_batch_size {PROFILE_BATCH} (not 8)")


def test_plan_vit_22b_at_a_small_batch_splits_its_layers(tmp_path):
    """ViT-22B at a global batch of 4,096 on 1,024 GPUs (4 images per GPU): the search tries tensor-parallel
    sizes 1 to 8, finds splitting the layers within a node faster than ZeRO (with ZeRO++) alone, says by how much,
    and writes tp_size into the recipe; --tp_sizes 1 keeps to data parallelism."""
    args = ["--model", "vit-22b", "--image_size", 224, "--num_labels", 1000, "--precision", "bf16", "--world_size",
            1024, "--ranks_per_node", 8, "--device", "h100-80gb", "--global_batch", 4096]
    proc = plan(*args, "--out", tmp_path / "plan")
    assert proc.returncode == 0, proc.stderr
    assert "the fastest of each tensor-parallel size:" in proc.stdout
    lines = {int(line.split()[1].rstrip(":")): line for line in proc.stdout.splitlines() if line.startswith("  tp ")}
    assert sorted(lines) == [1, 2, 4, 8]
    best = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert best["tp_size"] > 1 and f"tp {best['tp_size']}: " in lines[best["tp_size"]]
    speedup = float(lines[best["tp_size"]].rsplit(", ", 1)[1].split("x")[0])
    assert speedup > 1.0
    from config import parse

    assert parse(["--config", str(tmp_path / "plan" / "config.yaml")]).tp_size == best["tp_size"]
    proc = plan(*args, "--tp_sizes", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    alone = json.loads(proc.stdout)["best"]
    assert alone["tp_size"] == 1 and alone["images_per_s"] < best["images_per_s"]
    assert alone["images_per_s"] * speedup == pytest.approx(best["images_per_s"], rel=0.01)


def test_plan_searches_both_engines_and_says_which_is_faster(tmp_path):
    """A search tries FSDP2 and DDP beside ZeRO 1-3 (without tensor parallelism), names each engine's fastest and
    why they differ; `--engine` keeps one; a plan whose best is FSDP2 writes a recipe and a launch line, no engine
    config."""
    args = ["--model", "vit-huge", "--image_size", 224, "--num_labels", 1000, "--precision", "bf16", "--device",
            "h100-80gb", "--world_size", 64, "--ranks_per_node", 8, "--global_batch", 4096, "--tp_sizes", 1]
    proc = plan(*args)
    assert proc.returncode == 0, proc.stderr
    assert "the fastest of each engine:" in proc.stdout and "| FSDP2 " in proc.stdout
    assert re.search(r"\n  (deepspeed|fsdp2|ddp) is [\d.]+x faster than (deepspeed|fsdp2|ddp), mostly by "
                     r"(compute|communication)", proc.stdout)
    only = plan(*args, "--engine", "fsdp2", "--json", "--top", 1000, "--out", tmp_path / "plan")
    found = json.loads(only.stdout)
    assert {e["engine"] for e in found["feasible"]} == {"fsdp2"}
    # across 8 nodes HSDP (a replica per node) is searched beside the 1-D mesh: its gathers stay within a node,
    # and between nodes only the fp32 gradient shard's all-reduce crosses
    same = {}
    for e in found["feasible"]:
        same.setdefault((e["zero_stage"], e["micro_batch_size"], e["ac"]), {})[e["replicate_degree"]] = e
    pairs = [v for v in same.values() if set(v) == {1, 8}]
    assert pairs and all(v[8]["comm_bytes_between_nodes"] < v[1]["comm_bytes_between_nodes"] for v in pairs)
    assert all(v[8]["step_s"] < v[1]["step_s"] for v in pairs)
    # a recipe of train.py's keys, no engine config: train.py builds FSDP2's from them (and from those a run adds)
    assert sorted(p.name for p in (tmp_path / "plan").iterdir()) == ["config.yaml", "launch.sh", "plan.json",
                                                                    "search.md"]
    assert "--ds_config" not in (tmp_path / "plan" / "launch.sh").read_text()
    assert "engine: fsdp2" in (tmp_path / "plan" / "config.yaml").read_text()


def test_a_written_plan_composes_with_the_keys_a_run_adds(debug_args, tmp_path):
    """plan.py --out writes a recipe of train.py's keys, no resolved engine config: a run adds its own lr and
    beta2 to it, and a resume on another accumulation (the same global batch on fewer ranks) takes it too."""
    out = tmp_path / "plan"
    proc = plan("--model", "vit-debug", "--image_size", 16, "--num_labels", 10, "--precision", "fp32", "--engine",
                "deepspeed", "--world_size", 2, "--ranks_per_node", 2, "--device", "cpu", "--device_tflops", 0.1,
                "--device_memory_gb", 8, "--global_batch", 32, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "launch.sh", "plan.json", "search.md"]
    assert "why: " in proc.stdout
    run = tmp_path / "run"
    args = debug_args + ["--config", out / "config.yaml", "--micro_batch_size", 16, "--grad_accum_steps", 1,
                         "--max_steps", 4, "--save_every", 2, "--eval_every", 0, "--output_dir", run]
    launch(args + ["--lr", "4e-4", "--beta2", "0.95"])
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["optimizer"]["params"]["lr"] == 4e-4 and ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
    resumed = tmp_path / "resumed"
    proc = launch(args[:-2] + ["--lr", "4e-4", "--beta2", "0.95", "--grad_accum_steps", 2, "--output_dir", resumed,
                               "--resume", run / "checkpoints" / "step0000002"], nproc=1)
    assert "at step 2" in proc.stdout
    assert json.loads((resumed / "ds_config.json").read_text())["gradient_accumulation_steps"] == 2


def test_a_search_over_pipeline_sizes_says_what_each_costs_and_a_pipelined_plan_runs(tmp_path):
    """--pp_sizes adds pipelines (FSDP2 and DDP only) to the search: the table's PP columns, the fastest of each
    size with its bubble and its traffic between stages; a plan of one pipeline prints each stage's peak, and
    the recipe it writes keeps pp_size."""
    args = ["--model", "vit-large", "--image_size", 224, "--num_labels", 1000, "--precision", "bf16", "--device",
            "h100-80gb", "--world_size", 16, "--ranks_per_node", 8, "--global_batch", 1024, "--tp_sizes", 1]
    proc = plan(*args, "--pp_sizes", "2,4", "--json", "--top", 1000)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["feasible"]
    staged = [e for e in found if e["pp_size"] > 1]
    assert {e["pp_size"] for e in staged} == {2, 4} and {e["engine"] for e in staged} <= {"fsdp2", "ddp"}
    assert all(e["global_batch"] == 1024 and e["micro_batch_size"] % e["pp_microbatches"] == 0 and
               e["bubble"] == pytest.approx((e["pp_size"] - 1) / (e["pp_microbatches"] + e["pp_size"] - 1))
               for e in staged)
    text = plan(*args, "--pp_sizes", "2,4").stdout
    assert "| PP |" in text and re.search(r"\n  pp 4: .*bubble \d+% of \d+ pieces, between stages \d+ ms, "
                                          r"[\d.]+x pp 1's", text)
    one = plan("--model", "vit-large", "--image_size", 224, "--num_labels", 1000, "--precision", "bf16",
               "--device", "h100-80gb", "--world_size", 16, "--ranks_per_node", 8, "--engine", "fsdp2",
               "--pp_size", 4, "--micro_batch_size", 32)
    assert one.returncode == 0, one.stderr
    assert "x pipeline 4 (1f1b, 16 pieces a micro-batch, bubble 16%)" in one.stdout
    assert re.search(r"stages \(blocks: peak GiB, pieces held, ac plan\): 0-5: [\d.]+, 4, .*; 18-23: [\d.]+, 1, ",
                     one.stdout)
    bad = plan(*args, "--pp_sizes", "3")
    assert bad.returncode == 2 and bad.stderr == "error: --pp_sizes: pp_size 3 does not divide the world size (16)\n"
