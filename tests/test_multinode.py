"""Two "nodes" on loopback, each started by a launcher process of its own with one rank, against one node with
two ranks: the same losses under ZeRO-3, one writer per file in the shared output_dir, each rank's data position
saved and found again."""
import os
import subprocess

import numpy as np
import pytest
from conftest import BIN, REPO, free_port, launch, read_metrics

from launch import slurm_env

STEPS = 12


@pytest.fixture(scope="module")
def node_args(debug_args):
    return debug_args + ["--model", "vit-debug", "--zero_stage", "3", "--max_steps", STEPS, "--eval_every", "6",
                         "--save_every", "6", "--num_workers", "1"]


@pytest.fixture(scope="module")
def one_node(node_args, tmp_path_factory):
    """The reference: one launcher, two ranks."""
    out = tmp_path_factory.mktemp("one-node")
    launch(node_args + ["--output_dir", out], launcher="torchrun")
    return [r["loss"] for r in read_metrics(out)]


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


def torchrun_node(node_rank, port, args):
    return [f"{BIN}/torchrun", "--nnodes", "2", "--node_rank", node_rank, "--nproc_per_node", "1",
            "--master_addr", "127.0.0.1", "--master_port", port, "train.py", *args]


def test_two_torchrun_nodes_train_and_resume_as_one_node(node_args, one_node, tmp_path):
    """torchrun on each node; stopped at the checkpoint of step 6 and relaunched with --resume latest, the two
    nodes reproduce the single node's 12 losses (warm-up outlasts step 6, so stopping there changes no LR)."""
    out = tmp_path / "run"
    port = free_port()
    first = run_nodes([torchrun_node(r, port, node_args + ["--max_steps", 6, "--output_dir", out]) for r in (0, 1)])
    assert "2 node(s) x 1" in first[0] and "done:" in first[0]
    assert "global batch" not in first[1]  # rank 1 (node 1) writes and prints nothing of the run's own
    ckpt = out / "checkpoints" / "step0000006"
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("data_state")) == \
        ["data_state_rank00000.json", "data_state_rank00001.json"]  # each global rank's data position
    port = free_port()
    second = run_nodes([torchrun_node(r, port, node_args + ["--output_dir", out, "--resume", "latest"]) for r in (0, 1)])
    assert "resumed from" in second[0] and "data order restarts" not in second[0]
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # one writer: no record twice
    np.testing.assert_array_equal([r["loss"] for r in records], one_node)
    assert len(os.listdir(out / "tb")) == 2  # one event file per launch of rank 0, none from rank 1


def test_slurm_hostlist_expansion():
    from launch.slurm_env import expand_hostlist

    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("127.0.0.[1-2]") == ["127.0.0.1", "127.0.0.2"]
    assert expand_hostlist("node7") == ["node7"]


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "accelerate"])
def test_slurm_node_script_on_two_nodes(launcher, node_args, one_node, tmp_path):
    """launch/node.sh, as each sbatch script runs it through srun on every node, with the variables Slurm sets
    for a 2-node job: the ranks find each other from them and train as the single node does (6 steps: warm-up
    outlasts them, so the shorter run changes no LR). The deepspeed variant is DeepSpeed's own launcher per node,
    `--no_ssh --node_rank N` over a hostfile of the job's hosts."""
    port = free_port()
    while port >= slurm_env.PORT_BASE + slurm_env.PORT_SPAN:
        port = free_port()
    slurm = {"SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_NNODES": "2", "SLURM_JOB_ID": str(port - slurm_env.PORT_BASE)}
    out = tmp_path / "run"
    outs = run_nodes([["bash", "launch/node.sh", launcher, *node_args, "--max_steps", 6, "--output_dir", out]
                      for _ in (0, 1)], envs=[dict(slurm, SLURM_NODEID=str(r)) for r in (0, 1)])
    assert f"node 1 of 2: {launcher}, 1 processes, master 127.0.0.1:{port}" in outs[1]
    assert "world size 2 (2 node(s) x 1" in outs[0]
    np.testing.assert_array_equal([r["loss"] for r in read_metrics(out)], one_node[:6])


def test_slurm_env_outside_a_job_is_one_error():
    proc = subprocess.run(["bash", "launch/node.sh", "torchrun"], cwd=REPO, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: not inside a Slurm job step: SLURM_JOB_NODELIST")
