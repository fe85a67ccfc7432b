"""Checks of jax_mlpo's CUDA copy handlers on a GPU machine: ``bash
experiments/bench/gpu/gpu_check.sh`` builds the extension with CUDA on and runs
``python -m experiments.bench.gpu.gpu_check``."""
