"""Shared fixtures: digits shards in a temp dir, a launcher for real multi-process runs, the debug run."""
import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
# DeepSpeed's JIT-built ops (the CPU shm all-reduce, CPU Adam) in this environment's own folder: two checkouts
# share ~/.cache/torch_extensions otherwise, rebuild each other's ops and wait forever on a lock a killed build left
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# The one tiny configuration every integration test trains (torchtitan's "debug model").
DEBUG_ARGS = ["--image_size", "16", "--micro_batch_size", "16", "--max_steps", "120", "--warmup_steps", "10",
              "--lr", "3e-3", "--eval_every", "60", "--save_every", "60", "--num_workers", "0",
              "--shuffle_buffer", "200", "--progress", "false"]


INJECT = os.path.join(REPO, "benchmarks", "inject")  # faults installed from outside train.py (its sitecustomize.py)


def with_faults(env: dict, faults: dict) -> dict:
    """`env` with benchmarks/inject on PYTHONPATH and its variables set: {"RAISE": "1:3", "NAN_AT": "5,6"}."""
    path = os.pathsep.join(p for p in (INJECT, env.get("PYTHONPATH", "")) if p)
    return dict(env, PYTHONPATH=path, **{f"INJECT_{k}": v for k, v in faults.items()})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, nproc=2, launcher="deepspeed", timeout=300, check=True, warnings=False, accelerate_config=None):
    """Run train.py as real processes: `deepspeed`, `torchrun`, `accelerate` or plain `python` (1 rank).
    `warnings`: leave Python's warnings on, as a user has them. `accelerate_config`: `accelerate launch
    --config_file` with that file (its DeepSpeed plugin) instead of the plain torchrun path."""
    port = str(free_port())
    if accelerate_config:
        cmd = [f"{BIN}/accelerate", "launch", "--config_file", accelerate_config, "--num_processes", str(nproc),
               "--main_process_port", port, "train.py"]
    elif launcher == "deepspeed":
        cmd = [f"{BIN}/deepspeed", "--num_gpus", str(nproc), "--master_port", port, "train.py"]
    elif launcher == "torchrun":
        cmd = [f"{BIN}/torchrun", "--nproc_per_node", str(nproc), "--master_port", port, "train.py"]
    elif launcher == "accelerate":  # --multi_gpu is its torchrun path; with --cpu it would start one process
        cmd = [f"{BIN}/accelerate", "launch", "--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port, "train.py"]
    else:
        cmd = [sys.executable, "train.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if not warnings:
        env["PYTHONWARNINGS"] = "ignore"
    env.pop("RANK", None)
    proc = subprocess.run(cmd + [str(a) for a in args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    proc.port = port
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def check_input(args, capsys, monkeypatch):
    """train.py's input checks in this process, the code a launch runs before any process group forms: (exit code,
    the non-blank lines printed to stderr); the code is 0 when the input passed."""
    import train

    monkeypatch.chdir(REPO)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    capsys.readouterr()
    try:
        train.check_input([str(a) for a in args], rank=0, world_size=1)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def run_plan(*args) -> subprocess.CompletedProcess:
    """plan.py's main in this process, from the repository root: the exit code and what it printed, as the
    command would give them (it starts no process group unless launched: --calibrate under torchrun)."""
    import contextlib
    import io

    import plan

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan.main([str(a) for a in args])
    return subprocess.CompletedProcess(["plan.py", *map(str, args)], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops():
    """DeepSpeed's CPU shared-memory all-reduce, which it JIT-builds on first use (a minute or two on 2 cores),
    built here once before any launch: no test's timeout includes the build, and no test's killed rank leaves the
    build's lock behind for every later launch to wait on."""
    import torch

    if torch.cuda.is_available():
        return
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """Train/val shard specs of the bundled digits, written once per session."""
    out = tmp_path_factory.mktemp("digits")
    subprocess.run([sys.executable, "data/make_shards.py", "digits", str(out)], cwd=REPO, check=True,
                   capture_output=True)
    return {"train": f"{out}/train-{{000000..000003}}.tar", "val": f"{out}/val-000000.tar", "dir": str(out)}


@pytest.fixture(scope="session")
def debug_args(digits):
    return DEBUG_ARGS + ["--train_shards", digits["train"], "--val_shards", digits["val"]]


MODELS, STAGES = ("vit-debug", "swin-debug"), (1, 2, 3)


@pytest.fixture(scope="session")
def stage_runs(debug_args, tmp_path_factory):
    """The debug run of each model under ZeRO 1, 2 and 3 on 2 ranks: 120 steps, checkpoints at 60 and 120."""
    root = tmp_path_factory.mktemp("stages")
    runs = {}
    for model in MODELS:
        for stage in STAGES:
            out = root / f"{model}-zero{stage}"
            launch(debug_args + ["--model", model, "--zero_stage", stage, "--output_dir", out])
            runs[model, stage] = str(out)
    return runs
