#!/usr/bin/env bash
# One training process per SLURM task, with the environment that torch.distributed and Accelerate read (what
# `accelerate launch` would set): `srun task_env.sh python train.py`. The process replaces this shell, so it
# gets SLURM's signals itself, and its exit code (75 preempted, 69 GPU fault) is the task's.
set -euo pipefail
export RANK=${SLURM_PROCID:?run this under srun (SLURM_PROCID is not set)}
export LOCAL_RANK=${SLURM_LOCALID:?run this under srun (SLURM_LOCALID is not set)}
export WORLD_SIZE=${SLURM_NTASKS:?run this under srun (SLURM_NTASKS is not set)}
tasks_per_node=${SLURM_TASKS_PER_NODE:-$WORLD_SIZE}  # e.g. "8(x2)"
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-${tasks_per_node%%(*}}
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-29500}
exec "$@"
