#!/usr/bin/env bash
# One pretrain.py process of a job: node-local NVMe as tier 0, the shared parallel file system
# (PFS) as tier 1, outputs on the PFS. slurm.sbatch, pbs.sh and single_node.sh call it once per
# node; run it directly only to debug one rank.
#
# Environment (the callers set it):
#   RANK         this process's index, 0 .. NPROCS-1
#   NPROCS       number of processes (one per node)
#   COORDINATOR  host:port of process 0 (for jax.distributed)
#   NVME_DIR     node-local NVMe directory, e.g. /local/nvme/$USER (tier 0, must exist)
#   PFS_DIR      shared file-system directory, e.g. /lustre/proj/$USER (tier 1, run outputs)
#   RUN_NAME     run id; keeps runs apart on the shared paths (each tier is locked by its run)
#   CONFIG       YAML config (default experiments/configs/7b-node.yaml)
#   DATA         optional pre-tokenized file (raw uint16 or .npy) on the PFS; default: the
#                byte-level stdlib corpus
#   PFS_CONCURRENCY  requests in flight per process on the PFS tier (default 1: a shared file
#                system is served best by a few large sequential requests per client)
#   PYTHON       interpreter with jax_mlpo installed (default <repo>/.venv/bin/python)
#   KEEP_NVME    set to 1 to keep the NVMe tier after the run (default: removed)
# Arguments are passed on to pretrain.py (e.g. --set steps=100, --dry-run --processes 64).
#
# Multi-process: pretrain.py does not call jax.distributed.initialize yet. JAX_COORDINATOR_ADDRESS,
# JAX_NUM_PROCESSES and JAX_PROCESS_ID are exported for when it does (JAX reads only the first
# itself; pass the other two to jax.distributed.initialize). Until then each node trains its own
# replica with its own tiers: a measure of the shared file system under NPROCS concurrent
# writers, not a faster training run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${RANK:?set RANK}" "${NPROCS:?set NPROCS}" "${NVME_DIR:?set NVME_DIR}" "${PFS_DIR:?set PFS_DIR}"
: "${RUN_NAME:?set RUN_NAME}"
CONFIG="${CONFIG:-experiments/configs/7b-node.yaml}"
PYTHON="${PYTHON:-$repo/.venv/bin/python}"
export JAX_COORDINATOR_ADDRESS="${COORDINATOR:-localhost:12321}"
export JAX_NUM_PROCESSES="$NPROCS" JAX_PROCESS_ID="$RANK"

nvme="$NVME_DIR/jax_mlpo/$RUN_NAME/rank$RANK"
pfs="$PFS_DIR/jax_mlpo/$RUN_NAME/rank$RANK"
args=(
  --config "$CONFIG"
  --set "run_dir=$pfs"
  --set "offload.tiers=[{path: '$nvme/tier'}, {path: '$pfs/tier', max_concurrency: ${PFS_CONCURRENCY:-1}}]"
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
"$PYTHON" experiments/pretrain.py "${args[@]}" "$@" || status=$?
[[ "${KEEP_NVME:-0}" == 1 ]] || rm -rf "$nvme"
exit "$status"
