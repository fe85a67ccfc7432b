"""The pre-training job's mesh over its devices: FSDP, and tensor parallel if asked.

With several devices in a process (``JAX_NUM_CPU_DEVICES=4``, a multi-GPU node; one process or
more) the job builds a mesh over every device of the job from the config's ``mesh`` section
(every device on the first axis by default) and shards the params by one rule: a leaf's first
dimension over the first axis (FSDP) and, on a second axis, a 2-D or larger leaf's last
dimension over it (tensor parallel), each only where the size divides; the rest is
replicated. The batch is split over the first axis. jax_mlpo takes the params as they are
sharded (:mod:`jax_mlpo.sharding.mesh`); a user's own rules work the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.job.run_config import ConfigError, MeshConfig
from jax_mlpo.sharding import processes as distributed


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device]) -> Mesh | None:
    """The mesh of ``config`` over ``devices`` (the job's); None for one device.

    Raises:
      ConfigError: when ``mesh.shape`` does not multiply to the number of devices.
    """
    devices = list(devices)
    if len(devices) == 1:
        return None
    shape = tuple(config.shape) or (len(devices), *([1] * (len(config.axes) - 1)))
    if math.prod(shape) != len(devices):
        raise ConfigError(
            f"config key 'mesh.shape' {list(shape)} holds {math.prod(shape)} devices, the job "
            f"has {len(devices)}: give sizes that multiply to {len(devices)}, or [] for every "
            "device on the first axis"
        )
    return Mesh(np.array(devices).reshape(shape), tuple(config.axes))


def leaf_spec(mesh: Mesh, shape: Sequence[int]) -> P:
    """The job's partition of a leaf of ``shape``: first dimension over the first axis, last
    dimension of a 2-D or larger leaf over the second, where the sizes divide."""
    names, sizes = mesh.axis_names, mesh.devices.shape
    spec: list[str | None] = [None] * len(shape)
    if shape and sizes[0] > 1 and shape[0] % sizes[0] == 0:
        spec[0] = names[0]
    if len(names) > 1 and len(shape) >= 2 and sizes[1] > 1 and shape[-1] % sizes[1] == 0:
        spec[-1] = names[1]
    return P(*spec)


def shard(tree: Any, mesh: Mesh) -> Any:
    """``tree``'s arrays (the same values in every process) placed on ``mesh`` by
    :func:`leaf_spec`; each process keeps its devices' shards."""
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(mesh, np.shape(x))), tree)
    return distributed.place(tree, shardings)


def batch_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """The batch's rows over the first axis (replicated when they do not divide)."""
    first = mesh.axis_names[0]
    return NamedSharding(mesh, P(first) if rows % mesh.shape[first] == 0 else P())
