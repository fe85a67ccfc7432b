"""Data-parallel training over several processes (``jax.distributed``), ZeRO-style.

Params and gradients are sharded over a 1-D mesh axis ``"data"`` holding one device per
process: a leaf whose first dimension divides by the number of processes is split along it,
any other leaf is replicated. Each process owns the AdamW state of its own shards (and a copy of
the state of the replicated leaves), in a host engine of its own whose file tiers live in
per-process subdirectories ``<tier>/proc<k>``. ``jax_mlpo.adamw`` switches to this mode by
itself when ``jax.process_count() > 1``: its ``init`` builds the engine from the local shard
shapes, and its ``update`` runs the host update inside ``jax.shard_map`` over the mesh, so each
process's callbacks see only its own shards. Everything before the update (the loss, the
gradients, ``optax.clip_by_global_norm``'s global norm) is ordinary jitted code on global
arrays, reduced across processes by XLA. Each engine measures its own update
(``engine_of(state).metrics``); a job gathers them (the pre-training job's
``experiments/job/metrics.py``), the slowest process setting the step time. Tiers with
``node_max_concurrency`` share their permits among the processes of a node (keyed by the
tier's configured path, see :func:`process_config`).

Example (one process per host, or per accelerator)::

    jax.distributed.initialize(coordinator_address=..., num_processes=n, process_id=k)
    mesh = jax_mlpo.sharding.processes.data_parallel_mesh()
    params = jax_mlpo.sharding.processes.shard_params(params, mesh)   # identical params everywhere
    tx = optax.chain(optax.clip_by_global_norm(1.0), jax_mlpo.adamw(3e-4, offload=config))
    opt_state = tx.init(params)                                # each process: its shards only
    batch = jax.make_array_from_process_local_data(
        jax_mlpo.sharding.processes.batch_sharding(mesh), local_batch)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlpo.config import OffloadConfig

AXIS = "data"


def is_multiprocess() -> bool:
    """Whether this is a multi-process run (``jax.distributed`` initialised with n > 1)."""
    return jax.process_count() > 1


def data_parallel_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis ``"data"`` over ``devices`` (default: every device, in order).

    Raises:
      ValueError: if a process holds more or fewer than one of the devices (jax_mlpo runs one
        host engine per process, so it needs one device per process).
    """
    devices = list(jax.devices() if devices is None else devices)
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    if len(devices) > 1 and set(per_process.values()) != {1}:
        raise ValueError(
            f"jax_mlpo data parallelism needs exactly one device per process, got {per_process} "
            "devices per process: start one process per accelerator (or set "
            "JAX_NUM_CPU_DEVICES=1 on CPU)"
        )
    return Mesh(np.array(devices), (AXIS,))


def leaf_spec(shape: Sequence[int], num_shards: int) -> P:
    """The partition of one leaf: split along its first dimension when it divides evenly."""
    if len(shape) >= 1 and shape[0] > 0 and shape[0] % num_shards == 0 and num_shards > 1:
        return P(AXIS)
    return P()


def local_shape(shape: Sequence[int], num_shards: int) -> tuple[int, ...]:
    """The shape of one process's shard of a leaf of ``shape`` (see :func:`leaf_spec`)."""
    shape = tuple(int(d) for d in shape)
    if leaf_spec(shape, num_shards) == P():
        return shape
    return (shape[0] // num_shards, *shape[1:])


def param_shardings(params: Any, mesh: Mesh | None = None) -> Any:
    """The ``NamedSharding`` of every leaf of ``params`` (a pytree of arrays or shapes)."""
    mesh = data_parallel_mesh() if mesh is None else mesh
    n = mesh.shape[AXIS]
    return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(np.shape(x), n)), params)


def shard_params(params: Any, mesh: Mesh | None = None) -> Any:
    """Global arrays of ``params`` (the same host values in every process), sharded ZeRO-style.

    Each process keeps only its shard of every split leaf.
    """
    mesh = data_parallel_mesh() if mesh is None else mesh
    return place(params, param_shardings(params, mesh))


def place(tree: Any, shardings: Any) -> Any:
    """Global arrays of ``tree``'s values (the same host values in every process) with
    ``shardings`` (a tree of the same structure): each process keeps its devices' shards."""

    def put(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, tree, shardings)


def batch_sharding(mesh: Mesh | None = None) -> NamedSharding:
    """The sharding of a batch split along its first dimension over the processes."""
    return NamedSharding(data_parallel_mesh() if mesh is None else mesh, P(AXIS))


def process_config(offload: OffloadConfig, process_index: int) -> OffloadConfig:
    """``offload`` with every tier moved to its per-process ``<tier>/proc<k>`` (or prefix).

    The subdirectories are created (and probed) here, so every process has tier locks of its
    own. Node-level permits (``node_max_concurrency``) stay keyed by the tier's own path
    (``permits_key``), so the processes of one node share them.
    """
    tiers = tuple(t.for_process(process_index) for t in offload.tiers)
    config = dataclasses.replace(offload, tiers=tiers)
    config.validate()
    return config


def local_params(params: Any, num_shards: int) -> Any:
    """``jax.ShapeDtypeStruct``s of one process's shards of ``params``."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(local_shape(np.shape(x), num_shards), x.dtype), params
    )


def global_handle(handle: int, mesh: Mesh) -> jax.Array:
    """An ``int32[processes]`` array, sharded over the mesh, holding each process's handle."""
    return jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(AXIS)), np.array([handle], np.int32)
    )


def replicated(value: Any, mesh: Mesh) -> jax.Array:
    """A global array holding the same ``value`` in every process."""
    value = np.asarray(value)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), value)


def sharded_update(
    host_update: Callable[..., tuple[jax.Array, list[jax.Array]]],
    grads: Sequence[jax.Array],
    params: Sequence[jax.Array],
    handle: jax.Array,
    *replicated_args: jax.Array,
    mesh: Mesh | None = None,
    specs: Sequence[P] | None = None,
) -> tuple[jax.Array, list[jax.Array]]:
    """Runs ``host_update(grads, params, handle, *replicated_args)`` on each device's shards.

    Traced inside the optimizer's jitted update: ``grads`` and ``params`` are the flat leaves
    (global), ``handle`` the handles, one element per device of the mesh. Returns the next step
    count (replicated: every device computes the same) and the update leaves (global, with the
    params' partition).

    Args:
      host_update, grads, params, handle, replicated_args: as above.
      mesh: the params' mesh (default: :func:`data_parallel_mesh`).
      specs: each leaf's partition (default: :func:`leaf_spec`'s over ``mesh``).
    """
    mesh = data_parallel_mesh() if mesh is None else mesh
    if specs is None:
        specs = [leaf_spec(np.shape(p), mesh.shape[AXIS]) for p in params]
    specs = list(specs)

    def body(grads, params, handle, *rest):
        return host_update(list(grads), list(params), handle.reshape(()), *rest)

    # a state made under jit has its handle and count as out_shardings placed them (a TrainState's
    # are often replicated): with Explicit axes, shard_map takes only args typed as its in_specs
    handle = _typed_as(handle, mesh, P(*mesh.axis_names))
    replicated_args = tuple(_typed_as(x, mesh, P()) for x in replicated_args)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, specs, P(*mesh.axis_names), *([P()] * len(replicated_args))),
        out_specs=(P(), specs),
        check_vma=False,  # an FFI call; replicated leaves and the counts give equal results
    )(list(grads), list(params), handle, *replicated_args)


def _typed_as(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """``x`` resharded to ``spec`` where its type carries another sharding (Explicit axes)."""
    typed = jax.typeof(x).sharding
    typed_mesh = getattr(typed, "mesh", None)
    if typed_mesh is None or typed_mesh.empty or AxisType.Explicit not in typed_mesh.axis_types:
        return x
    wanted = NamedSharding(mesh, spec)
    if NamedSharding(mesh, typed.spec).is_equivalent_to(wanted, x.ndim):
        return x
    return jax.sharding.reshard(x, wanted)
