"""Two "nodes" on loopback, each started by a launcher process of its own, against one node: the same losses
under ZeRO-3, one writer per file in the shared output_dir, each rank's data position saved and found again;
Slurm's variables; ZeRO++'s hierarchical partitioning within a node; a master that cannot be reached."""
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, fork_launch, free_port, launch, read_metrics, run_nodes

from launch import cluster_env
from launch.job import command

STEPS = 12


@pytest.fixture(scope="module")
def node_args(debug_args):
    return debug_args + ["--model", "vit-debug", "--zero_stage", "3", "--max_steps", STEPS, "--eval_every", "6",
                         "--save_every", "6", "--num_workers", "1", "--report_to", "tensorboard"]


@pytest.fixture(scope="module")
def one_node(node_args, tmp_path_factory):
    """The reference: one node of two ranks."""
    out = tmp_path_factory.mktemp("one-node")
    launch(node_args + ["--output_dir", out])
    return [r["loss"] for r in read_metrics(out)]


def torchrun_node(node_rank, port, args, ranks=1):
    return command("torchrun", ranks, port, nnodes=2, node_rank=node_rank) + [str(a) for a in args]


@pytest.mark.slow  # ~19 s: two nodes train by default in tests/integration/test_clusters.py and test_readme.py
def test_two_torchrun_nodes_train_and_resume_as_one_node(node_args, one_node, tmp_path):
    """torchrun on each node; stopped at the checkpoint of step 6 and relaunched with --resume latest, the two
    nodes reproduce the single node's 12 losses (warm-up outlasts step 6, so stopping there changes no LR)."""
    out = tmp_path / "run"
    port = free_port()
    first = run_nodes([torchrun_node(r, port, node_args + ["--max_steps", 6, "--output_dir", out]) for r in (0, 1)])
    assert "2 node(s) x 1" in first[0] and "done:" in first[0]
    assert "global batch" not in first[1]  # rank 1 (node 1) writes and prints nothing of the run's own
    ckpt = out / "checkpoints" / "step0000006"
    state = json.loads((ckpt / "train_state.json").read_text())  # written by global rank 0 alone
    assert state["world_size"] == 2 and state["step"] == 6
    assert sorted(state["data"]["streams"]) == ["0", "1"]  # each rank's data stream, node 1's gathered to node 0
    port = free_port()
    second = run_nodes([torchrun_node(r, port, node_args + ["--output_dir", out, "--resume", "latest"]) for r in (0, 1)])
    assert "resumed from" in second[0] and "data order restarts" not in second[0]
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # one writer: no record twice
    np.testing.assert_array_equal([r["loss"] for r in records], one_node)
    assert len(os.listdir(out / "tb")) == 2  # one event file per launch of rank 0, none from rank 1


def test_slurm_hostlist_expansion():
    from launch.cluster_env import expand_hostlist

    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("127.0.0.[1-2]") == ["127.0.0.1", "127.0.0.2"]
    assert expand_hostlist("node7") == ["node7"]


# accelerate's launcher trains in the default suite: tests/integration/test_launchers.py::test_accelerate_launch_two_ranks
# and its DeepSpeed plugin's case
# under -m slow (~18 s each): the default suite runs the node script under torchrun with Slurm's, SkyPilot's and
# Kubeflow's variables (tests/integration/test_clusters.py)
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "accelerate"])
def test_slurm_node_script_on_two_nodes(launcher, node_args, one_node, tmp_path):
    """launch/node.sh, as each sbatch script runs it through srun on every node, with the variables Slurm sets
    for a 2-node job: the ranks find each other from them and train as the single node does (6 steps: warm-up
    outlasts them, so the shorter run changes no LR). The deepspeed variant is DeepSpeed's own launcher per node,
    `--no_ssh --node_rank N` over a hostfile of the job's hosts."""
    port = free_port()
    while port >= cluster_env.PORT_BASE + cluster_env.PORT_SPAN:
        port = free_port()
    slurm = {"SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_NNODES": "2", "SLURM_JOB_ID": str(port - cluster_env.PORT_BASE)}
    out = tmp_path / "run"
    outs = run_nodes([["bash", "launch/node.sh", launcher, *node_args, "--max_steps", 6, "--output_dir", out]
                      for _ in (0, 1)], envs=[dict(slurm, SLURM_NODEID=str(r)) for r in (0, 1)])
    assert f"node 1 of 2: {launcher}, 1 processes, master 127.0.0.1:{port}" in outs[1]
    assert "world size 2 (2 node(s) x 1" in outs[0]
    np.testing.assert_array_equal([r["loss"] for r in read_metrics(out)], one_node[:6])


@pytest.mark.slow  # two launches of two loopback nodes and a reference: most of a minute
def test_fsdp2_on_two_slurm_nodes_trains_and_resumes_as_one_node(node_args, tmp_path):
    """The FSDP2 engine through launch/node.sh (each sbatch script's node command) on two loopback nodes with
    Slurm's variables: stopped at the DCP checkpoint of step 6 and relaunched with --resume latest, it gives the
    12 losses of one forked FSDP2 node of two ranks."""
    args = node_args + ["--engine", "fsdp2"]
    launch(args + ["--output_dir", tmp_path / "one"])
    expected = [r["loss"] for r in read_metrics(tmp_path / "one")]
    out = tmp_path / "run"
    for extra in (["--max_steps", 6], ["--resume", "latest"]):
        port = free_port()
        while port >= cluster_env.PORT_BASE + cluster_env.PORT_SPAN:
            port = free_port()
        slurm = {"SLURM_JOB_NODELIST": "127.0.0.[1-2]", "SLURM_NNODES": "2",
                 "SLURM_JOB_ID": str(port - cluster_env.PORT_BASE)}
        outs = run_nodes([["bash", "launch/node.sh", "torchrun", *args, *extra, "--output_dir", out] for _ in (0, 1)],
                         envs=[dict(slurm, SLURM_NODEID=str(r)) for r in (0, 1)])
        assert "FSDP2 (resharded after forward)" in outs[0] and "(2 node(s) x 1" in outs[0]
    assert json.loads((out / "checkpoints" / "step0000006" / "train_state.json").read_text())["engine"] == "fsdp2"
    np.testing.assert_array_equal([r["loss"] for r in read_metrics(out)], expected)


def test_node_script_outside_a_cluster_is_one_error():
    """launch/node.sh where no Slurm, SkyPilot or Kubeflow variables are set: one line naming them, a failure."""
    proc = subprocess.run(["bash", "launch/node.sh", "torchrun"], cwd=REPO, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SKYPILOT_", "PET_"))})
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: not inside a Slurm job step, a SkyPilot task or a Kubeflow TrainJob: none of SLURM_JOB_ID, "
        "SKYPILOT_NODE_RANK, PET_NNODES is set (launch/node.sh runs on a cluster's node)")


@pytest.mark.slow  # two 2-rank loopback nodes, most of a minute
def test_zeropp_hierarchical_partitioning_on_two_nodes_of_two_ranks(debug_args, tmp_path):
    """ZeRO++'s hpZ on 2 torchrun nodes of 2 ranks: ds_configs/zero3pp.json's zero_hpz_partition_size "auto" is
    the 2 ranks per node, so each parameter's secondary partition stays within its node. The losses equal plain
    ZeRO-3's on 1 rank accumulating 4 micro-batches (the same samples per step). Its quantized weights and
    gradients run CUDA kernels: refused on CPU (tests/integration/test_bad_input.py), run by benchmarks/gpu_check.sh."""
    template = json.loads((Path(REPO) / "ds_configs" / "zero3pp.json").read_text())
    template["zero_optimization"].update(zero_quantized_weights=False, zero_quantized_gradients=False)
    hpz = tmp_path / "hpz.json"
    hpz.write_text(json.dumps(template))
    args = debug_args + ["--model", "vit-debug", "--zero_stage", 3, "--max_steps", 8, "--eval_every", 0,
                         "--save_every", 0]
    port = free_port()
    outs = run_nodes([torchrun_node(r, port, args + ["--ds_config", hpz, "--output_dir", tmp_path / "hpz"], ranks=2)
                      for r in (0, 1)])
    assert "ZeRO-3 (hpZ over 2 ranks)" in outs[0] and "world size 4 (2 node(s) x 2" in outs[0]
    launch(args + ["--grad_accum_steps", 4, "--output_dir", tmp_path / "plain"], nproc=1)
    np.testing.assert_allclose([r["loss"] for r in read_metrics(tmp_path / "hpz")],
                               [r["loss"] for r in read_metrics(tmp_path / "plain")], rtol=1e-5)


@pytest.mark.slow  # two 2-rank loopback nodes and two references, about a minute on 2 cores
def test_fsdp2_hsdp_on_two_nodes_of_two_ranks(debug_args, tmp_path):
    """FSDP2's HSDP (replicate_degree 2: each node's 2 ranks shard a replica, the replicas all-reduce) on 2
    torchrun nodes of 2 ranks: the losses of the 1-D mesh on 2 ranks accumulating 2 micro-batches (the same
    samples per step) within fp32 reduction order, and its checkpoint resumes on that 1-D mesh."""
    args = debug_args + ["--model", "vit-debug", "--engine", "fsdp2", "--zero_stage", 3, "--max_steps", 8,
                         "--eval_every", 0, "--save_every", 4, "--ema_decay", 0.9]
    port = free_port()
    outs = run_nodes([torchrun_node(r, port, args + ["--replicate_degree", 2, "--output_dir", tmp_path / "hsdp"],
                                    ranks=2) for r in (0, 1)])
    assert "HSDP (2 replicas x 2 shards, resharded after forward)" in outs[0]
    assert "world size 4 (2 node(s) x 2" in outs[0]
    launch(args + ["--grad_accum_steps", 2, "--output_dir", tmp_path / "flat"])
    flat = [r["loss"] for r in read_metrics(tmp_path / "flat")]
    np.testing.assert_allclose([r["loss"] for r in read_metrics(tmp_path / "hsdp")], flat, rtol=1e-5)
    launch(args + ["--grad_accum_steps", 2, "--output_dir", tmp_path / "resumed", "--resume",
                   tmp_path / "hsdp" / "checkpoints" / "step0000004"])
    np.testing.assert_allclose([r["loss"] for r in read_metrics(tmp_path / "resumed")], flat[4:], rtol=1e-5)


def test_a_master_port_in_use_is_one_error_naming_it(debug_args, tmp_path):
    """Rank 0 of 2 whose MASTER_PORT another process holds: one line naming the address and the port in use, not
    the dist_timeout it did not wait out, and exit 2 with nothing written."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = fork_launch([*map(str, debug_args), "--max_steps", "2", "--output_dir", str(tmp_path / "run")], 1, env,
                           timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: rank 0 could not serve the process group's store at 127.0.0.1:{port}: the port is in "
                      f"use by another process (another job, or a rank of one not yet exited); launch with another "
                      f"--master_port (MASTER_PORT), or once that process has exited"], proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_unreachable_master_is_one_error_within_the_timeout(debug_args, tmp_path):
    """Node 1 of 2 started against a master address where nothing listens: one line naming the address and port,
    within dist_timeout (plus the interpreter's start), exit 2. So is node 0 when no other node joins."""
    port = free_port()  # bound and released: nothing listens there
    args = [*map(str, debug_args), "--max_steps", "2", "--dist_timeout", "4"]
    for rank, message in ((1, f"error: rank 1 cannot reach the master at 127.0.0.1:{port} within 4 s (dist_timeout)"),
                          (0, f"error: rank 0 could not form the process group through the master at "
                              f"127.0.0.1:{port} within 4 s (dist_timeout)")):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        start = time.monotonic()
        proc = fork_launch(args + ["--output_dir", str(tmp_path / f"rank{rank}")], 1, env, timeout=120)
        elapsed = time.monotonic() - start
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(message), proc.stderr[-2000:]
        assert elapsed < 4 + 30, elapsed
        assert not (tmp_path / f"rank{rank}").exists()  # nothing written
