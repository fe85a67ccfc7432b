#!/usr/bin/env bash
# One node, NPROCS processes (default 1; a workstation or an interactive allocation; GPU or
# CPU): the memory plan, then the run, data parallel over the processes (jax.distributed), with
# the optimizer state on the node-local NVMe and the shared file system.
#
#   NVME_DIR=/local/nvme/$USER PFS_DIR=/lustre/proj/$USER experiments/launch/single_node.sh \
#       [--set steps=100 ...]
#   NPROCS=4 NVME_DIR=... PFS_DIR=... experiments/launch/single_node.sh   # 4 GPUs, 4 processes
#   NPROCS=2 CONFIG=experiments/configs/tiny.yaml NVME_DIR=/tmp PFS_DIR=$HOME/scratch \
#       experiments/launch/single_node.sh --set steps=20 --set batch_size=4   # a CPU smoke test
#
# Environment: NVME_DIR, PFS_DIR (required), NPROCS (processes on this node, default 1),
# COORDINATOR_PORT (default 12321), CONFIG, DATA, RUN_NAME, PYTHON, KEEP_NVME,
# PFS_CONCURRENCY, PFS_NODE_CONCURRENCY: see rank.sh. batch_size in the config is per process.
# With NPROCS > 1 and at least NPROCS GPUs, process k uses GPU k; on CPU each process uses the
# host (one CPU device each). On a GPU node, jax[cuda12] must be installed in the venv;
# XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) bounds the memory JAX preallocates.
# Outputs (process 0): $PFS_DIR/jax_mlpo/$RUN_NAME/ (config.yaml, metrics-offload.jsonl,
# summary-offload.md, pretrain-offload.png); logs of processes 1.. in rank<k>.log there.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export NPROCS="${NPROCS:-1}" COORDINATOR="${COORDINATOR:-localhost:${COORDINATOR_PORT:-12321}}"
export RUN_NAME="${RUN_NAME:-single-$(date +%Y%m%d-%H%M%S)}"
RANK=0 "$here/rank.sh" --dry-run --processes "$NPROCS" "$@"
if [[ "$NPROCS" == 1 ]]; then
  RANK=0 exec "$here/rank.sh" "$@"
fi

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi --list-gpus 2>/dev/null | wc -l)"
fi
logs="${PFS_DIR:?set PFS_DIR}/jax_mlpo/$RUN_NAME"
mkdir -p "$logs"
pids=()
for ((k = 0; k < NPROCS; k++)); do
  device=""
  if ((gpus >= NPROCS)); then device="$k"; fi
  if ((k == 0)); then
    RANK=$k LOCAL_DEVICE="$device" "$here/rank.sh" "$@" &
  else
    RANK=$k LOCAL_DEVICE="$device" "$here/rank.sh" "$@" >"$logs/rank$k.log" 2>&1 &
  fi
  pids+=("$!")
done
# The processes wait for each other in every step: when one fails, stop the others (by the ids
# started here) instead of letting them wait for jax.distributed's heartbeat timeout.
status=0
for ((left = NPROCS; left > 0; left--)); do
  if ! wait -n "${pids[@]}"; then
    status=1
    echo "single_node.sh: a process failed; stopping the others (logs: $logs/rank*.log)" >&2
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    break
  fi
done
exit "$status"
