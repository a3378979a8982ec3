"""Crash safety on real 2-rank jobs: kill -9 at any moment and preemption signals resume exactly; checkpoints are
atomic, pruned and refused when the disk cannot hold them. Each interrupted run is continued with
`--resume latest` and compared with the uninterrupted 2-rank reference of the same seed (conftest.stage_runs)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, ForkedJob, free_port, launch, launcher_command, read_metrics

from loop.preemption import DUPLICATE_WINDOW_S, EXIT_GRACE_EXPIRED, EXIT_PREEMPTED
from train import EXIT_COLLECTIVE, EXIT_NONFINITE


def start(args, launcher="deepspeed"):
    """A 2-rank job in its own process group, as a scheduler would see it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    cmd = launcher_command(launcher, 2, str(free_port())) + [str(a) for a in args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for(predicate, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the job ended first:\n{(proc.communicate()[0] or '')[-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def steps_logged(run_dir):
    try:
        return len(open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines())
    except FileNotFoundError:
        return 0


# a whole job killed mid-run is also tests/integration/test_fault_injection.py's kill-save, kill-eval and kill-export cases
@pytest.mark.parametrize("victim", [pytest.param("job", marks=pytest.mark.slow), "rank 1"])
def test_kill_9_mid_run_resumes_exactly(stage_runs, debug_args, tmp_path, victim):
    """kill -9 of the whole job, or of rank 1 alone (DeepSpeed's launcher then ends the job: it signals rank 0,
    which cannot finish its step without rank 1 and exits after its 2 s grace), after the step-20 checkpoint; an
    interrupted save (a .partial directory) and a metrics line cut mid-write are left behind as a kill leaves
    them. The relaunch removes the first, drops the second, resumes from step 20 and reproduces the reference's
    losses bitwise; keep_last 2 + keep_best prune."""
    import psutil

    run = tmp_path / "run"
    args = debug_args + ["--model", "vit-debug", "--zero_stage", 2, "--save_every", 10, "--keep_last", 2,
                         "--preempt_grace", 2, "--output_dir", run]
    proc = start(args)
    wait_for(lambda: (run / "checkpoints" / "step0000020" / "train_state.json").exists(), proc)
    if victim == "job":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        next(p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in p.cmdline()).kill()
    out = proc.communicate(timeout=90)[0]
    assert proc.returncode != 0, out[-3000:]
    assert not (run / "checkpoints" / "step0000030").exists()  # no complete checkpoint after the kill
    ckpts = run / "checkpoints"
    (ckpts / "step0000030.partial").mkdir(exist_ok=True)  # what a kill mid-save leaves
    (ckpts / "step0000030.partial" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"cut")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "lo')  # a record cut mid-write
    proc = launch(args + ["--resume", "latest"])
    assert "removed step0000030.partial, left by an interrupted save" in proc.stdout
    assert "at step 20" in proc.stdout
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 61))
    reference = read_metrics(stage_runs["vit-debug", 2])
    assert [r["loss"] for r in records[20:]] == [r["loss"] for r in reference[20:]]
    # steps 50 and 60 are the newest two; 30 has the best val top-1 of the evaluated saves (30, 60) unless 60 is
    # better, and then only two remain
    kept = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step"))
    best = max((r["val_top1"], r["step"]) for r in records if "val_top1" in r)[1]
    assert kept == sorted({"step0000050", "step0000060", f"step{best:07d}"})


# torchrun's agent passes SIGTERM on as `accelerate launch --multi_gpu` (the same agent) does in
# tests/integration/test_fault_injection.py's sigterm case
@pytest.mark.parametrize("launcher", ["deepspeed", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_sigterm_finishes_the_step_checkpoints_and_resumes_exactly(stage_runs, debug_args, tmp_path, launcher):
    """SIGTERM to every process of the job, as Slurm's scancel and Kubernetes send it (the launcher passes it on
    to the ranks as well: the same request twice): the ranks finish their step, write a checkpoint of it together
    and exit with EXIT_PREEMPTED (the launcher then exits non-zero); the relaunch continues bitwise."""
    run = tmp_path / "run"
    args = debug_args + ["--model", "vit-debug", "--zero_stage", 3, "--output_dir", run]
    proc = start(args, launcher)
    wait_for(lambda: steps_logged(run) >= 12, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, out[-3000:]
    line = next((line for line in out.splitlines() if line.startswith("preempted (SIGTERM) after step")), out[-3000:])
    step = int(line.split("after step ")[1].split(":")[0])
    assert f"checkpoint step{step:07d} written; continue with --resume latest" in line
    assert 12 <= step < 60
    proc = launch(args + ["--resume", "latest"])
    assert f"at step {step}" in proc.stdout and "data order restarts" not in proc.stdout
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 61))
    reference = read_metrics(stage_runs["vit-debug", 3])
    np.testing.assert_array_equal([r["loss"] for r in records], [r["loss"] for r in reference])


def test_second_signal_exits_at_once_and_grace_bounds_the_wait(debug_args, tmp_path):
    """One rank, signalled mid-step. SIGUSR1: the step finishes, its checkpoint is written, exit EXIT_PREEMPTED.
    With a step of a few seconds (ViT-Tiny, 112 px, 192 images): SIGUSR1, then SIGTERM after the duplicate window,
    ends the process at once; SIGUSR1 with a 1 s grace exits with EXIT_GRACE_EXPIRED and one line, without a
    checkpoint."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    args = [*debug_args, "--eval_every", 0, "--save_every", 0]
    slow = ["--model", "vit-tiny", "--image_size", 112, "--micro_batch_size", 192]  # ~4 s per step here
    for case in ("checkpoint", "second signal", "grace"):
        run = tmp_path / case.replace(" ", "-")
        extra = {"checkpoint": ["--model", "vit-debug", "--preempt_grace", 60], "second signal": slow + [
            "--preempt_grace", 60], "grace": slow + ["--preempt_grace", 1]}[case]
        proc = ForkedJob([*args, *extra, "--output_dir", run], 1, env)
        wait_for(lambda: steps_logged(run) >= 1, proc)  # step 2 has begun: on CPU the profiled one
        start = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        if case == "second signal":
            time.sleep(DUPLICATE_WINDOW_S + 0.5)  # a repeat within the window counts as the same request
            proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
        out, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - start
        if case == "checkpoint":  # the step finishes, its checkpoint is written, the exit says so
            assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
            step = int(out.split("preempted (SIGUSR1) after step ")[1].split(":")[0])
            assert f"checkpoint step{step:07d} written; continue with --resume latest" in out
            assert (run / "checkpoints" / f"step{step:07d}" / "train_state.json").exists()
            continue
        if case == "second signal":
            assert proc.returncode == 128 + signal.SIGTERM and elapsed < 1, (proc.returncode, elapsed, err[-2000:])
        else:
            assert proc.returncode == EXIT_GRACE_EXPIRED, err[-2000:]
            assert err.strip().splitlines()[-1].startswith("error: SIGUSR1 received 1 s ago (preempt_grace)")
        assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step*"))


def test_a_line_written_inside_the_profiled_step_survives_an_exit():
    """The CPU's profiled step holds what C++ writes to stderr (to drop the profiler's own lines); a line Python
    writes there (a preemption's or an error's) goes out at once, even when the process ends inside."""
    code = ("import os, sys\nfrom loop.peak_memory import memory_profiler\nwith memory_profiler():\n"
            "    print('error: the last line', file=sys.stderr, flush=True)\n    os._exit(4)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4 and proc.stderr.strip().splitlines()[-1] == "error: the last line", proc.stderr


def test_a_checkpoint_the_disk_cannot_hold_is_skipped_and_training_goes_on(debug_args, tmp_path):
    proc = launch(debug_args + ["--model", "vit-debug", "--max_steps", 4, "--save_every", 2, "--eval_every", 0,
                                "--min_free_gb", 1e9, "--output_dir", tmp_path / "run"], nproc=1)
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 2 and "step0000002 not written: it needs about" in warnings[0]
    assert "of which 1e+09 GiB are kept free (min_free_gb); training goes on" in warnings[0]
    assert "done:" in proc.stdout and len(read_metrics(tmp_path / "run")) == 4
    assert not any((tmp_path / "run" / "checkpoints").glob("step*"))
    assert len(json.loads((tmp_path / "run" / "hf_model" / "config.json").read_text())["id2label"]) == 10


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(debug_args, tmp_path):
    """NaN injected into the loss of steps 5 and 6 (benchmarks/inject's INJECT_NAN_AT): both steps are skipped on every
    rank,
    counted, and logged as null; the LR schedule does not advance over them, and the run finishes and exports.
    Injected into 3 steps in a row with max_bad_steps 3: the run stops there with EXIT_NONFINITE and one line."""
    args = debug_args + ["--model", "vit-debug", "--zero_stage", 3, "--max_steps", 10, "--eval_every", 0,
                         "--save_every", 0]
    run = tmp_path / "skipped"
    launch(args + ["--output_dir", run], faults={"NAN_AT": "5,6"})
    records = read_metrics(run)
    assert [r["loss"] is None for r in records] == [False] * 4 + [True] * 2 + [False] * 4
    assert [r["opt/nonfinite_steps"] for r in records] == [0] * 4 + [1, 2] + [2] * 4
    assert records[6]["lr"] == records[4]["lr"]  # step 7 takes the LR step 5 would have had
    assert (run / "hf_model" / "model.safetensors").exists()
    for stage in (1, 2):  # DeepSpeed's ZeRO-1/2 optimizer skips them too (one rank is enough to show it)
        run = tmp_path / f"skipped-zero{stage}"
        launch(args + ["--zero_stage", stage, "--output_dir", run], nproc=1, faults={"NAN_AT": "5,6"})
        records = read_metrics(run)
        assert [r["opt/skipped_steps"] for r in records] == [0] * 4 + [1, 2] + [2] * 4
        assert records[6]["lr"] == records[4]["lr"]

    run = tmp_path / "stopped"
    proc = launch(args + ["--max_bad_steps", 3, "--output_dir", run], nproc=1, check=False,
                  faults={"NAN_AT": "3,4,5,6"})
    assert proc.returncode == EXIT_NONFINITE, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: step 5: the loss or the gradients were not finite in 3 steps in a row (max_bad_steps), each one "
        "skipped; the weights are those of step 2")
    assert len(read_metrics(run)) == 5 and not (run / "hf_model").exists()


def test_a_stalled_rank_fails_the_job_within_the_timeout_and_is_named(debug_args, tmp_path):
    """Rank 1 stopped (SIGSTOP) mid-run: rank 0, waiting in DeepSpeed's shared-memory all-reduce (which has no
    timeout), stops within dist_timeout with one line saying where each rank last reported (rank 1 not ahead of
    it), and exits EXIT_COLLECTIVE; the launcher then ends the job (rank 1 is continued so that it can be
    terminated at once)."""
    import psutil

    run = tmp_path / "run"
    out = open(tmp_path / "out.log", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    args = debug_args + ["--model", "vit-debug", "--max_steps", 100000, "--eval_every", 0, "--save_every", 0,
                         "--dist_timeout", 6, "--output_dir", run]
    proc = subprocess.Popen(launcher_command("deepspeed", 2, free_port()) + [str(a) for a in args],
                            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: steps_logged(run) >= 20, proc)
        rank1 = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "--local_rank=1" in p.cmdline())
        rank1.suspend()
        stopped = time.monotonic()
        log = lambda: open(tmp_path / "out.log").read()  # noqa: E731
        while "error: rank 0: " not in log():
            assert time.monotonic() - stopped < 6 + 30, log()[-3000:]
            time.sleep(0.2)
        elapsed = time.monotonic() - stopped
        rank1.resume()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = next(line for line in log().splitlines() if line.startswith("error: rank 0: "))
    assert "Where the ranks last reported: rank 0: step" in line and "; rank 1: step" in line, line
    steps = dict(re.findall(r"rank (\d): step (\d+)", line.split("last reported: ")[1]))
    assert int(steps["1"]) <= int(steps["0"]), line  # the stalled rank is not ahead
    assert proc.returncode != 0 and elapsed < 6 + 15, (proc.returncode, elapsed)
    assert f"exits with return code = {EXIT_COLLECTIVE}" in log()
