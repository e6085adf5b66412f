#!/bin/bash
# Batch script of the toy demo: one torchrun per node, rendezvous on the first node.
# Counts come from the current allocation, never from inherited srun defaults.
set -euo pipefail
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
count=$(echo "$nodes" | wc -l)
master=$(echo "$nodes" | head -n 1)
master_addr=$(scontrol show node "$master" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
port=$((29500 + SLURM_JOB_ID % 1000))
export OMP_NUM_THREADS=1
srun --nodes="$count" --ntasks="$count" --ntasks-per-node=1 \
  "$RESURGO_PYTHON" -m torch.distributed.run \
  --nnodes="$count" --nproc-per-node=2 \
  --rdzv-backend=c10d --rdzv-endpoint="$master_addr:$port" --rdzv-id="$SLURM_JOB_ID" \
  "$RESURGO_DEMO_DIR/toy_allreduce.py"
