"""loop/timing.py: the timed regions of train.py and the benchmark worker start (and the worker's end) on the
device-synchronising clock.

On a GPU a step's kernels and NCCL collectives return before they finish, so a step time read without a
synchronisation is the host's enqueue time. This cannot be timed wrong on a CPU, so the tests check what can be
checked here: the clock waits on the device it is given, and both programs read their step times from it, counted
in the real processes through a wrapper installed from outside (a sitecustomize on PYTHONPATH).
"""
import json
import os
import subprocess
import sys
import time

import torch
from conftest import REPO

from launch.job import command
from loop import timing

COUNTER = '''
import json, os, loop.timing as timing
_sync = timing.synchronize
def synchronize(device):
    with open(os.environ["SYNC_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "device": device.type}) + "\\n")
    return _sync(device)
timing.synchronize = synchronize
'''


def test_clock_waits_on_the_device_it_is_given():
    seen = []
    original = timing.synchronize
    try:
        timing.synchronize = seen.append
        before = time.perf_counter()
        assert timing.clock(torch.device("cpu")) >= before
    finally:
        timing.synchronize = original
    assert seen == [torch.device("cpu")]


def _counted_run(cmd, tmp_path, extra_env=None):
    (tmp_path / "sitecustomize.py").write_text(COUNTER)
    log = tmp_path / "sync.jsonl"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", SYNC_LOG=str(log), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", **(extra_env or {}))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, [json.loads(line) for line in log.read_text().splitlines()]


def test_train_py_starts_its_steps_on_the_clock(debug_args, tmp_path):
    """The loop's time starts on the clock; each logging interval ends on its one read of the device, after
    which the device has finished the interval's work (tests/integration/test_syncs.py counts those reads)."""
    out = tmp_path / "run"
    _, calls = _counted_run([sys.executable, "train.py", *debug_args, "--max_steps", "4", "--eval_every", "0",
                             "--save_every", "0", "--output_dir", str(out)], tmp_path)
    assert len(calls) >= 1 and {c["device"] for c in calls} == {"cpu"}
    with open(out / "metrics.jsonl") as f:
        assert all(r["images_per_sec"] > 0 for r in map(json.loads, f))


def test_bench_worker_times_each_step_on_the_clock(tmp_path):
    spec = {"engine": "deepspeed", "zero": 2, "profiled_steps": 1, "timed_steps": 3, "count_flops": False}
    result = tmp_path / "result.json"
    _, calls = _counted_run(command("torchrun", 1, script=["-m", "benchmarks.bench_worker"]) +
                            ["--spec", json.dumps(spec), "--out", str(result)],
                            tmp_path, {"DS_ACCELERATOR": "cpu"})
    steps = spec["profiled_steps"] + spec["timed_steps"]
    assert len(calls) >= 2 * steps and {c["device"] for c in calls} == {"cpu"}
    assert len(json.loads(result.read_text())["step_seconds"]) == spec["timed_steps"]
