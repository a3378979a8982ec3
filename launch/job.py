"""One launcher of train.py for everything that starts it: the benchmarks, sweep.py, the GPU check and the tests.

    from launch.job import run
    done = run(nproc=2, config="configs/digits-vit.yaml", max_steps=20, output_dir="/tmp/run")
    done.returncode, done.summary["val_top1"], done.metrics[-1]["loss"]

`command` is a launcher's command line (torchrun, deepspeed, accelerate or plain python) on a fresh port; `start`
runs it with the config overrides as `--key value` in its own session (its process group is the job, as a
scheduler sees it), its output into a log file or captured; `run` waits for it and reads what the run wrote.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from loop.distributed import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
LAUNCHERS = ("deepspeed", "torchrun", "accelerate", "python")


def command(launcher: str, nproc: int, port: int | None = None, script: str | list = "train.py",
            accelerate_config: str | None = None, nnodes: int = 1, node_rank: int = 0,
            master_addr: str = "127.0.0.1") -> list[str]:
    """The command line that starts `nproc` ranks of `script` (a path, or ["-m", "module"]) on this node, their
    rendezvous on `port` (a fresh one by default). `accelerate_config`: `accelerate launch --config_file` with
    that file (its DeepSpeed or FSDP plugin) instead of accelerate's plain multi-process path. `nnodes` > 1
    (torchrun): this node is `node_rank` of them, node 0 at `master_addr`."""
    port = str(port or free_port())
    if nnodes > 1:
        if launcher != "torchrun":
            raise ValueError(f"launch.job starts several nodes under torchrun only, not {launcher}")
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
                "--nproc_per_node", str(nproc), "--master_addr", master_addr, "--master_port", port,
                *([script] if isinstance(script, str) else script)]
    script = [script] if isinstance(script, str) else list(script)
    if accelerate_config:
        return [f"{BIN}/accelerate", "launch", "--config_file", accelerate_config, "--num_processes", str(nproc),
                "--main_process_port", port, *script]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port,
                *script]
    if launcher == "deepspeed":
        return [f"{BIN}/deepspeed", "--num_gpus", str(nproc), "--master_port", port, *script]
    if launcher == "accelerate":  # --multi_gpu is its torchrun path (MULTI_GPU / MULTI_CPU); --cpu starts one process
        return [f"{BIN}/accelerate", "launch", "--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port, *script]
    if launcher == "python":
        if nproc != 1:
            raise ValueError("launcher python starts one rank")
        return [sys.executable, *script]
    raise ValueError(f"unknown launcher {launcher!r} (one of {', '.join(LAUNCHERS)})")


def overrides(keys: dict) -> list[str]:
    """{key: value} as train.py's `--key value` pairs (booleans as true/false)."""
    out = []
    for key, value in keys.items():
        out += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


@dataclass
class Finished:
    """What a finished job left: its exit code, output, and the run directory's records."""
    returncode: int
    output: str  # stdout and stderr (the log file's contents when the job wrote to one)
    output_dir: str | None
    metrics: list = field(default_factory=list)  # metrics.jsonl's records
    summary: dict | None = None  # summary.json, when the run finished
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.summary is not None


class Job:
    """A started job: the launcher's process, the leader of the job's process group."""

    def __init__(self, proc: subprocess.Popen, output_dir: str | None, log_path: str | None, port: int | None):
        self.proc, self.output_dir, self.log_path, self.port = proc, output_dir, log_path, port
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self):
        return self.proc.poll()

    def signal(self, sig=signal.SIGTERM):
        """`sig` to every process of the job (the launcher and its ranks)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> Finished:
        """The job's end (killed, with every process of its group, at `timeout`) and what it wrote."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            out, err = self.proc.communicate()
            err = (err or "") + f"\nkilled: the job ran past {timeout} s"
        if self.log_path:
            with open(self.log_path, errors="replace") as f:
                out, err = f.read(), ""
        return Finished(self.proc.returncode, (out or "") + (err or ""), self.output_dir,
                        *read_run(self.output_dir), seconds=time.monotonic() - self.started)


def read_run(output_dir: str | None) -> tuple[list, dict | None]:
    """(metrics.jsonl's records, summary.json or None) of a run directory."""
    if not output_dir:
        return [], None
    metrics, summary = [], None
    path = os.path.join(output_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    metrics.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut off by a kill
                    pass
    path = os.path.join(output_dir, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
    return metrics, summary


def start(args: list | None = None, *, launcher: str = "torchrun", nproc: int = 2, script: str | list = "train.py",
          env: dict | None = None, log_path: str | None = None, accelerate_config: str | None = None,
          port: int | None = None, cwd: str = REPO, **keys) -> Job:
    """`nproc` ranks of train.py (or `script`) under `launcher`, with `args` and the config overrides `keys`
    (output_dir=..., max_steps=...; `config` is the recipe), in their own session. `env`: the whole environment
    (default: this process's, with Python's warnings off); output into `log_path`, else captured."""
    port = port or free_port()
    cmd = command(launcher, nproc, port, script, accelerate_config) + [str(a) for a in args or []] + overrides(keys)
    env = dict(os.environ, PYTHONWARNINGS="ignore") if env is None else env
    if log_path:
        with open(log_path, "a") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
    else:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    output_dir = str(keys["output_dir"]) if "output_dir" in keys else None
    return Job(proc, output_dir, log_path, port)


def run(args: list | None = None, *, timeout: float | None = None, **kwargs) -> Finished:
    """start(), then wait for the job's end: what it wrote. A train.py run without an `output_dir` writes into a
    temporary one, read and removed here."""
    if "output_dir" in kwargs or kwargs.get("script", "train.py") != "train.py":
        return start(args, **kwargs).wait(timeout)
    with tempfile.TemporaryDirectory() as tmp:
        done = start(args, output_dir=os.path.join(tmp, "run"), **kwargs).wait(timeout)
        done.output_dir = None
        return done
