#!/bin/bash
# one line per node (NODE_RANK 0..127); MASTER_ADDR: node 0's address
torchrun --nnodes 128 --nproc_per_node 8 --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port 29500 train.py --config docs/plans/vit-22b-1024xh100-pp/config.yaml "$@"
