#!/usr/bin/env bash
# One pretrain.py process of a job: node-local NVMe as tier 0, the shared parallel file system
# (PFS) as tier 1, outputs on the PFS. slurm.sbatch and pbs.sh call it once per node,
# single_node.sh once per local process; run it directly only to debug one rank.
#
# Environment (the callers set it):
#   RANK         this process's index, 0 .. NPROCS-1
#   NPROCS       number of processes of the job
#   COORDINATOR  host:port of process 0's jax.distributed coordinator (NPROCS > 1)
#   NVME_DIR     node-local NVMe directory, e.g. /local/nvme/$USER (tier 0, must exist)
#   PFS_DIR      shared file-system directory, e.g. /lustre/proj/$USER (tier 1, run outputs)
#   RUN_NAME     run id; keeps runs apart on the shared paths (each tier is locked by its run)
#   CONFIG       YAML config (default experiments/configs/7b-node.yaml)
#   DATA         optional pre-tokenized file (raw uint16 or .npy) on the PFS; default: the
#                byte-level stdlib corpus
#   PFS_CONCURRENCY  requests in flight per process on the PFS tier (default 1: a shared file
#                system is served best by a few large sequential requests per client)
#   PFS_NODE_CONCURRENCY  requests in flight per direction on the PFS tier across all
#                processes of a node (node-level permits, default 1; empty: no node limit)
#   LOCAL_DEVICE the accelerator this process uses (JAX_LOCAL_DEVICE_IDS), when a node runs
#                several processes; unset: every device the process sees
#   PYTHON       interpreter with jax_mlpo installed (default <repo>/.venv/bin/python)
#   KEEP_NVME    set to 1 to keep this process's NVMe tier after the run (default: removed)
# Arguments are passed on to pretrain.py (e.g. --set steps=100, --dry-run --processes 64).
#
# Every process runs the same config: the optimizer state is sharded over the processes and
# each one keeps its share in <tier>/proc<RANK> (jax_mlpo.sharding.processes); each process feeds
# batch_size rows of the global batch of batch_size x NPROCS rows; process 0 writes config,
# metrics, summary and plot to $PFS_DIR/jax_mlpo/$RUN_NAME/ with the slowest process's step time.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${RANK:?set RANK}" "${NPROCS:?set NPROCS}" "${NVME_DIR:?set NVME_DIR}" "${PFS_DIR:?set PFS_DIR}"
: "${RUN_NAME:?set RUN_NAME}"
CONFIG="${CONFIG:-experiments/configs/7b-node.yaml}"
PYTHON="${PYTHON:-$repo/.venv/bin/python}"
# pretrain.py reads these (jax.distributed.initialize)
export JAX_COORDINATOR_ADDRESS="${COORDINATOR:-localhost:12321}"
export JAX_NUM_PROCESSES="$NPROCS" JAX_PROCESS_ID="$RANK"
if [[ -n "${LOCAL_DEVICE:-}" ]]; then
  export JAX_LOCAL_DEVICE_IDS="$LOCAL_DEVICE"
fi

nvme="$NVME_DIR/jax_mlpo/$RUN_NAME"
pfs="$PFS_DIR/jax_mlpo/$RUN_NAME"
pfs_tier="{path: '$pfs/tier', max_concurrency: ${PFS_CONCURRENCY:-1}"
if [[ -n "${PFS_NODE_CONCURRENCY-1}" ]]; then
  pfs_tier+=", node_max_concurrency: ${PFS_NODE_CONCURRENCY-1}"
fi
args=(
  --config "$CONFIG"
  --set "run_dir=$pfs"
  --set "offload.tiers=[{path: '$nvme/tier'}, $pfs_tier}]"
  --set "data.cache_dir=$NVME_DIR/jax_mlpo/data-cache"
)
if [[ -n "${DATA:-}" ]]; then
  args+=(--set data.source=tokens --set "data.paths=['$DATA']")
fi
if [[ " $* " == *" --dry-run "* ]]; then  # allocates and creates nothing
  exec "$PYTHON" "$repo/experiments/pretrain.py" "${args[@]}" "$@"
fi
mkdir -p "$nvme" "$pfs"  # a tier's parent must exist; jax_mlpo creates and locks the tier itself
cd "$repo"
status=0
# In the background, so that a TERM (single_node.sh stopping the job) reaches pretrain.py too.
"$PYTHON" experiments/pretrain.py "${args[@]}" "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
wait "$child" || status=$?
if kill -0 "$child" 2>/dev/null; then  # the wait was cut short by a signal
  wait "$child" || status=$?
fi
trap - TERM INT
if [[ "${KEEP_NVME:-0}" != 1 ]]; then
  if [[ "$NPROCS" == 1 ]]; then
    rm -rf "$nvme/tier"
  else  # only this process's share: other processes of the node may still be closing theirs
    rm -rf "$nvme/tier/proc$RANK"
  fi
  rmdir "$nvme/tier" "$nvme" 2>/dev/null || true
fi
exit "$status"
