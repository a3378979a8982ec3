"""A cluster's launch description for a recipe: a SkyPilot task, a Kubeflow Trainer TrainJob or a Slurm batch script.

    python -m launch.cluster --target skypilot --nodes 2 --gpus_per_node 8 --config configs/imagenet-vit-large.yaml
    python -m launch.cluster --target kubeflow --nodes 2 --gpus_per_node 8 --config ... --image REGISTRY/vit-ds:TAG
    python -m launch.cluster --target slurm --nodes 2 --gpus_per_node 8 --config ... --out job.sbatch
    python -m launch.cluster --target skypilot ... -- --lr 8e-4 --epochs 400    # more train.py keys after --

Every description runs the same command on each node, `bash launch/node.sh LAUNCHER --config RECIPE --output_dir
DIR --resume latest ...`: node.sh reads the master address, port, node rank and processes per node from the
variables that system sets (launch/cluster_env.py) and starts torchrun, deepspeed or accelerate; `--resume latest`
continues from the newest complete checkpoint in DIR when the system restarts the job (SkyPilot's managed-job
recovery, a Kubernetes restart, Slurm's requeue), so DIR must outlive a node: a bucket mount, a shared volume.
Each description is checked against its system's schema before it is written (tests/unit/test_cluster_descriptions.py
holds the checked-in examples in launch/examples/ to what this writes). docs/clusters.md: what each one assumes.
"""
import argparse
import json
import os
import re
import shlex
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGETS = ("skypilot", "kubeflow", "slurm")
LAUNCHERS = ("torchrun", "deepspeed", "accelerate")
SCHEMAS = {"skypilot": os.path.join(HERE, "schemas", "skypilot-0.14.1-task.json"),
           "kubeflow": os.path.join(HERE, "schemas", "kubeflow-trainer-v2.3.0-trainjob.json")}
KUBEFLOW_RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for torchrun jobs
IMAGE_WORKDIR = "/workspace/vit-ds"  # where the image built per docs/clusters.md holds this repository


class LaunchError(ValueError):
    pass


def node_command(launcher: str, recipe: str, output_dir: str, extra: list) -> list[str]:
    """What every node runs: launch/node.sh under `launcher`, resuming from the newest checkpoint in `output_dir`."""
    return ["bash", "launch/node.sh", launcher, "--config", recipe, "--output_dir", output_dir, "--resume", "latest",
            *map(str, extra)]


def _name(recipe: str, name: str) -> str:
    """A job name every system takes: lowercase letters, digits and '-' (Kubernetes' DNS-1123 label)."""
    name = name or os.path.splitext(os.path.basename(recipe))[0]
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].strip("-")
    if not label:
        raise LaunchError(f"--name '{name}': a job name needs a letter or digit")
    return label


def skypilot(args, command: list[str]) -> dict:
    """A SkyPilot task: `sky launch` (or `sky jobs launch`, which recovers from preemption) from the repository's
    root syncs it as the workdir, `setup` installs the README's environment, `run` starts this node's ranks."""
    resources = {"accelerators": f"{args.accelerator}:{args.gpus_per_node}"}
    if args.image:
        resources["image_id"] = f"docker:{args.image}"
    task = {"name": args.name, "num_nodes": args.nodes, "resources": resources, "workdir": ".",
            "setup": "make install\n", "run": shlex.join(command) + "\n"}
    if args.bucket:  # SkyPilot mounts the bucket and uploads what is written under it
        task["file_mounts"] = {args.mount: {"source": args.bucket, "mode": "MOUNT_CACHED"}}
    return task


def kubeflow(args, command: list[str]) -> dict:
    """A Kubeflow Trainer TrainJob over the `torch-distributed` runtime: the image holds this repository (built as
    docs/clusters.md says), every node runs node.sh from it with the PET_* variables the runtime sets; a memory
    volume at /dev/shm for the DataLoader workers, the output volume claim at the output's mount."""
    script = [os.path.join(args.workdir, command[1]), *command[2:]]
    spec = {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                        {"name": "output", "persistentVolumeClaim": {"claimName": args.pvc}}],
            "containers": [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                                                             {"name": "output", "mountPath": args.mount}]}]}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": args.name},
            "spec": {"runtimeRef": {"name": KUBEFLOW_RUNTIME},
                     "trainer": {"image": args.image or "vit-ds:latest", "command": ["bash", *script],
                                 "numNodes": args.nodes, "numProcPerNode": args.gpus_per_node,
                                 "resourcesPerNode": {"limits": {"nvidia.com/gpu": args.gpus_per_node}}},
                     "runtimePatches": [{"manager": "vit-ds.launch.cluster", "trainingRuntimeSpec": {"template": {
                         "spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
                             "spec": spec}}}}]}}}}]}}


def slurm(args, command: list[str]) -> str:
    """An sbatch script: one task per node runs node.sh through srun. Three minutes before the time limit Slurm
    signals the script, which requeues the job and sends SIGTERM to the ranks (through srun): they write a
    checkpoint and exit, and the requeued job resumes from it. `--requeue`: a preemption or a node failure
    requeues it too."""
    lines = ["#!/usr/bin/env bash", f"# written by: {args.written_by}",
             f"#SBATCH --job-name={args.name}", f"#SBATCH --nodes={args.nodes}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={args.gpus_per_node}", f"#SBATCH --cpus-per-task={args.cpus_per_node}",
             f"#SBATCH --time={args.time}", "#SBATCH --signal=B:USR1@180", "#SBATCH --requeue",
             "#SBATCH --output=%x-%j.out", "set -euo pipefail", 'cd "${SLURM_SUBMIT_DIR:-.}"',
             "# near the time limit: requeue, and SIGTERM to the ranks (a checkpoint, then exit)",
             """trap 'scontrol requeue "$SLURM_JOB_ID"; kill -TERM "$step" 2>/dev/null' USR1""",
             f"srun --kill-on-bad-exit=1 {shlex.join(command)} &",
             "step=$! status=0",
             'while kill -0 "$step" 2>/dev/null; do  # a trapped signal ends a wait early: wait again',
             '  wait "$step" && status=0 || status=$?',
             "done",
             'exit "$status"']
    return "\n".join(lines) + "\n"


class _Literal(str):
    pass


def _dump(data: dict) -> str:
    """YAML with multi-line strings as literal blocks (a SkyPilot task's scripts read as they run)."""
    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))

    def literal(value):
        if isinstance(value, dict):
            return {k: literal(v) for k, v in value.items()}
        if isinstance(value, list):
            return [literal(v) for v in value]
        return _Literal(value) if isinstance(value, str) and "\n" in value else value

    return yaml.dump(literal(data), Dumper=Dumper, sort_keys=False, width=120)


def strict(schema):
    """A Kubernetes structural schema as the API server's strict field validation reads it: an object that lists
    its properties and neither preserves unknown fields nor types its extra ones refuses any other field."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate(target: str, description) -> list[str]:
    """The schema's complaints about a description (empty: valid): SkyPilot's task schema, the TrainJob CRD's
    OpenAPI schema read strictly; a Slurm script's `#SBATCH` lines against the options it writes."""
    if target == "slurm":
        bad = [line for line in description.splitlines() if line.startswith("#SBATCH")
               and not re.fullmatch(r"#SBATCH --(job-name|nodes|ntasks-per-node|gpus-per-node|cpus-per-task|time|"
                                    r"signal|requeue|output)(=\S+)?", line)]
        return [f"unknown sbatch line: {line}" for line in bad]
    import jsonschema

    with open(SCHEMAS[target]) as f:
        schema = json.load(f)
    if target == "kubeflow":
        schema = strict(schema)
    def enum(case):  # SkyPilot's own keywords: an enum whose strings match ignoring case, or exactly
        def check(validator, names, instance, schema):
            fold = (lambda v: v.lower()) if not case else (lambda v: v)
            if isinstance(instance, str) and fold(instance) not in [fold(n) for n in names]:
                yield jsonschema.ValidationError(f"{instance!r} is not one of {names!r}")
        return check

    validator = jsonschema.validators.extend(jsonschema.Draft7Validator, {
        "case_insensitive_enum": enum(False), "case_sensitive_enum": enum(True)})(schema)
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in sorted(validator.iter_errors(description), key=lambda e: list(map(str, e.absolute_path)))]


def describe(args) -> str:
    """The target's description as text, checked against its schema; LaunchError for what cannot be launched."""
    import config

    try:  # the recipe and the extra keys as train.py reads them: a bad key fails here, not on the cluster
        cfg = config.parse(["--config", args.config, *map(str, args.extra)])
    except config.ConfigError as e:
        raise LaunchError(str(e)) from None
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise LaunchError(f"--nodes {args.nodes} --gpus_per_node {args.gpus_per_node}: each must be at least 1")
    recipe = os.path.relpath(os.path.abspath(args.config), REPO)
    if recipe.startswith(".."):
        raise LaunchError(f"--config {args.config}: the recipe must lie inside the repository ({REPO}), which every "
                          f"node runs from")
    args.name = _name(recipe, args.name)
    if args.target == "skypilot" and args.nodes > 1 and not (args.bucket or args.output_dir):
        raise LaunchError(f"{args.nodes} nodes write each checkpoint together, and a SkyPilot node's disk is its "
                          f"own: give --bucket (mounted at {args.mount}) or an --output_dir every node shares")
    output_dir = args.output_dir or (os.path.join(args.mount, args.name) if args.target != "slurm" else cfg.output_dir)
    command = node_command(args.launcher, recipe, output_dir, args.extra)
    description = globals()[args.target](args, command)
    problems = validate(args.target, description)
    if problems:
        raise LaunchError(f"the {args.target} description does not pass its schema: {problems[0]}")
    text = description if isinstance(description, str) else _dump(description)
    if args.target != "slurm":
        text = f"# written by: {args.written_by}\n{text}"
    return text


def parse(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m launch.cluster", description=__doc__.split("\n\n")[0],
                                epilog="Keys after -- go to train.py on every node.")
    p.add_argument("--target", required=True, choices=TARGETS)
    p.add_argument("--config", required=True, help="the recipe, a path inside this repository")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun", help="the launcher node.sh starts per node")
    p.add_argument("--name", default="", help="the job's name (default: the recipe's file name)")
    p.add_argument("--output_dir", default="", help="checkpoints, metrics and exports; it must outlive a node "
                   "(default: MOUNT/NAME on SkyPilot and Kubeflow, the recipe's output_dir under Slurm)")
    p.add_argument("--image", default="", help="the container image (Kubeflow: the image holding this repository, "
                   "default vit-ds:latest; SkyPilot: optional, run as docker:IMAGE)")
    p.add_argument("--accelerator", default="H100", help="SkyPilot: the GPU type")
    p.add_argument("--bucket", default="", help="SkyPilot: a bucket (s3://, gs://, ...) mounted at MOUNT")
    p.add_argument("--mount", default="/output", help="SkyPilot and Kubeflow: where the output volume is mounted")
    p.add_argument("--pvc", default="vit-ds-output", help="Kubeflow: the persistent volume claim (ReadWriteMany) "
                   "mounted at MOUNT")
    p.add_argument("--workdir", default=IMAGE_WORKDIR, help="Kubeflow: this repository's path inside the image")
    p.add_argument("--time", default="24:00:00", help="Slurm: the time limit")
    p.add_argument("--cpus_per_node", type=int, default=0, help="Slurm: CPUs per node (default 8 per GPU)")
    p.add_argument("--out", default="", help="write here instead of standard output")
    args = p.parse_args(own)
    args.extra = extra
    args.cpus_per_node = args.cpus_per_node or 8 * args.gpus_per_node
    shown = list(own)
    if "--out" in shown:  # where it was written is not part of what was asked for
        del shown[shown.index("--out"):shown.index("--out") + 2]
    args.written_by = shlex.join(["python", "-m", "launch.cluster", *shown, *(["--", *extra] if extra else [])])
    return args


def main(argv=None) -> int:
    args = parse(argv)
    try:
        text = describe(args)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.out + ".tmp", args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
