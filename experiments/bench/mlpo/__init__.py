"""Micro-benchmarks of jax_mlpo's parts, each a module with a ``--help``.

* ``kernels``: the host AdamW kernel's bandwidth beside STREAM triad, memcpy, XLA and numpy.
* ``tiers``: file tier throughput against the disk's raw bandwidth (fio).
* ``update_phase``: the update phase, baseline against each MLP-Offload principle.
* ``dist_update``: node-level permits with several processes sharing two tiers.
* ``matmul``: the model's bfloat16 matmuls, XLA's dot against ``models.matmul``.

    .venv/bin/python -m experiments.bench.mlpo.update_phase --help
"""
