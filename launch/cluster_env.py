"""What a node's launcher needs, from the variables the cluster set for this node, as shell assignments for `eval`.

    eval "$(python launch/cluster_env.py)"    # MASTER_ADDR MASTER_PORT NNODES NODE_RANK PROCS_PER_NODE HOSTS

Three systems, recognised by their own variables (the first found wins):
- Slurm (`SLURM_JOB_ID`): the job's first host is the master, the port is derived from the job id (the same on
  every node, different between jobs), the node rank is `SLURM_NODEID`, processes per node `SLURM_GPUS_ON_NODE`.
- SkyPilot (`SKYPILOT_NODE_RANK`): `SKYPILOT_NODE_IPS` lists the nodes' addresses, head first; the port is derived
  from `SKYPILOT_TASK_ID`; processes per node `SKYPILOT_NUM_GPUS_PER_NODE`.
- Kubeflow Trainer's torch runtime (`PET_NNODES`): `PET_MASTER_ADDR`, `PET_MASTER_PORT`, `PET_NODE_RANK`,
  `PET_NPROC_PER_NODE` (torchrun's own variables; `auto` is this node's GPUs). It names no hosts: DeepSpeed's
  hostfile (`--no_ssh`, where names are only keys) gets `node-0` ... `node-N-1`.
A node without GPUs runs one process. Set MASTER_ADDR, MASTER_PORT or PROCS_PER_NODE beforehand to override one.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import zlib

PORT_BASE, PORT_SPAN = 10000, 50000  # a derived MASTER_PORT is PORT_BASE + (a job's number) % PORT_SPAN
SYSTEMS = {"slurm": "SLURM_JOB_ID", "skypilot": "SKYPILOT_NODE_RANK", "kubeflow": "PET_NNODES"}


def expand_hostlist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`gpu[01-03,07],login1`) as host names, in order."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*),?", nodelist):
        if not prefix and not ranges:
            continue
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for i in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{i:0{len(first)}d}{suffix}")
    return hosts


def _gpus() -> str:
    import torch

    return str(torch.cuda.device_count() or 1)


def _require(env: dict, keys: tuple, where: str):
    missing = [k for k in keys if k not in env]
    if missing:
        raise SystemExit(f"error: {where}: {', '.join(missing)} unset")


def slurm_env(env: dict) -> dict:
    _require(env, ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_ID"),
             "not inside a Slurm job step (run through srun)")
    hosts = expand_hostlist(env["SLURM_JOB_NODELIST"])
    if len(hosts) != int(env["SLURM_NNODES"]):
        raise SystemExit(f"error: SLURM_JOB_NODELIST names {len(hosts)} hosts but SLURM_NNODES is {env['SLURM_NNODES']}")
    return {"MASTER_ADDR": hosts[0], "MASTER_PORT": str(PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN),
            "NNODES": env["SLURM_NNODES"], "NODE_RANK": env["SLURM_NODEID"],
            "PROCS_PER_NODE": env.get("SLURM_GPUS_ON_NODE") or _gpus(), "HOSTS": " ".join(hosts)}


def skypilot_env(env: dict) -> dict:
    _require(env, ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES", "SKYPILOT_TASK_ID"),
             "a SkyPilot task's variables are incomplete")
    hosts = env["SKYPILOT_NODE_IPS"].split()
    if len(hosts) != int(env["SKYPILOT_NUM_NODES"]):
        raise SystemExit(f"error: SKYPILOT_NODE_IPS lists {len(hosts)} addresses but SKYPILOT_NUM_NODES is "
                         f"{env['SKYPILOT_NUM_NODES']}")
    gpus = env.get("SKYPILOT_NUM_GPUS_PER_NODE", "0")
    return {"MASTER_ADDR": hosts[0],
            "MASTER_PORT": str(PORT_BASE + zlib.crc32(env["SKYPILOT_TASK_ID"].encode()) % PORT_SPAN),
            "NNODES": env["SKYPILOT_NUM_NODES"], "NODE_RANK": env["SKYPILOT_NODE_RANK"],
            "PROCS_PER_NODE": gpus if int(gpus or 0) > 0 else "1", "HOSTS": " ".join(hosts)}


def kubeflow_env(env: dict) -> dict:
    _require(env, ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
             "a Kubeflow TrainJob's torch variables are incomplete")
    procs = env.get("PET_NPROC_PER_NODE", "auto")
    nnodes = env["PET_NNODES"]
    if not nnodes.isdigit():
        raise SystemExit(f"error: PET_NNODES is '{nnodes}': an elastic range is not supported; set numNodes")
    return {"MASTER_ADDR": env["PET_MASTER_ADDR"], "MASTER_PORT": env["PET_MASTER_PORT"], "NNODES": nnodes,
            "NODE_RANK": env["PET_NODE_RANK"], "PROCS_PER_NODE": _gpus() if not procs.isdigit() else procs,
            "HOSTS": " ".join(f"node-{i}" for i in range(int(nnodes)))}


def cluster_env(env: dict) -> dict:
    """The node's launch settings from the first system whose variables are set; overrides from `env`."""
    for system, marker in SYSTEMS.items():
        if marker in env:
            found = globals()[f"{system}_env"](env)
            break
    else:
        raise SystemExit("error: not inside a Slurm job step, a SkyPilot task or a Kubeflow TrainJob: none of "
                         f"{', '.join(SYSTEMS.values())} is set (launch/node.sh runs on a cluster's node)")
    return {**found, **{k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "PROCS_PER_NODE") if env.get(k)}}


if __name__ == "__main__":
    for key, value in cluster_env(dict(os.environ)).items():
        print(f"{key}={shlex.quote(value)}")
    sys.exit(0)
