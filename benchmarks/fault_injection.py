"""Fault injection: real 2-rank training jobs, each hit by one fault at a point a seed chooses, continued with
`--resume latest` until they finish, and compared with an uninterrupted run of the same seed.

    python -m benchmarks.fault_injection --faults 48 --seed 0      # report in benchmarks/results/faults/
    python -m benchmarks.fault_injection --kinds kill-save,stall --faults 4 --out /tmp/faults
    python -m benchmarks.fault_injection --task segmentation --kinds sigterm,kill-eval --faults 4 --out /tmp/seg
    python -m benchmarks.fault_injection --engine fsdp2 --faults 16 --out /tmp/fsdp2   # FSDP2 jobs (docs/engines.md)

The faults (`--kinds`, default all), each at a random step, save, evaluation or launcher as the seed draws:
  kill-rank      kill -9 of one rank mid-step
  kill-job       kill -9 of every process of the job mid-step
  kill-save      kill -9 of the job while a checkpoint is being written (its .partial directory exists)
  kill-eval      kill -9 of the job while rank 0 evaluates (read from the heartbeat in the master's store)
  kill-export    kill -9 of the job while the final Hugging Face export is written
  sigterm        SIGTERM to the job, as Slurm and Kubernetes send it before a kill
  sigusr1        SIGUSR1 to the ranks, as Slurm's --signal sends it
  stall          SIGSTOP of one rank: the others must stop the job within dist_timeout
  nan            a NaN loss injected into one step (benchmarks/inject: INJECT_NAN_AT)
  enospc         one rank's checkpoint write fails half-way with ENOSPC (benchmarks/inject: INJECT_ENOSPC_AT)
  disk-full      the checkpoint volume (a 16 MiB tmpfs) filled before or during a save, freed 15 steps later;
                 needs mount permission, else the fault is reported as not run
  shard-truncate a training shard cut at a random byte mid-run
  shard-delete   a training shard deleted mid-run
  raise          an exception raised in one rank's step (benchmarks/inject: INJECT_RAISE): the job must end in
                 seconds with exit 1 and the rank's traceback in errors/
  bad-label      a shard whose labels are out of range (>= num_labels) at a few samples: skipped and counted
  pipe-fail      the shards read through a `pipe:` command that fails half-way through one of them

Kill, signal and stall faults end the job; it is relaunched (at most twice) with `--resume latest`. The others
must leave the job running to its end. For each fault the report says whether it landed where it was aimed,
whether the run finished, the steps trained twice, whether the per-step losses and the exported weights equal
the uninterrupted run's (bitwise, fp32), and what was lost: metrics records, the newest complete checkpoint, the
export. The nan and shard faults change training from their step on: only the steps before are compared, and the
skipped step or samples must be counted in metrics.jsonl.
"""
import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import launch.job
from config import Config
from engine.registry import ENGINES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INJECT = os.path.join(REPO, "benchmarks", "inject")  # sitecustomize.py: the faults a job gets from its environment
KINDS = ("kill-rank", "kill-job", "kill-save", "kill-eval", "kill-export", "sigterm", "sigusr1", "stall", "nan",
         "enospc", "disk-full", "shard-truncate", "shard-delete", "raise", "bad-label", "pipe-fail")
LAUNCHERS = ("deepspeed", "torchrun", "accelerate")
ENGINE_DEFAULT = Config.engine  # train.py's
ENDS_THE_JOB = {"kill-rank", "kill-job", "kill-save", "kill-eval", "kill-export", "sigterm", "sigusr1", "stall",
                "raise"}
CHANGES_TRAINING = {"nan", "shard-truncate", "shard-delete", "bad-label", "pipe-fail"}
# the faults whose launcher is drawn (the others run under deepspeed): those where the launchers differ
ANY_LAUNCHER = ("kill-rank", "sigterm", "stall", "raise")
BAD_LABELS = 12  # samples of one shard relabelled past num_labels (bad-label)
# the job every fault hits: the debug ViT on the digits, 2 ranks, checkpoints every 10 steps
MAX_STEPS, SAVE_EVERY, EVAL_EVERY = 60, 10, 20
JOB_ARGS = ["--model", "vit-debug", "--image_size", "16", "--micro_batch_size", "16", "--max_steps", str(MAX_STEPS),
            "--warmup_steps", "10", "--lr", "3e-3", "--eval_every", str(EVAL_EVERY), "--save_every", str(SAVE_EVERY),
            "--num_workers", "1", "--shuffle_buffer", "200", "--progress", "false"]
# every fault's job also gets these: they change no loss, only how faults are met (every step read and logged as
# it ends, so that a fault aimed at a step by the records lands there)
FAULT_ARGS = ["--keep_last", "2", "--dist_timeout", "8", "--preempt_grace", "30", "--log_every", "1"]
# the job of each other task (--task): MAE on the debug ViT, SimMIM on the debug Swin (4-pixel mask blocks of its
# 2-pixel patches), UperNet over the debug Swin on the digits placed on a canvas (make_shards.py digits-seg)
TASK_ARGS = {"classification": [], "mae": ["--task", "mae", "--mask_ratio", "0.75"],
             "simmim": ["--task", "simmim", "--model", "swin-debug", "--mask_ratio", "0.6", "--mask_patch_size", "4"],
             "segmentation": ["--task", "segmentation", "--model", "swin-debug", "--num_labels", "11",
                              "--label_smoothing", "0"]}
JOB_DESCRIPTION = {"classification": "the debug ViT on the digits", "mae": "MAE on the debug ViT, on the digits",
                   "simmim": "SimMIM on the debug Swin, on the digits",
                   "segmentation": "UperNet over the debug Swin on the digits placed on a canvas"}
CLASSIFICATION_ONLY = {"bad-label"}  # relabels the shards' class field
DISK_MIB = 16


@dataclass
class Episode:
    kind: str
    stage: int
    launcher: str
    aim: str  # where the fault was aimed
    hit: bool = False  # it landed there
    exit_codes: list = field(default_factory=list)  # the job's, then each relaunch's
    finished: bool = False
    resumed_from: list = field(default_factory=list)  # the step each relaunch continued from
    steps_lost: int = 0  # steps trained again after a relaunch
    compared_steps: int = 0
    losses_equal: bool | None = None
    weights_equal: bool | None = None
    counted: str = ""  # what metrics.jsonl counted (nan, shard faults)
    lost: list = field(default_factory=list)  # what was lost; empty is the goal
    seconds: float = 0.0
    note: str = ""


def job_args(task: str = "classification") -> list:
    """The arguments of the job every fault hits, for `task`."""
    return JOB_ARGS + TASK_ARGS[task]


def arg(args: list, key: str) -> str:
    """The value `--key` has in a command line (the last one given)."""
    return str(args[len(args) - 1 - [str(a) for a in reversed(args)].index(f"--{key}") + 1])


def start(launcher: str, args: list, log_path: str, env_extra: dict | None = None):
    """A 2-rank job in its own session (its process group is the job, as a scheduler sees it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env_extra or {}))
    if any(k.startswith("INJECT_") for k in env_extra or {}):  # faults installed from outside train.py
        env["PYTHONPATH"] = os.pathsep.join(p for p in (INJECT, env.get("PYTHONPATH", "")) if p)
    env.pop("RANK", None)
    job = launch.job.start(args, launcher=launcher, nproc=2, env=env, log_path=log_path)
    proc = job.proc
    proc.port, proc.log = job.port, open(log_path, "a")
    return proc


def finish(proc, timeout: float, linger: float = 60) -> int:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.log.close()
    # The launcher may end before its ranks: `deepspeed` dies at SIGTERM at once while the ranks finish their
    # step and checkpoint. Give them time to end on their own; then a rank left behind (a stopped one, or
    # one orphaned by its launcher) must not outlive the job.
    deadline = time.monotonic() + linger
    try:
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.returncode


def ranks(proc) -> dict:
    """{local rank: psutil.Process} of the job's training processes (not their data workers, which run
    train.py too and inherit LOCAL_RANK)."""
    import psutil

    def is_training(p):
        return "train.py" in " ".join(p.cmdline()) and "LOCAL_RANK" in p.environ()

    found = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if is_training(p) and not is_training(p.parent()):
                found[int(p.environ()["LOCAL_RANK"])] = p
        except psutil.Error:
            pass
    return found


def steps_logged(run: str) -> int:
    try:
        with open(os.path.join(run, "metrics.jsonl")) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except FileNotFoundError:
        return 0


def read_metrics(run: str) -> list:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def wait_until(predicate, proc, timeout: float = 180, poll: float = 0.002) -> bool:
    """True once predicate() holds; False if the job ended or the time ran out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


class HeartbeatReader:
    """Where rank 0 is, read from the key its Heartbeat sets in the master's store."""

    def __init__(self, port: int):
        self.port, self.store = port, None

    def __call__(self) -> str:
        import torch.distributed as dist

        try:
            if self.store is None:
                self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                                           timeout=datetime.timedelta(seconds=2), wait_for_workers=False)
            return self.store.get("heartbeat/0").decode() if self.store.check(["heartbeat/0"]) else ""
        except Exception:  # not up yet
            self.store = None
            return ""


def tensors(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def weights_equal(a: str, b: str) -> bool:
    import torch

    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def can_mount() -> bool:
    probe = f"/tmp/fault-mount-probe-{os.getpid()}"
    os.makedirs(probe, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", probe], capture_output=True)
    os.rmdir(probe)
    return ok


def complete_checkpoints(run: str) -> list:
    from checkpoints.manager import complete_checkpoints as complete

    ckpts = os.path.join(run, "checkpoints")
    return [tag for _, tag in complete(ckpts)] if os.path.isdir(ckpts) else []


def run_episode(ep: Episode, rng: random.Random, base_args: list, shards: dict, reference: str, work: str):
    """Start the job, inject the fault, relaunch until it finishes, and fill in `ep`."""
    t0 = time.monotonic()
    run, log_path = os.path.join(work, "run"), os.path.join(work, "log.txt")
    train_shards = shards["train"]
    if ep.kind.startswith("shard-") or ep.kind == "bad-label":  # a private copy to damage
        copy = os.path.join(work, "shards")
        shutil.copytree(shards["dir"], copy)
        train_shards = shards["train"].replace(shards["dir"], copy)
    if ep.kind == "bad-label":
        shard = f"train-{rng.randint(0, 3):06d}.tar"
        relabel(os.path.join(copy, shard), {i: 10 + i for i in rng.sample(range(300), BAD_LABELS)})
        ep.aim, ep.hit = f"{BAD_LABELS} samples of {shard}", True
    elif ep.kind == "pipe-fail":  # every shard through a command; one breaks off half-way (exit 7) once each rank
        # has read it whole to count it: a download that fails mid-run
        shard = f"train-{rng.randint(1, 3):06d}.tar"  # not the first: its command is probed before training
        script = os.path.join(work, "fetch.sh")
        with open(script, "w") as f:
            f.write(pipe_failing_after_counts(shard, os.path.join(work, "reads")))
        train_shards = f"pipe:sh {script} {shards['train']}"
        ep.aim = f"{shard}, half-way"
    args = base_args + FAULT_ARGS + ["--zero_stage", ep.stage, "--train_shards", train_shards,
                                     "--val_shards", shards["val"], "--output_dir", run]
    max_steps, save_every, eval_every = (int(arg(base_args, k)) for k in ("max_steps", "save_every", "eval_every"))
    saves = list(range(save_every, max_steps, save_every))
    evals = list(range(eval_every, max_steps, eval_every))
    step = rng.randint(3, max_steps - 3)
    env, mounted, filler = {}, None, None
    if ep.kind == "nan":
        env["INJECT_NAN_AT"], ep.aim = str(step), f"step {step}"
    elif ep.kind == "enospc":
        save_at, victim = rng.choice(saves), rng.randint(0, 1)
        env["INJECT_ENOSPC_AT"], ep.aim = f"{save_at}:{victim}", f"save {save_at}, rank {victim}"
    elif ep.kind == "raise":
        step, victim = rng.randint(3, eval_every - 1), rng.randint(0, 1)  # before the first evaluation
        env["INJECT_RAISE"], ep.aim = f"{victim}:{step}", f"step {step}, rank {victim}"
    elif ep.kind == "disk-full":
        mounted = os.path.join(run, "checkpoints")
        os.makedirs(mounted)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m", "tmpfs", mounted], check=True)
    proc = start(ep.launcher, args, log_path, env)
    try:
        if ep.kind in ("kill-rank", "kill-job", "sigterm", "sigusr1", "stall", "shard-truncate", "shard-delete"):
            ep.aim = f"step {step}" + (f", rank {(victim := rng.randint(0, 1))}" if ep.kind in ("kill-rank", "stall")
                                       else "")
            reached = wait_until(lambda: steps_logged(run) >= step - 1, proc, poll=0.01)
            if ep.kind == "kill-job" and reached:
                os.killpg(proc.pid, signal.SIGKILL)
            elif ep.kind == "kill-rank" and reached:
                ranks(proc)[victim].kill()
            elif ep.kind == "stall" and reached:
                target = ranks(proc)[victim]
                target.suspend()
                # the others stop within dist_timeout; then the stopped rank is continued, as a launcher's
                # SIGTERM cannot end a stopped process
                wait_until(lambda: "error: rank " in open(log_path).read(), proc, timeout=60, poll=0.2)
                target.resume()
            elif ep.kind == "sigterm" and reached:
                os.killpg(proc.pid, signal.SIGTERM)
            elif ep.kind == "sigusr1" and reached:
                for p in ranks(proc).values():
                    p.send_signal(signal.SIGUSR1)
            elif ep.kind.startswith("shard-") and reached:
                shard = rng.choice(sorted(f for f in os.listdir(os.path.dirname(train_shards.split("{")[0]))
                                          if f.startswith("train-") and f.endswith(".tar")))
                path = os.path.join(work, "shards", shard)
                if ep.kind == "shard-delete":
                    os.remove(path)
                else:
                    size = os.path.getsize(path)
                    cut = rng.randint(size // 10, size * 9 // 10)
                    os.truncate(path, cut)
                ep.aim += f", {shard}"
            ep.hit = reached
        elif ep.kind == "kill-save":
            save_at = rng.choice(saves)
            ep.aim = f"save {save_at}"
            partial = os.path.join(run, "checkpoints", f"step{save_at:07d}.partial")
            if wait_until(lambda: os.path.isdir(partial), proc):
                os.killpg(proc.pid, signal.SIGKILL)
        elif ep.kind == "kill-eval":
            eval_at = rng.choice(evals)
            ep.aim = f"evaluation at step {eval_at}"
            where = HeartbeatReader(proc.port)
            # the store is up once the first step is logged: earlier, connecting would only log retries
            if wait_until(lambda: steps_logged(run) >= 1, proc, poll=0.05) and wait_until(
                    lambda: where() == f"step {eval_at}, evaluating", proc, poll=0.001):
                os.killpg(proc.pid, signal.SIGKILL)
        elif ep.kind == "kill-export":
            ep.aim = "export"
            if wait_until(lambda: os.path.isdir(os.path.join(run, "hf_model.partial")), proc):
                os.killpg(proc.pid, signal.SIGKILL)
        elif ep.kind == "disk-full":
            save_at = rng.choice(saves[1:])
            during = rng.random() < 0.5
            ep.aim = f"{'during' if during else 'before'} save {save_at}"
            partial = os.path.join(mounted, f"step{save_at:07d}.partial")
            ready = (lambda: os.path.isdir(partial)) if during else (lambda: steps_logged(run) >= save_at - 1)
            if wait_until(ready, proc, poll=0.001 if during else 0.01):
                filler = os.path.join(mounted, "filler")
                with open(filler, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * 2**16)
                    except OSError:
                        pass
                wait_until(lambda: steps_logged(run) >= save_at + 15, proc, poll=0.05)
                os.remove(filler)
        code = finish(proc, timeout=240)
        first_launch_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ep.exit_codes.append(code)
    out = open(log_path).read()
    if ep.kind == "kill-save":
        ep.hit = os.path.isdir(partial) and not os.path.isdir(partial[:-len(".partial")])
    elif ep.kind == "kill-eval":
        ep.hit = code != 0 and steps_logged(run) < eval_at
    elif ep.kind == "kill-export":
        ep.hit = os.path.isdir(os.path.join(run, "hf_model.partial"))
    elif ep.kind in ("sigterm", "sigusr1"):
        ep.hit = ep.hit and "preempted (" in out
    elif ep.kind == "stall":
        ep.hit = ep.hit and f"error: rank {1 - victim}: " in out
    elif ep.kind == "kill-rank":  # the launcher reports the killed rank's exit by SIGKILL
        ep.hit = ep.hit and re.search(r"return code = -9\b|exitcode\s*: -9 \(pid", out) is not None
    elif ep.kind in ("enospc", "disk-full"):
        ep.hit = "not written" in out
    elif ep.kind == "raise":  # exit 1 with the rank's one line and its traceback, within seconds
        ep.hit = (code == 1 and f"error: rank {victim} failed at step {step}: RuntimeError" in out
                  and os.path.isfile(os.path.join(run, "errors", f"rank{victim}.txt")))
        ep.note = f"the faulty launch ended {first_launch_s:.0f} s after it started"

    # relaunch until the run finishes
    for _ in range(2):
        if code == 0:
            break
        before, newest, offset = steps_logged(run), complete_checkpoints(run), os.path.getsize(log_path)
        proc = start(ep.launcher, args + ["--resume", "latest"], log_path)
        code = finish(proc, timeout=240)
        ep.exit_codes.append(code)
        with open(log_path) as f:
            f.seek(offset)
            resumed = [line for line in f.read().splitlines() if line.startswith("resumed from")]
        at = int(resumed[0].split(" at step ")[1].split(";")[0]) if resumed else 0
        ep.resumed_from.append(at)
        ep.steps_lost += max(0, before - at)
        if newest and at < int(newest[-1][4:]):
            ep.lost.append(f"resumed from step {at}, not from the newest complete checkpoint {newest[-1]}")
    ep.finished = code == 0 and os.path.isfile(os.path.join(run, "hf_model", "config.json"))
    if mounted:
        subprocess.run(["umount", "-l", mounted], capture_output=True)

    # compare with the uninterrupted run
    if ep.finished:
        records, ref = read_metrics(run), read_metrics(reference)
        if [r["step"] for r in records] != list(range(1, max_steps + 1)):
            ep.lost.append("metrics.jsonl records missing or repeated")
        # bad-label and pipe-fail change the data from the start: nothing to compare, only what was counted
        first_changed = {"nan": step, "shard-truncate": step - 1, "shard-delete": step - 1, "bad-label": 1,
                         "pipe-fail": 1}.get(ep.kind, max_steps + 1)
        n = min(first_changed - 1, len(records))
        ep.compared_steps = n
        ep.losses_equal = [r["loss"] for r in records[:n]] == [r["loss"] for r in ref[:n]] if n else None
        if ep.kind not in CHANGES_TRAINING:
            ep.weights_equal = weights_equal(os.path.join(run, "hf_model"), os.path.join(reference, "hf_model"))
        if ep.kind == "nan":
            ep.counted = f"opt/nonfinite_steps {records[-1]['opt/nonfinite_steps']}, step {step} loss {records[step - 1]['loss']}"
            ep.hit = records[step - 1]["loss"] is None
        elif ep.kind in ("shard-truncate", "shard-delete", "bad-label", "pipe-fail"):
            ep.counted = f"data/skipped {records[-1]['data/skipped']}, data/padded {records[-1]['data/padded']}"
            if ep.kind == "bad-label":  # more than one epoch: each relabelled sample is read, and skipped
                ep.hit = records[-1]["data/skipped"] >= BAD_LABELS
            else:
                ep.hit = (ep.hit or ep.kind == "pipe-fail") and records[-1]["data/skipped"] > 0
    else:
        ep.lost.append("the run did not finish")
        ep.note = out[-1500:]
    ep.seconds = time.monotonic() - t0
    return ep


def pipe_failing_after_counts(shard: str, claims: str, ranks: int = 2) -> str:
    """A shell script for `pipe:sh SCRIPT URL`: it streams the shard at URL, but the shard named `shard` only for its
    first `ranks` reads (each rank counts the samples of a source without _info.json once, at the start) and cut
    off half-way with exit status 7 after that. Reads are claimed with mkdir, which is atomic."""
    claim = " || ".join(f"mkdir {claims}-{i} 2>/dev/null" for i in range(ranks))
    return (f'case "$1" in *{shard}) if ! {{ {claim}; }}; then head -c 200000 "$1"; exit 7; fi;; esac\n'
            f'cat "$1"\n')


def relabel(path: str, labels: dict):
    """Rewrite the tar shard at `path` so that its samples numbered in `labels` ({index: label}) carry that label."""
    import io
    import tarfile

    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w") as tar:
        index, last = -1, None
        for name, data in members:
            key, ext = name.split(".", 1)
            index, last = (index + 1, key) if key != last else (index, last)
            if ext == "cls" and index in labels:
                data = str(labels[index]).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def draw(n: int, kinds: list, seed: int) -> list:
    """n episodes cycling through the kinds in a seeded order; stage and launcher drawn for each."""
    rng = random.Random(seed)
    order = []
    while len(order) < n:
        batch = list(kinds)
        rng.shuffle(batch)
        order += batch
    return [Episode(kind=k, stage=rng.choice([1, 2, 3]),
                    launcher=rng.choice(LAUNCHERS) if k in ANY_LAUNCHER else "deepspeed", aim="")
            for k in order[:n]]


def run_all(episodes: list, seed: int, base_args: list, shards: dict, references: dict, work: str, log=print):
    for i, ep in enumerate(episodes):
        rng = random.Random(f"{seed}/{i}")
        if ep.kind == "disk-full" and not can_mount():
            ep.note = "not run: mounting a tmpfs needs root or CAP_SYS_ADMIN"
            log(f"[{i + 1}/{len(episodes)}] {ep.kind}: {ep.note}")
            continue
        episode_dir = os.path.join(work, f"{i:03d}-{ep.kind}")
        os.makedirs(episode_dir)
        run_episode(ep, rng, base_args, shards, references[ep.stage], episode_dir)
        log(f"[{i + 1}/{len(episodes)}] {ep.kind} (ZeRO-{ep.stage}, {ep.launcher}, {ep.aim}): "
            f"{'hit' if ep.hit else 'MISSED'}, exits {ep.exit_codes}, "
            f"{'finished' if ep.finished else 'NOT FINISHED'}, {ep.steps_lost} steps lost, "
            + (f"losses {'equal' if ep.losses_equal else 'DIFFER'} over {ep.compared_steps} steps"
               if ep.losses_equal is not None else "losses not compared")
            + (f", weights {'equal' if ep.weights_equal else 'DIFFER'}" if ep.weights_equal is not None else "")
            + (f", {ep.counted}" if ep.counted else "") + (f", LOST: {'; '.join(ep.lost)}" if ep.lost else "")
            + f" ({ep.seconds:.0f} s)")
    return episodes


def losses(eps: list) -> str:
    """How many episodes' losses equal the uninterrupted run's, of those with steps to compare."""
    compared = [e for e in eps if e.losses_equal is not None]
    return f"{sum(e.losses_equal for e in compared)}/{len(compared)}" if compared else "n/a (data changed from step 1)"


def table(episodes: list) -> str:
    rows = ["| fault | injected | landed as aimed | finished | relaunches | steps lost | losses = uninterrupted "
            "| weights = uninterrupted | data lost |", "|---|---|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        eps = [e for e in episodes if e.kind == kind and not e.note.startswith("not run")]
        if not eps:
            continue
        weights = [e.weights_equal for e in eps if e.weights_equal is not None]
        rows.append(f"| {kind} | {len(eps)} | {sum(e.hit for e in eps)} | {sum(e.finished for e in eps)} | "
                    f"{sum(len(e.exit_codes) - 1 for e in eps)} | {sum(e.steps_lost for e in eps)} | "
                    f"{losses(eps)}{' (steps before the fault)' if kind in CHANGES_TRAINING and kind not in ('bad-label', 'pipe-fail') else ''} | "
                    f"{f'{sum(weights)}/{len(weights)}' if weights else 'n/a (training changed)'} | "
                    f"{sum(bool(e.lost) for e in eps) or 'none'} |")
    eps = [e for e in episodes if not e.note.startswith("not run")]
    rows.append(f"| **all** | {len(eps)} | {sum(e.hit for e in eps)} | {sum(e.finished for e in eps)} | "
                f"{sum(len(e.exit_codes) - 1 for e in eps)} | {sum(e.steps_lost for e in eps)} | "
                f"{losses(eps)} | "
                f"{sum(bool(e.weights_equal) for e in eps)}/{sum(e.weights_equal is not None for e in eps)} | "
                f"{sum(bool(e.lost) for e in eps) or 'none'} |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=len(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "faults"))
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    parser.add_argument("--task", default="classification", choices=sorted(TASK_ARGS),
                        help="the job's task (train.py's `task`), on the digits or, for segmentation, digits-seg")
    parser.add_argument("--engine", default=ENGINE_DEFAULT, choices=tuple(ENGINES),
                        help="train.py's engine; under fsdp2 the drawn ZeRO stage sets its resharding")
    a = parser.parse_args()
    kinds = a.kinds.split(",")
    if unknown := [k for k in kinds if k not in KINDS]:
        sys.exit(f"error: unknown fault kind {', '.join(unknown)}; known: {', '.join(KINDS)}")
    if a.task != "classification" and (wrong := CLASSIFICATION_ONLY & set(kinds)):
        if a.kinds != ",".join(KINDS):
            sys.exit(f"error: {', '.join(sorted(wrong))}: classification only (it rewrites the class labels)")
        kinds = [k for k in kinds if k not in wrong]
    episodes = draw(a.faults, kinds, a.seed)
    work = os.path.join("/tmp", f"fault-injection-{os.getpid()}")
    os.makedirs(work)
    args = job_args(a.task) + ["--engine", a.engine]
    try:
        shards = {"dir": os.path.join(work, "digits")}
        subprocess.run([sys.executable, "data/make_shards.py", "digits-seg" if a.task == "segmentation" else "digits",
                        shards["dir"]], cwd=REPO, check=True, capture_output=True)
        shards.update(train=f"{shards['dir']}/train-{{000000..000003}}.tar", val=f"{shards['dir']}/val-000000.tar")
        references = {}
        for stage in sorted({e.stage for e in episodes}):
            ref = os.path.join(work, f"reference-zero{stage}")
            proc = start("deepspeed", args + ["--zero_stage", stage, "--train_shards", shards["train"],
                                              "--val_shards", shards["val"], "--output_dir", ref],
                         os.path.join(work, f"reference-zero{stage}.log"))
            if finish(proc, timeout=600) != 0:
                sys.exit(f"error: the uninterrupted ZeRO-{stage} run failed; see {work}")
            references[stage] = ref
            print(f"reference ZeRO-{stage}: {MAX_STEPS} steps uninterrupted", flush=True)
        start_time = time.time()
        run_all(episodes, a.seed, args, shards, references, work, log=lambda s: print(s, flush=True))
        write_report(episodes, a, start_time)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def write_report(episodes: list, a, start_time: float):
    import torch

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "episodes.jsonl"), "w") as f:
        for ep in episodes:
            f.write(json.dumps(asdict(ep)) + "\n")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# Fault injection, {datetime.date.today().isoformat()}", "",
             f"`python -m benchmarks.fault_injection --faults {a.faults} --seed {a.seed}"
             f"{f' --task {a.task}' if a.task != 'classification' else ''}"
             f"{f' --engine {a.engine}' if a.engine != ENGINE_DEFAULT else ''}` at commit {commit}, "
             f"{platform.processor() or platform.machine()} with {os.cpu_count()} cores, torch {torch.__version__}; "
             f"{(time.time() - start_time) / 60:.0f} min.", "",
             f"Each fault hits its own 2-rank job: {JOB_DESCRIPTION[a.task]}, {MAX_STEPS} steps, a checkpoint every "
             f"{SAVE_EVERY} steps (keep_last 2), an evaluation every {EVAL_EVERY}, one data worker per rank, fp32; "
             f"the ZeRO stage and, for {', '.join(ANY_LAUNCHER)}, the launcher drawn by the seed. The uninterrupted "
             f"run of each stage is the reference.", "", table(episodes), "",
             "Steps lost: steps trained again after a relaunch (those after the newest complete checkpoint). Data lost: "
             "episodes where a metrics record, the newest complete checkpoint or the export went missing. For nan and "
             "shard faults the run changes from the fault on (a skipped step, skipped samples): the losses before it "
             "are compared, and what was skipped is counted in metrics.jsonl. bad-label and pipe-fail change the data "
             "from the first step: what was skipped is counted, nothing is compared. raise must end the job with exit "
             "1, the rank's one line and its traceback in errors/ (its note: how long the faulty launch took, start-up "
             "included), and is then resumed like a kill.", "",
             "| # | fault | ZeRO | launcher | aimed at | exits | resumed from | steps lost | counted | note | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, ep in enumerate(episodes):
        note = ep.note if ep.kind == "raise" or ep.note.startswith("not run") else ""
        lines.append(f"| {i + 1} | {ep.kind} | {ep.stage} | {ep.launcher} | {ep.aim} | "
                     f"{', '.join(map(str, ep.exit_codes)) or '-'} | "
                     f"{', '.join(map(str, ep.resumed_from)) or '-'} | {ep.steps_lost} | {ep.counted or '-'} | "
                     f"{note or '-'} | {ep.seconds:.0f} |")
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(table(episodes))


if __name__ == "__main__":
    main()
