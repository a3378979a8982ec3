"""train.py runs unchanged under torchrun, accelerate launch and plain python."""
import json
import os

import numpy as np
import pytest
from conftest import REPO, check_input, launch, read_metrics


@pytest.mark.slow  # both launchers train in the default suite: tests/integration/test_multinode.py's Slurm script per launcher
def test_torchrun_matches_deepspeed_launcher(debug_args, tmp_path):
    """Two launchers, same ranks and seed: identical losses."""
    args = debug_args + ["--model", "vit-debug", "--zero_stage", "2", "--max_steps", "20", "--eval_every", "0"]
    proc = launch(args + ["--output_dir", tmp_path / "ds"], launcher="deepspeed")
    # DeepSpeed's shared-memory all-reduce buffers (~68 MB a rank) must not outlive the run
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("deepspeed_") and f"_{proc.port}_" in f]
    proc = launch(args + ["--output_dir", tmp_path / "tr"], launcher="torchrun", warnings=True)
    # what a user sees: the run's own lines, not the libraries' (kineto's profiler markers, the CPU allocator's
    # warning under the profiled step, torch's deprecations of collectives DeepSpeed calls, DeepSpeed's op build
    # and accelerator lines)
    noise = ("USDT:", "Memory block of unknown size", "is deprecated", "built successfully", "Setting accelerator")
    assert [n for n in noise if n in proc.stdout + proc.stderr] == []
    assert "done: val top-1" in proc.stdout
    ds = [r["loss"] for r in read_metrics(tmp_path / "ds")]
    tr = [r["loss"] for r in read_metrics(tmp_path / "tr")]
    assert len(ds) == 20
    np.testing.assert_array_equal(ds, tr)


def test_accelerate_launch_two_ranks(debug_args, tmp_path):
    """Plain `accelerate launch --multi_gpu` (its torchrun path, no plugin): the default run's start of it."""
    proc = launch(debug_args + ["--max_steps", "5", "--eval_every", "0", "--output_dir", tmp_path / "run"],
                  launcher="accelerate")
    assert "world size 2" in proc.stdout and "done:" in proc.stdout
    assert len(read_metrics(tmp_path / "run")) == 5


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])  # the plugin's path is one
def test_accelerate_deepspeed_plugin_sets_the_stage(stage_runs, debug_args, tmp_path, stage):
    """`accelerate launch --config_file accelerate_configs/zeroN.yaml`, as accelerate users run DeepSpeed: the run
    takes ZeRO-N from the config's DeepSpeed JSON and reproduces the deepspeed launcher's ZeRO-N losses bitwise."""
    run = tmp_path / "run"
    launch(debug_args + ["--model", "vit-debug", "--output_dir", run], accelerate_config=f"accelerate_configs/zero{stage}.yaml")
    assert json.loads((run / "ds_config.json").read_text())["zero_optimization"]["stage"] == stage
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(stage_runs["vit-debug", stage])]


@pytest.mark.slow  # its variables are read in tests/unit/test_config.py; the engine's steps in tests/integration/test_fsdp2.py
def test_accelerate_fsdp_plugin_runs_the_fsdp2_engine(debug_args, tmp_path):
    """`accelerate launch --config_file accelerate_configs/fsdp2.yaml`, as accelerate users run FSDP2: the run takes
    the FSDP2 engine with resharding (zero_stage 3) and gives the losses a forked `--engine fsdp2` run gives."""
    args = debug_args + ["--model", "vit-debug", "--max_steps", 6, "--eval_every", 0, "--save_every", 0]
    run = tmp_path / "run"
    proc = launch(args + ["--output_dir", run], accelerate_config="accelerate_configs/fsdp2.yaml")
    assert "FSDP2 (resharded after forward)" in proc.stdout
    launch(args + ["--output_dir", tmp_path / "fork", "--engine", "fsdp2", "--zero_stage", 3])
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(tmp_path / "fork")]


@pytest.mark.slow  # ZeRO-Offload's CPU Adam, a path few runs take; ~20 s
def test_accelerate_zero3_offload_steps_with_cpu_adam(stage_runs, debug_args, tmp_path, cpu_adam):
    """accelerate_configs/zero3_offload.yaml: ZeRO-3 with the optimizer states and parameter partitions in CPU
    memory, stepped by DeepSpeed's CPU Adam (built at the session's start: conftest.deepspeed_ops), giving the losses torch's AdamW gives under
    ZeRO-3 to within the two implementations' rounding."""
    run = tmp_path / "run"
    proc = launch(debug_args + ["--model", "vit-debug", "--output_dir", run], timeout=600,
                  accelerate_config="accelerate_configs/zero3_offload.yaml")
    assert "| DeepSpeedCPUAdam |" in proc.stdout
    zero = json.loads((run / "ds_config.json").read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    ours, theirs = ([r["loss"] for r in read_metrics(d)] for d in (run, stage_runs["vit-debug", 3]))
    # the rounding differences grow as training goes on: the first 30 steps are compared
    assert ours != theirs and ours[:30] == pytest.approx(theirs[:30], rel=1e-6)


def test_accelerate_config_contradicting_the_run_config_is_one_error(debug_args, tmp_path, capsys, monkeypatch):
    """accelerate_configs/zero3.yaml's variables, as `accelerate launch` sets them from it (the plugin's test above
    launches it): a command line naming another stage is one error, before anything is written."""
    import yaml

    plugin = yaml.safe_load(open(os.path.join(REPO, "accelerate_configs", "zero3.yaml")))
    assert plugin["distributed_type"] == "DEEPSPEED"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", plugin["deepspeed_config"]["deepspeed_config_file"])
    code, lines = check_input(debug_args + ["--zero_stage", 2, "--output_dir", tmp_path / "run"], capsys, monkeypatch)
    assert code != 0
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == ["error: the accelerate config sets ZeRO stage 3 (in ds_configs/zero3.json) but the command "
                      "line says zero_stage 2: remove one of them"]
    assert not (tmp_path / "run").exists()


def test_plain_python_one_rank(debug_args, tmp_path):
    proc = launch(debug_args + ["--max_steps", "5", "--eval_every", "0", "--output_dir", tmp_path / "run"],
                  launcher="python")
    assert "world size 1" in proc.stdout and "global batch 16" in proc.stdout
    assert len(read_metrics(tmp_path / "run")) == 5


def test_bf16_trains_on_cpu(debug_args, tmp_path):
    """The bf16 path runs end to end (slowly: no AVX-512 BF16 here); its speed is measured on GPUs."""
    launch(debug_args + ["--max_steps", "3", "--eval_every", "0", "--micro_batch_size", "4", "--precision", "bf16",
                         "--output_dir", tmp_path / "run"], nproc=1)
    records = read_metrics(tmp_path / "run")
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)
    import json

    with open(tmp_path / "run" / "ds_config.json") as f:
        assert json.load(f)["bf16"]["enabled"] is True


def test_grad_accumulation_on_one_rank_matches_two_ranks(stage_runs, debug_args, tmp_path):
    """16 x 2 accumulated on 1 rank = 16 on each of 2 ranks: the same 32 samples per step (the same data streams,
    docs/data.md), the same mean loss and update up to fp32 summation order. The first 8 steps are inside the
    10-step warm-up, whose LR does not depend on max_steps."""
    proc = launch(debug_args + ["--model", "vit-debug", "--zero_stage", "2", "--max_steps", "8", "--eval_every", "0",
                                "--grad_accum_steps", "2", "--output_dir", tmp_path / "acc"], nproc=1)
    assert "global batch 32 = 16 micro x 2 accum x 1 ranks" in proc.stdout
    two = read_metrics(stage_runs["vit-debug", 2])[:8]
    acc = read_metrics(tmp_path / "acc")
    np.testing.assert_allclose([r["loss"] for r in acc], [r["loss"] for r in two], rtol=1e-5)
    assert [r["lr"] for r in acc] == [r["lr"] for r in two]


@pytest.mark.slow  # whether a worker outlives its rank depends on when the launcher kills it: the mechanism is
# tested deterministically by tests/integration/test_data.py::test_a_loader_worker_ends_with_its_rank
def test_a_failed_job_is_gone_when_its_launcher_returns(debug_args, tmp_path, monkeypatch):
    """Rank 1 of a deepspeed-launched job raises at its third step, with a loader worker per rank: when the
    launcher has returned, no process of the job is left (its ranks, their loader workers) and the master port
    binds at once, so an immediate relaunch on it starts. A worker ends with its rank (data/loader.py's
    _worker_init): before, global rank 0's worker held the store's port for seconds after the launcher returned."""
    import socket
    import uuid

    import psutil

    mark = uuid.uuid4().hex
    monkeypatch.setenv("JOB_MARK", mark)  # inherited by every process of the job
    proc = launch(debug_args + ["--max_steps", 10, "--eval_every", 0, "--num_workers", 1, "--output_dir",
                                tmp_path / "run"], launcher="deepspeed", faults={"RAISE": "1:3"}, check=False)
    left = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("JOB_MARK") == mark:
                left.append((p.pid, " ".join(p.cmdline())[:80]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(proc.port)))  # EADDRINUSE while a process of the job still holds it
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert left == []
