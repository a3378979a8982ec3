"""Shared fixtures: digits shards in a temp dir, launches of train.py as real processes (forked from a preloaded
zygote, or under each launcher), the debug run."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from launch.job import command
from loop.distributed import free_port  # noqa: F401 (the tests' one free_port is the library's)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
# DeepSpeed's JIT-built ops (the CPU shm all-reduce, CPU Adam) in this environment's own folder: two checkouts
# share ~/.cache/torch_extensions otherwise, rebuild each other's ops and wait forever on a lock a killed build left
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# The one tiny configuration every integration test trains (torchtitan's "debug model").
# report_to none: metrics.jsonl only; the runs whose TensorBoard events a test reads name tensorboard (one of
# stage_runs, the segmentation masks, two loopback nodes; tests/integration/test_tracking.py), which saves the
# drawing of TensorBoard's figures at every evaluation of the others
DEBUG_ARGS = ["--image_size", "16", "--micro_batch_size", "16", "--max_steps", "60", "--warmup_steps", "10",
              "--lr", "3e-3", "--eval_every", "30", "--save_every", "30", "--num_workers", "0",
              "--shuffle_buffer", "200", "--progress", "false", "--report_to", "none"]


INJECT = os.path.join(REPO, "benchmarks", "inject")  # faults installed from outside train.py (its sitecustomize.py)


def with_faults(env: dict, faults: dict) -> dict:
    """`env` with benchmarks/inject on PYTHONPATH and its variables set: {"RAISE": "1:3", "NAN_AT": "5,6"}."""
    path = os.pathsep.join(p for p in (INJECT, env.get("PYTHONPATH", "")) if p)
    return dict(env, PYTHONPATH=path, **{f"INJECT_{k}": v for k, v in faults.items()})


class Zygote:
    """tests/zygote.py, started once per session: each rank of a `fork` launch is a fork of it (see there)."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="zygote-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote"], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def send(self, request: dict):
        assert self.proc.poll() is None, f"the zygote ended:\n{open(self.log.name).read()[-3000:]}"
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def reply(self):
        """The reply to the oldest request not yet answered (the zygote answers each at once, in order)."""
        line = self.proc.stdout.readline()
        assert line, f"the zygote ended:\n{open(self.log.name).read()[-3000:]}"
        return json.loads(line)

    def close(self):
        self.proc.kill()
        self.proc.wait()


_zygote = None


class ForkedJob:
    """`nproc` ranks of `module` (its `main(args)`) forked from the zygote, with the variables DeepSpeed's launcher
    sets (none for 1 rank, as under plain `python train.py`), in one process group whose id is `pid` (a launcher's
    job is one). Used as a subprocess.Popen is: poll(), wait(timeout), send_signal(), kill(), communicate(). Like a
    launcher, a rank's failure ends the others (SIGTERM, then SIGKILL after 5 s) and the job's code is the first
    failing rank's. Output: every rank's stdout and stderr in the file `output`, else a file per rank and stream,
    read back in rank order."""

    def __init__(self, args, nproc, env, module="train", output=None):
        global _zygote
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote()
        self.args, self.nproc, self.output = ["fork", *map(str, args)], nproc, output
        self.port, self.logs = free_port(), tempfile.mkdtemp(prefix="forked-")
        self.pids, self.codes, self.returncode, self.failed, self.stopping, self.asked = [], {}, None, 0, None, 0.0
        for rank in range(nproc):
            rank_env = env if nproc == 1 else dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                                  LOCAL_SIZE=str(nproc), CROSS_RANK="0", CROSS_SIZE="1",
                                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
            _zygote.send({"fork": {"module": module, "argv": self.args[1:], "env": rank_env, "cwd": REPO,
                                   "stdout": output or f"{self.logs}/{rank}.out",
                                   "stderr": output or f"{self.logs}/{rank}.err",
                                   "group": self.pids[0] if self.pids else 0}})
            self.pids.append(_zygote.reply()["pid"])
        self.pid = self.pids[0]

    def _signal(self, sig):
        for pid in set(self.pids) - set(self.codes):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def poll(self):
        if self.returncode is not None or time.monotonic() - self.asked < 0.01:  # at most 100 questions a second
            return self.returncode
        self.asked = time.monotonic()
        _zygote.send({"poll": [pid for pid in self.pids if pid not in self.codes]})
        for pid, code in _zygote.reply()["codes"].items():
            self.codes[int(pid)] = code
            if code != 0 and self.stopping is None:
                self.failed, self.stopping = code, time.monotonic() + 5
                self._signal(signal.SIGTERM)
        if self.stopping is not None and time.monotonic() > self.stopping:
            self._signal(signal.SIGKILL)
        if len(self.codes) == self.nproc:
            self.returncode = self.failed
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig):
        """To every rank, as a launcher passes a signal on."""
        self._signal(sig)

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def read(self, stream="out"):
        if self.output:
            return open(self.output).read()
        return "".join(open(f"{self.logs}/{rank}.{stream}").read() for rank in range(self.nproc))

    def communicate(self, timeout=None):
        self.wait(timeout)
        return (self.read(), None) if self.output else (self.read("out"), self.read("err"))


def fork_launch(args, nproc, env, timeout, module="train"):
    """A ForkedJob run to its end: a CompletedProcess with each rank's stdout and stderr, in rank order."""
    job = ForkedJob(args, nproc, env, module)
    try:
        job.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        raise subprocess.TimeoutExpired(job.args, timeout, job.read("out"), job.read("err"))
    return subprocess.CompletedProcess(job.args, job.returncode, job.read("out"), job.read("err"))


def run_entry(module, *args, timeout=120):
    """`python MODULE.py ARGS` for an entry point with a `main(argv)` (export.py, sweep.py) as one process forked
    from the zygote, in the repository root: a CompletedProcess with its code, stdout and stderr, as a fresh
    interpreter's run gives them, without the interpreter's start and imports."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return fork_launch([str(a) for a in args], 1, env, timeout, module=module)


@pytest.fixture(scope="session", autouse=True)
def zygote_ends():
    yield
    if _zygote is not None:
        _zygote.close()


def launch(args, nproc=2, launcher="fork", timeout=300, check=True, warnings=False, accelerate_config=None,
           faults=None):
    """Run train.py as real processes: `fork` (ranks forked from the preloaded zygote: train.py's code, not a
    launcher's), `deepspeed`, `torchrun`, `accelerate` or plain `python` (1 rank). `warnings`: leave Python's
    warnings on, as a user has them (a forked rank too: tests/zygote.py's show_warnings). `accelerate_config`:
    `accelerate launch --config_file` with that file (its DeepSpeed plugin) instead of the plain torchrun path.
    `faults`: benchmarks/inject's, as with_faults names them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if faults:
        env = with_faults(env, faults)
    if not warnings:
        env["PYTHONWARNINGS"] = "ignore"
    env.pop("RANK", None)
    if launcher == "fork" and not accelerate_config:
        proc = fork_launch(args, nproc, env, timeout)
        proc.port = None
    else:
        port = str(free_port())
        proc = subprocess.run(launcher_command(launcher, nproc, port, accelerate_config) + [str(a) for a in args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        proc.port = port
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args[:3])} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def run_nodes(commands, envs=None, timeout=300):
    """Start every node's launcher at once, as a cluster would, and wait for all; each must succeed. Returns each
    node's output. `envs`: variables per node on top of this process's."""
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    base.pop("RANK", None)
    procs = [subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=dict(base, **(extra or {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, extra in zip(commands, envs or [None] * len(commands))]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def fork_start(start):
    """benchmarks/fault_injection.start, with a `fork` launcher: a 2-rank ForkedJob writing to the episode's log."""
    def started(launcher, args, log_path, env_extra=None):
        if launcher != "fork":
            return start(launcher, args, log_path, env_extra)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env_extra or {}))
        env.pop("RANK", None)
        job = ForkedJob(args, 2, env, output=log_path)
        job.log = open(log_path, "a")  # what fault_injection.finish closes
        return job
    return started


def launcher_command(launcher, nproc, port, accelerate_config=None):
    """launch.job's command line of train.py under `launcher` (the one every launch of train.py uses)."""
    return command(launcher, 1 if launcher == "python" else nproc, port, accelerate_config=accelerate_config)


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


OP_BUILD = "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder({!r}).load()"


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops(request):
    """DeepSpeed's ops that it JIT-builds on first use, built here: the CPU shared-memory all-reduce once before any
    launch, so that no test's timeout includes the build and no test's killed rank leaves the build's lock behind
    for every later launch to wait on; CPU Adam (when a collected test needs it: the `cpu_adam` fixture) in a
    process of its own, beside the tests before it."""
    import torch

    if torch.cuda.is_available():
        yield None
        return
    from tests.zygote import load_shm_op

    load_shm_op()
    cpu_adam = None
    if any("cpu_adam" in item.fixturenames for item in request.session.items):
        log = tempfile.NamedTemporaryFile("w+", prefix="cpu-adam-build-", suffix=".log")
        cpu_adam = subprocess.Popen([sys.executable, "-c", OP_BUILD.format("CPUAdamBuilder")], cwd=REPO,
                                    stdout=log, stderr=subprocess.STDOUT)
        cpu_adam.log = log
    yield cpu_adam
    if cpu_adam is not None:
        cpu_adam.wait()  # a build killed half-way would leave its lock behind


@pytest.fixture
def cpu_adam(deepspeed_ops):
    """DeepSpeed's CPU Adam, built (see deepspeed_ops)."""
    if deepspeed_ops is not None:
        assert deepspeed_ops.wait(timeout=600) == 0, open(deepspeed_ops.log.name).read()[-3000:]


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
def digits_seg(tmp_path_factory):
    """The directory of the digits placed on 32x32 canvases (`make_shards.py digits-seg`), written once per session."""
    out = tmp_path_factory.mktemp("digits-seg")
    subprocess.run([sys.executable, "data/make_shards.py", "digits-seg", str(out), "--workers", "1"], cwd=REPO,
                   check=True, capture_output=True)
    return out


def seg_shards(directory) -> list:
    """train.py's shard arguments for the digits-seg shards in `directory`."""
    return ["--train_shards", f"{directory}/train-{{000000..000003}}.tar", "--val_shards", f"{directory}/val-000000.tar"]


@pytest.fixture(scope="session")
def debug_args(digits):
    return DEBUG_ARGS + ["--train_shards", digits["train"], "--val_shards", digits["val"]]


MODELS, STAGES = ("vit-debug", "swin-debug"), (1, 2, 3)


@pytest.fixture(scope="session")
def stage_runs(debug_args, tmp_path_factory):
    """The debug run of each model under ZeRO 1, 2 and 3 on 2 ranks: 60 steps, checkpoints at 30 and 60. The
    ViT's ZeRO-3 run also writes TensorBoard's events (test_train.py::test_run_directory reads them)."""
    root = tmp_path_factory.mktemp("stages")
    runs = {}
    for model in MODELS:
        for stage in STAGES:
            out = root / f"{model}-zero{stage}"
            report = "tensorboard" if (model, stage) == ("vit-debug", 3) else "none"
            launch(debug_args + ["--model", model, "--zero_stage", stage, "--output_dir", out, "--report_to", report])
            runs[model, stage] = str(out)
    return runs


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request, monkeypatch):
    """tests/unit/ runs in the pytest process alone: starting a process there (a subprocess, a fork, a loader
    worker, a launcher) fails the test that tries. Tests that start processes live in tests/integration/."""
    if os.sep + "unit" + os.sep not in str(request.node.path):
        return

    def refuse(*args, **kwargs):
        raise AssertionError("a unit test started a process: it belongs in tests/integration/")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
