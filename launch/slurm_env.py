"""What a node's launcher needs, from the variables Slurm sets, as shell assignments for `eval`.

    eval "$(python launch/slurm_env.py)"    # MASTER_ADDR MASTER_PORT NNODES NODE_RANK PROCS_PER_NODE HOSTS

MASTER_ADDR is the job's first host; MASTER_PORT is derived from the job id (the same on every node, different
between jobs); PROCS_PER_NODE is the node's GPUs (1 without any). Each can be set beforehand to override it.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

PORT_BASE, PORT_SPAN = 10000, 50000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN


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


def slurm_env(env: dict) -> dict:
    missing = [k for k in ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_ID") if k not in env]
    if missing:
        raise SystemExit(f"error: not inside a Slurm job step: {', '.join(missing)} unset (run through srun)")
    hosts = expand_hostlist(env["SLURM_JOB_NODELIST"])
    if len(hosts) != int(env["SLURM_NNODES"]):
        raise SystemExit(f"error: SLURM_JOB_NODELIST names {len(hosts)} hosts but SLURM_NNODES is {env['SLURM_NNODES']}")
    gpus = env.get("SLURM_GPUS_ON_NODE")
    if gpus is None:
        import torch

        gpus = str(torch.cuda.device_count() or 1)
    return {"MASTER_ADDR": env.get("MASTER_ADDR") or hosts[0],
            "MASTER_PORT": env.get("MASTER_PORT") or str(PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN),
            "NNODES": env["SLURM_NNODES"], "NODE_RANK": env["SLURM_NODEID"],
            "PROCS_PER_NODE": env.get("PROCS_PER_NODE") or gpus, "HOSTS": " ".join(hosts)}


if __name__ == "__main__":
    for key, value in slurm_env(dict(os.environ)).items():
        print(f"{key}={shlex.quote(value)}")
    sys.exit(0)
