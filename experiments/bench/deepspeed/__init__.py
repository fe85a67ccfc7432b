"""jax_mlpo beside DeepSpeed ZeRO-Infinity, the peer (docs/deepspeed.md).

Drivers, run in jax_mlpo's venv as modules from the repository root:

* ``deepspeed_peer``: the update phase against DeepSpeed's NVMe optimizer swappers.
* ``deepspeed_e2e``: one training iteration against ``deepspeed.initialize`` ZeRO-3.
* ``plot_deepspeed``: the figure of both, from their JSON results.

Workers, run by the drivers as scripts in the peer's venv (``.peer-venv``, installed by
``install_deepspeed_peer.sh``; torch and DeepSpeed, no jax): ``ds_update.py`` and ``ds_gpt.py``.
:mod:`~experiments.bench.deepspeed.peer` says where that venv is and how a worker is started.

    .venv/bin/python -m experiments.bench.deepspeed.deepspeed_peer --help
"""
