"""launch/cluster.py's descriptions against their systems' schemas (SkyPilot 0.14.1's task schema, Kubeflow Trainer
v2.3.0's TrainJob CRD, vendored in launch/schemas/), the checked-in examples against what it writes, and its
refusals. The descriptions' node commands run on loopback in tests/integration/test_clusters.py."""
import copy
import os
import shlex

import pytest
import yaml
from conftest import REPO

from launch import cluster

EXAMPLES = os.path.join(REPO, "launch", "examples")


def written(path):
    """(the arguments its `written by` line records, the file's text)."""
    with open(path) as f:
        text = f.read()
    line = next(line for line in text.splitlines() if line.startswith("# written by: "))
    return shlex.split(line[len("# written by: "):])[3:], text


@pytest.mark.parametrize("name", sorted(os.listdir(EXAMPLES)))
def test_checked_in_examples_are_what_the_generator_writes_and_pass_their_schemas(name, monkeypatch):
    """Each example in launch/examples/ is launch/cluster.py's output for the arguments it records (2 nodes x 8
    GPUs of the main ImageNet recipe), and passes its target's schema."""
    monkeypatch.chdir(REPO)
    argv, text = written(os.path.join(EXAMPLES, name))
    args = cluster.parse(argv)
    assert args.nodes == 2 and args.gpus_per_node == 8 and args.config == "configs/imagenet-vit-large.yaml"
    assert cluster.describe(args) == text
    description = text if args.target == "slurm" else yaml.safe_load(text)
    assert cluster.validate(args.target, description) == []
    command = "bash launch/node.sh torchrun --config configs/imagenet-vit-large.yaml"
    assert command in text.replace("\n    - ", " ").replace("/workspace/vit-ds/", "")
    assert "--resume latest" in text.replace("\n    - ", " ")


def example(target):
    name = {"skypilot": "sky.yaml", "kubeflow": "trainjob.yaml", "slurm": "sbatch"}[target]
    _, text = written(os.path.join(EXAMPLES, f"imagenet-vit-large-2x8.{name}"))
    return text if target == "slurm" else yaml.safe_load(text)


def node_spec(job):
    return job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("target, change, complaint", [
    ("skypilot", lambda d: d.update(num_node=2), "'num_node' was unexpected"),
    ("skypilot", lambda d: d["resources"].update(accelerator="H100:8"), "'accelerator' was unexpected"),
    ("skypilot", lambda d: d["file_mounts"]["/output"].update(mode="MOUNTED"), "file_mounts./output"),
    ("skypilot", lambda d: d.update(num_nodes="two"), "num_nodes: 'two' is not of type 'integer'"),
    ("kubeflow", lambda d: d["spec"]["trainer"].update(numNode=2), "spec.trainer: Additional properties"),
    ("kubeflow", lambda d: d["spec"]["trainer"].update(numProcPerNode="8"), "numProcPerNode: '8' is not of type"),
    ("kubeflow", lambda d: d["spec"].pop("runtimeRef"), "'runtimeRef' is a required property"),
    ("kubeflow", lambda d: node_spec(d)["containers"][0].update(volumeMount=[]), "'volumeMount' was unexpected"),
])
def test_a_wrong_field_is_caught_by_the_schema(target, change, complaint):
    """Each example, with one field misspelt, mistyped or missing, fails its schema with a message naming it;
    Kubeflow's CRD read strictly, as the API server's strict field validation reads it."""
    description = example(target)
    assert cluster.validate(target, description) == []
    broken = copy.deepcopy(description)
    change(broken)
    problems = cluster.validate(target, broken)
    assert problems and any(complaint in p for p in problems), problems


def test_a_slurm_script_with_an_unknown_option_is_caught():
    script = example("slurm")
    assert cluster.validate("slurm", script) == []
    assert cluster.validate("slurm", script.replace("--gpus-per-node", "--gpu-per-node")) == [
        "unknown sbatch line: #SBATCH --gpu-per-node=8"]


@pytest.mark.parametrize("argv, message", [
    (["--target", "skypilot", "--config", "configs/imagenet-vit-large.yaml"],
     "error: 2 nodes write each checkpoint together, and a SkyPilot node's disk is its own: give --bucket (mounted "
     "at /output) or an --output_dir every node shares"),
    (["--target", "slurm", "--config", "configs/imagenet-vit-large.yaml", "--", "--epoch", "3"],
     "error: unknown config key 'epoch' in the command line"),
    (["--target", "kubeflow", "--config", "configs/imagenet-vit-large.yaml", "--nodes", "0"],
     "error: --nodes 0 --gpus_per_node 8: each must be at least 1"),
    (["--target", "slurm", "--config", os.path.join(os.sep, "tmp", "recipe.yaml")],
     "error: cannot read config file '/tmp/recipe.yaml'"),
])
def test_what_cannot_be_launched_is_one_error_and_exit_2(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(REPO)
    out = tmp_path / "job.yaml"
    assert cluster.main(argv + ["--out", str(out)] if "--" not in argv else
                        argv[:argv.index("--")] + ["--out", str(out)] + argv[argv.index("--"):]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not out.exists()


@pytest.mark.parametrize("doc", ["README.md", "docs/clusters.md"])
def test_the_docs_cluster_commands_write_valid_descriptions(doc, monkeypatch, tmp_path):
    """Every `python -m launch.cluster` line of the README and of docs/clusters.md, as written (with `...` and the
    keys after -- left out), writes a description that passes its schema."""
    import re

    monkeypatch.chdir(REPO)
    text = open(os.path.join(REPO, doc)).read().replace("\\\n", " ")
    lines = [line.split("  #")[0].strip() for line in re.findall(r"^python -m launch\.cluster .*$", text, re.M)]
    assert len(lines) >= 3
    for line in lines:
        argv = [a for a in shlex.split(line)[3:] if a != "..."]
        argv = argv[:argv.index("--")] if "--" in argv else argv
        if "--out" in argv:
            argv[argv.index("--out") + 1] = str(tmp_path / argv[argv.index("--out") + 1])
        if "--config" not in argv:
            continue  # an elided line (`...`): its options are the lines above
        args = cluster.parse(argv)
        text = cluster.describe(args)
        assert cluster.validate(args.target, text if args.target == "slurm" else yaml.safe_load(text)) == [], line


def test_each_systems_variables_give_the_nodes_rendezvous():
    """launch/cluster_env.py on the variables each system sets on node 1 of 2: the master, a port the same on
    every node, the rank and the processes per node; set MASTER_* and PROCS_PER_NODE win."""
    from launch import cluster_env

    slurm = cluster_env.cluster_env({"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
                                     "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "8"})
    assert slurm == {"MASTER_ADDR": "gpu07", "MASTER_PORT": "10123", "NNODES": "2", "NODE_RANK": "1",
                     "PROCS_PER_NODE": "8", "HOSTS": "gpu07 gpu08"}
    sky = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NUM_NODES": "2",
           "SKYPILOT_NUM_GPUS_PER_NODE": "8", "SKYPILOT_TASK_ID": "sky-2026-12-07-vit_1"}
    found = cluster_env.cluster_env(sky)
    assert found["MASTER_ADDR"] == "10.0.0.5" and found["NODE_RANK"] == "1" and found["PROCS_PER_NODE"] == "8"
    assert found["HOSTS"] == "10.0.0.5 10.0.0.6" and found["NNODES"] == "2"
    assert found["MASTER_PORT"] == cluster_env.cluster_env(dict(sky, SKYPILOT_NODE_RANK="0"))["MASTER_PORT"]
    assert found["MASTER_PORT"] != cluster_env.cluster_env(dict(sky, SKYPILOT_TASK_ID="another"))["MASTER_PORT"]
    pet = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "vit-node-0-0.vit", "PET_MASTER_PORT": "29400",
           "PET_NPROC_PER_NODE": "8"}
    assert cluster_env.cluster_env(pet) == {"MASTER_ADDR": "vit-node-0-0.vit", "MASTER_PORT": "29400", "NNODES": "2",
                                            "NODE_RANK": "1", "PROCS_PER_NODE": "8", "HOSTS": "node-0 node-1"}
    assert cluster_env.cluster_env(dict(pet, MASTER_PORT="1234", PROCS_PER_NODE="2"))["MASTER_PORT"] == "1234"
    with pytest.raises(SystemExit, match="SKYPILOT_NODE_IPS lists 1 addresses but SKYPILOT_NUM_NODES is 2"):
        cluster_env.cluster_env(dict(sky, SKYPILOT_NODE_IPS="10.0.0.5"))
    with pytest.raises(SystemExit, match="PET_NNODES is '1:4': an elastic range is not supported"):
        cluster_env.cluster_env(dict(pet, PET_NNODES="1:4"))
