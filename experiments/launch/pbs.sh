#!/usr/bin/env bash
# Multi-node GPU run under PBS Pro (e.g. ALCF Polaris): one process per node (jax.distributed),
# each with the node's NVMe as tier 0 and the shared parallel file system as tier 1.
#
#   qsub -l select=4 -v PFS_DIR=/lus/eagle/projects/$PROJ/$USER experiments/launch/pbs.sh
#   (arguments for pretrain.py: -v PRETRAIN_ARGS="--set steps=100")
#
# Environment (pass with qsub -v):
#   PFS_DIR    shared file-system directory (required); outputs and tier 1 go there
#   NVME_DIR   node-local NVMe directory (default /local/scratch, Polaris's NVMe); tier 0
#   CONFIG     YAML config (default experiments/configs/7b-node.yaml)
#   PRETRAIN_ARGS  extra pretrain.py arguments, space-separated
#   DATA, PFS_CONCURRENCY, PFS_NODE_CONCURRENCY, PYTHON, KEEP_NVME: see rank.sh
#   COORDINATOR_PORT  port of the jax.distributed coordinator on the first node (default 12321)
# Site setup (uncomment and adapt): a Python >= 3.11 with CUDA 12 and a venv with
# `pip install -e '.[experiments]' 'jax[cuda12]'` at <repo>/.venv.
#   module use /soft/modulefiles; module load conda
# mpiexec below is Cray PALS / MPICH (--ppn); with Open MPI use `mpiexec -n N --npernode 1`.
# See rank.sh for what each process runs: data parallel over the nodes (jax.distributed),
# process 0 writes the metrics with the slowest process's step time.
#PBS -N jax_mlpo
#PBS -l select=2:ngpus=1
#PBS -l place=scatter
#PBS -l walltime=02:00:00
#PBS -j oe
set -euo pipefail
repo="${PBS_O_WORKDIR:-$(pwd)}"   # submit from the repository root
cd "$repo"
NPROCS="$(sort -u "${PBS_NODEFILE:?run under qsub}" | wc -l)"
first="$(head -n 1 "$PBS_NODEFILE")"
: "${PFS_DIR:?pass PFS_DIR with qsub -v PFS_DIR=/path/on/the/shared/file/system}"
read -r -a extra <<< "${PRETRAIN_ARGS:-}"
# mpiexec does not forward the environment the same way everywhere: pass it explicitly.
vars=(
  NPROCS="$NPROCS"
  COORDINATOR="$first:${COORDINATOR_PORT:-12321}"
  RUN_NAME="${RUN_NAME:-pbs-${PBS_JOBID%%.*}}"
  NVME_DIR="${NVME_DIR:-/local/scratch}"
  PFS_DIR="$PFS_DIR"
  CONFIG="${CONFIG:-experiments/configs/7b-node.yaml}"
  DATA="${DATA:-}"
  PFS_CONCURRENCY="${PFS_CONCURRENCY:-1}"
  PFS_NODE_CONCURRENCY="${PFS_NODE_CONCURRENCY-1}"
  KEEP_NVME="${KEEP_NVME:-0}"
  PYTHON="${PYTHON:-$repo/.venv/bin/python}"
)

# The memory plan per process (nothing allocated) before the nodes start.
env RANK=0 "${vars[@]}" "$repo/experiments/launch/rank.sh" --dry-run --processes "$NPROCS" \
  "${extra[@]}"
# The rank comes from the launcher: PALS_RANKID (Cray PALS), PMI_RANK (MPICH),
# OMPI_COMM_WORLD_RANK (Open MPI).
mpiexec -n "$NPROCS" --ppn 1 env "${vars[@]}" bash -c \
  'RANK="${PALS_RANKID:-${PMI_RANK:-${OMPI_COMM_WORLD_RANK:?no MPI rank in the environment}}}" exec "$0" "$@"' \
  "$repo/experiments/launch/rank.sh" "${extra[@]}"
