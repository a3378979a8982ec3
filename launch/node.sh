#!/usr/bin/env bash
# One node's launch on a cluster: the sbatch scripts beside this run it on every node through srun, SkyPilot tasks
# and Kubeflow TrainJobs written by launch/cluster.py as their run command:
#   bash launch/node.sh {deepspeed|torchrun|accelerate} [train.py arguments...]
# Master address, port, node rank and processes per node come from the variables Slurm, SkyPilot or Kubeflow
# Trainer set on each node (launch/cluster_env.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
launcher=${1:?usage: node.sh deepspeed|torchrun|accelerate [train.py args]}
shift
settings=$($PY launch/cluster_env.py)  # a failure stops here (set -e), with its one error line
eval "$settings"
echo "node $NODE_RANK of $NNODES: $launcher, $PROCS_PER_NODE processes, master $MASTER_ADDR:$MASTER_PORT" >&2
case "$launcher" in
  torchrun)
    exec "$BIN/torchrun" --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$PROCS_PER_NODE" \
      --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" train.py "$@" ;;
  deepspeed)  # DeepSpeed's launcher on every node, no ssh: it reads global ranks off a hostfile of the job's hosts
    hostfile=$(mktemp "${TMPDIR:-/tmp}/hostfile.XXXXXX")
    for host in $HOSTS; do echo "$host slots=$PROCS_PER_NODE"; done > "$hostfile"
    exec "$BIN/deepspeed" --hostfile "$hostfile" --no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" \
      --master_port "$MASTER_PORT" train.py "$@" ;;
  accelerate)
    exec "$BIN/accelerate" launch --multi_gpu --num_machines "$NNODES" --machine_rank "$NODE_RANK" \
      --num_processes $((NNODES * PROCS_PER_NODE)) --main_process_ip "$MASTER_ADDR" \
      --main_process_port "$MASTER_PORT" --mixed_precision no --dynamo_backend no train.py "$@" ;;
  *) echo "error: unknown launcher '$launcher' (deepspeed, torchrun or accelerate)" >&2; exit 2 ;;
esac
