"""launch/cluster.py's descriptions run on loopback: each target's node command, started as two "nodes" with the
variables that system sets on each (Slurm's SLURM_*, SkyPilot's SKYPILOT_*, Kubeflow Trainer's PET_*), trains to
the losses of one node of two ranks."""
import shlex
import socket
import zlib

import numpy as np
import pytest
import yaml
from conftest import REPO, free_port, read_metrics, run_nodes

from launch import cluster, cluster_env

STEPS = 6


@pytest.fixture(scope="module")
def node_args(debug_args):
    """The ViT debug run under ZeRO-3 for 6 steps: warm-up outlasts them, so they are stage_runs' first 6."""
    return debug_args + ["--model", "vit-debug", "--zero_stage", "3", "--max_steps", STEPS]


@pytest.fixture(scope="module")
def one_node(stage_runs):
    """The reference: the debug run's losses on one node of two ranks (conftest's stage_runs)."""
    return [r["loss"] for r in read_metrics(stage_runs["vit-debug", 3])][:STEPS]


def describe(target, out, node_args, *options):
    """The target's description for 2 nodes of 1 process, the debug run's keys after --, parsed."""
    args = cluster.parse(["--target", target, "--nodes", "2", "--gpus_per_node", "1", "--config",
                          "configs/digits-vit.yaml", "--output_dir", str(out), *options, "--", *map(str, node_args)])
    text = cluster.describe(args)
    return text if target == "slurm" else yaml.safe_load(text)


def free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def nodes(target, out, node_args, launcher="torchrun"):
    """(each node's command, each node's variables) as the target's system would start them."""
    if target == "skypilot":  # `run` in the workdir, with the addresses, rank and GPUs SkyPilot sets
        run = describe(target, out, node_args, "--launcher", launcher)["run"]
        task = next(f"sky-loopback-{i}" for i in range(1000) if free(
            cluster_env.PORT_BASE + zlib.crc32(f"sky-loopback-{i}".encode()) % cluster_env.PORT_SPAN))
        env = {"SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.2\n", "SKYPILOT_NUM_NODES": "2",
               "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": task}
        return [["bash", "-c", run]] * 2, [dict(env, SKYPILOT_NODE_RANK=str(r)) for r in (0, 1)]
    if target == "kubeflow":  # the trainer's command, with the torch runtime's PET_* variables
        command = describe(target, out, node_args, "--launcher", launcher, "--workdir", REPO)["spec"]["trainer"][
            "command"]
        env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1",
               "PET_MASTER_PORT": str(free_port())}
        return [command] * 2, [dict(env, PET_NODE_RANK=str(r)) for r in (0, 1)]
    script = describe(target, out, node_args, "--launcher", launcher)  # its srun line, as srun runs it on each node
    line = next(line for line in script.splitlines() if line.startswith("srun "))
    command = shlex.split(line.removesuffix(" &"))[2:]  # in the background, for the time-limit trap
    port = free_port()
    while port >= cluster_env.PORT_BASE + cluster_env.PORT_SPAN:
        port = free_port()
    env = {"SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_NNODES": "2", "SLURM_JOB_ID": str(port - cluster_env.PORT_BASE)}
    return [command] * 2, [dict(env, SLURM_NODEID=str(r)) for r in (0, 1)]


# torchrun with Slurm's and Kubeflow's variables in the default suite (each system's parsing of its variables:
# tests/unit/test_cluster_descriptions.py); SkyPilot's run, and DeepSpeed's launcher per node (`--no_ssh` over a
# hostfile of the system's hosts, or of `node-0`, `node-1` under Kubeflow, which names none), under -m slow (~10 s
# each)
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("deepspeed", marks=pytest.mark.slow)])
@pytest.mark.parametrize("target", [pytest.param("skypilot", marks=pytest.mark.slow), "kubeflow", "slurm"])
def test_each_targets_node_command_trains_as_one_node(target, launcher, node_args, one_node, tmp_path):
    """The command each description runs on every node, with the variables its system sets: node.sh finds the
    master, port, rank and processes per node from them, and the two loopback nodes give one node's losses."""
    out = tmp_path / "run"
    commands, envs = nodes(target, out, node_args, launcher)
    outs = run_nodes(commands, envs)
    assert f"node 1 of 2: {launcher}, 1 processes, master 127.0.0.1:" in outs[1]
    assert "world size 2 (2 node(s) x 1" in outs[0]
    np.testing.assert_array_equal([r["loss"] for r in read_metrics(out)], one_node)


def test_the_slurm_script_requeues_and_checkpoints_at_the_time_limit(node_args, tmp_path):
    """The sbatch script itself on one node, with Slurm's commands as stand-ins (Slurm does not run here): `srun`
    runs its command, `scontrol` answers `show hostnames` and records a requeue. The signal Slurm sends the script
    before the time limit (USR1) requeues the job and stops the ranks with SIGTERM: they write a checkpoint of the
    step they are in and exit, and the script exits once they have."""
    import os
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    args = cluster.parse(["--target", "slurm", "--nodes", "1", "--gpus_per_node", "1", "--config",
                          "configs/digits-vit.yaml", "--output_dir", str(out), "--",
                          *map(str, node_args), "--max_steps", "400"])
    script = tmp_path / "job.sbatch"
    script.write_text(cluster.describe(args))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\nif [ "$1" = show ]; then echo "$3"; '
                                      f'else echo "$@" >> {tmp_path}/scontrol.log; fi\n')
    for stub in ("srun", "scontrol"):
        (bin_dir / stub).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="1",
               SLURM_NODEID="0", SLURM_JOB_NODELIST="127.0.0.1", SLURM_SUBMIT_DIR=REPO, MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 3:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)
        output = job.communicate(timeout=120)[0]
    finally:
        job.kill()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    step = read_metrics(out)[-1]["step"]
    assert f"preempted (SIGTERM) after step {step}: checkpoint step{step:07d} written" in output, output[-3000:]
    assert (out / "checkpoints" / f"step{step:07d}" / "train_state.json").exists() and step < 400
