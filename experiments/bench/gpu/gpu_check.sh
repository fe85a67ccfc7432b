#!/usr/bin/env bash
# GPU check of jax_mlpo's native extension, for a GPU machine without network access that has
# python (with jax[cuda], numpy), cmake, a C++17 compiler and nvcc.
#   1. builds the extension from source with the CUDA copy handlers on
#      (pip install --no-build-isolation --no-deps -e . with CMAKE_ARGS; if pip cannot build,
#      e.g. scikit-build-core is missing, configures and builds with cmake directly and copies
#      the modules into jax_mlpo/);
#   2. runs tests/test_native.py and tests/test_staged_groups.py (best effort: they need pytest,
#      optax, flax and jax_mlpo's deps; the latter's GPU test runs the overlapped step through
#      the grouped CUDA handlers against the plain step, bit for bit);
#   3. runs experiments/bench/gpu/gpu_check.py: FFI D2H/H2D against raw cudaMemcpyAsync, exactness,
#      no recompilation for a new host buffer, a jitted step through the FFI copies == CPU path,
#      and the plain step against the overlapped one on a small model (medians, their ratio).
# Everything goes to experiments/results/gpu_check.txt. Exit status: that of gpu_check.py.
#
# Usage, from anywhere:  bash experiments/bench/gpu/gpu_check.sh   (PYTHON=... to pick the python)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.." || exit 2
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT=experiments/results/gpu_check.txt
mkdir -p experiments/results
exec > >(tee "$OUT") 2>&1

section() { printf '\n==== %s (%s)\n' "$1" "$(date +%T)"; }

section environment
date -u; uname -srm
"$PY" -c 'import sys; print(sys.version)'
"$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())' \
  || echo "WARNING: jax does not import"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "WARNING: nvcc not on PATH"
cmake --version | head -n 1 || echo "WARNING: no cmake"
"$PY" -m pip --version 2>/dev/null || echo "no pip"

section "build (CUDA on)"
# Let CMake find nvcc even when only /usr/local/cuda/bin has it.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export CMAKE_ARGS="-DJAX_MLPO_ENABLE_CUDA=ON ${CMAKE_ARGS:-}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
built=""
if "$PY" -m pip install --no-build-isolation --no-deps -v -e . >/tmp/jax_mlpo_pip_build.log 2>&1; then
  built=pip
  grep -E "jax_mlpo:|CUDA" /tmp/jax_mlpo_pip_build.log | head -n 20
else
  echo "pip build failed (last lines below); building with cmake directly"
  tail -n 40 /tmp/jax_mlpo_pip_build.log
  BUILD_DIR=build/gpu_check
  if cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DJAX_MLPO_ENABLE_CUDA=ON \
       -DPython_EXECUTABLE="$PY" && cmake --build "$BUILD_DIR"; then
    cp -v "$BUILD_DIR"/_native*.so jax_mlpo/ && built=cmake
  fi
fi
if [ -z "$built" ]; then
  echo "FAIL: the extension did not build"
  exit 1
fi
echo "built with $built"
"$PY" - <<'PYEOF'
import importlib.util  # python - puts the working directory (the repo root) on the path
for name in ("jax_mlpo._native", "jax_mlpo._native_cuda"):
    try:
        spec = importlib.util.find_spec(name)
    except ImportError as e:  # the package's own imports may fail; gpu_check.py copes
        spec = None
        print(name, "-> find_spec failed:", e)
    print(name, "->", spec.origin if spec else None)
PYEOF

section "tests/test_native.py, tests/test_staged_groups.py (best effort)"
if "$PY" -c 'import pytest, optax, flax' 2>/dev/null; then
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_native.py \
    tests/test_staged_groups.py 2>&1 | tail -n 30
else
  echo "skipped: pytest, optax or flax missing"
fi

section "gpu_check.py"
timeout 240 "$PY" -m experiments.bench.gpu.gpu_check "$@"
rc=$?
section "done: gpu_check.py exit status $rc"
exit $rc
