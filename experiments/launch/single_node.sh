#!/usr/bin/env bash
# One node, one process (a workstation or an interactive allocation; GPU or CPU): the memory
# plan, then the run, with the state on the node-local NVMe and the shared file system.
#
#   NVME_DIR=/local/nvme/$USER PFS_DIR=/lustre/proj/$USER experiments/launch/single_node.sh \
#       [--set steps=100 ...]
#   CONFIG=experiments/configs/tiny.yaml NVME_DIR=/tmp PFS_DIR=$HOME/scratch \
#       experiments/launch/single_node.sh --set steps=20       # a CPU smoke test
#
# Environment: NVME_DIR, PFS_DIR (required), CONFIG, DATA, RUN_NAME, PYTHON, KEEP_NVME,
# PFS_CONCURRENCY: see rank.sh. On a GPU node, jax[cuda12] must be installed in the venv;
# XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) bounds the memory JAX preallocates.
# Outputs: $PFS_DIR/jax_mlpo/$RUN_NAME/rank0/ (config.yaml, metrics-offload.jsonl,
# summary-offload.md, pretrain-offload.png).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export RANK=0 NPROCS=1 COORDINATOR="${COORDINATOR:-localhost:12321}"
export RUN_NAME="${RUN_NAME:-single-$(date +%Y%m%d-%H%M%S)}"
"$here/rank.sh" --dry-run --processes 1 "$@"
exec "$here/rank.sh" "$@"
