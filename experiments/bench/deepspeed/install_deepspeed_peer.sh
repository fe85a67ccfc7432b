#!/usr/bin/env bash
# Install DeepSpeed (CPU accelerator) into a separate venv, .peer-venv, as the benchmark peer of
# jax_mlpo. Idempotent: re-running skips what is already there. Takes ~4 min and ~1.2 GB for the
# packages, then JIT-builds DeepSpeed's async_io, cpu_adam and shm comm ops into .torch_ext/
# (~3 min on an idle 2-core machine, 18 min on a loaded one) so that no benchmark run includes a
# build; re-running when everything is there takes ~15 s.
#
#   bash experiments/bench/deepspeed/install_deepspeed_peer.sh
#
# docs/deepspeed.md says what it installs and why. torch==2.13.0 because a CPU wheel of exactly
# that version lies in the pip find-links directory; any other version pulls a multi-GB CUDA build.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
VENV="$ROOT/.peer-venv"
export DS_ACCELERATOR=cpu DS_BUILD_OPS=0
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.torch_ext}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

# libaio for DeepSpeed's async_io op (O_DIRECT reads and writes through io_submit).
# fio for the raw disk bandwidth deepspeed_peer.py measures beside the systems.
if ! dpkg -s libaio-dev >/dev/null 2>&1 || ! command -v fio >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y libaio-dev fio
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"

if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
    2>/dev/null; then
  "$PY" -m pip install "torch==$TORCH_VERSION"
fi
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  # --no-deps: deepspeed's requirements would not change torch, but keep pip from resolving it.
  "$PY" -m pip install deepspeed --no-deps
  "$PY" -m pip install einops hjson msgpack ninja numpy 'packaging>=20.0' psutil py-cpuinfo \
    'pydantic>=2.0.0' tqdm
fi

# JIT-build (or load, if already built) the ops the benchmark uses.
"$PY" - <<'EOF'
import time

t0 = time.perf_counter()
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder  # noqa: E402

AsyncIOBuilder().load()
CPUAdamBuilder().load()
import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

# deepspeed.init_distributed on the CPU accelerator JIT-builds its shared-memory comm op
get_accelerator().create_op_builder("ShareMemCommBuilder").load()
import torch  # noqa: E402

print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}: async_io, cpu_adam, "
      f"shm_comm ready in {time.perf_counter() - t0:.0f} s")
EOF
