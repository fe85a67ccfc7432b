"""Benchmarks, grouped by audience; run them as modules from the repository root.

* :mod:`experiments.bench.mlpo`: jax_mlpo's own parts (kernels, tiers, the update phase,
  retention, node-level permits, the model's matmuls).
* :mod:`experiments.bench.deepspeed`: jax_mlpo beside DeepSpeed ZeRO-Infinity (the peer).
* :mod:`experiments.bench.gpu`: checks of the CUDA copy handlers on a GPU machine.

Shared by all: :mod:`~experiments.bench.harness` (interleaved rounds, medians with min-max, JSON
results) and :mod:`~experiments.bench.sysio` (page cache, I/O counters, fio). Both use the
standard library only, as this package's ``__init__`` does: the DeepSpeed peer's workers import
them in a venv without jax.
"""
