"""Which shards of the params this process's engine holds, for every way params are placed.

One :class:`ShardPlan` serves the three placements an optimizer meets, so ``init`` and
``update`` each have one path:

- **one device** (the params in this process, on one device): the engine holds every leaf;
- **several processes, data parallel** (:mod:`jax_mlpo.sharding.processes`): each process's
  engine holds its shards of the leaves split along their first dimension, in per-process tier
  directories, and the update runs once per process inside ``shard_map``;
- **a mesh** (:mod:`jax_mlpo.sharding.mesh`, any mesh of this process's devices, several
  processes included): the engine holds the distinct shards of its devices, and each device's
  call meets the others' before the engine runs.

:func:`shard_plan` chooses at init from the params' shardings; :meth:`ShardPlan.key` is what a
traced update sees of the state (the handle's and the leaves' shapes), by which an update finds
the plan again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

from jax_mlpo.config import OffloadConfig
from jax_mlpo.sharding import processes
from jax_mlpo.sharding.mesh import MeshPlan, mesh_plan
from jax_mlpo.sharding.norm import global_norm

NO_GPU_MESH = (
    "jax_mlpo takes params on a mesh of several devices per process on CPU only for now: on "
    "GPUs start one process per GPU (jax.distributed; experiments/launch/single_node.sh with "
    "NPROCS=<GPUs>), each with its shards"
)

# host_update(grads, params, handle, count, scalars) -> (count, updates): one device's call
HostUpdate = Callable[..., tuple[jax.Array, list[jax.Array]]]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Where an offloaded state's shards are.

    Attributes:
      mesh: the mesh of the params' shards (a mesh placement), or None.
      processes: whether each process holds its own shards (several processes, data parallel
        or on a mesh): the tiers then get per-process directories.
    """

    mesh: MeshPlan | None = None
    processes: bool = False

    def engine_leaves(self, params: Any) -> Any:
        """What this process's engine lays out: the leaves, or its shards of them."""
        if self.mesh is not None:
            return self.mesh.shard_structs(params)
        if self.processes:
            return processes.local_params(params, jax.process_count())
        return params

    def engine_flags(self, flags: Sequence[bool]) -> list[bool]:
        """Per-leaf flags (weight decay) for :meth:`engine_leaves`."""
        return self.mesh.shard_flags(flags) if self.mesh is not None else list(flags)

    def engine_config(self, offload: OffloadConfig) -> OffloadConfig:
        """``offload`` with each tier in this process's own directory where processes share it."""
        if self.processes:
            return processes.process_config(offload, jax.process_index())
        return offload

    def arrays(self, handles: Sequence[int]) -> tuple[jax.Array, jax.Array]:
        """The state's ``(count, handle)`` at step 0, the handles of this process's engine (one
        per device of a mesh) in the shape and sharding an update expects."""
        if self.mesh is not None:
            return self.mesh.replicated(np.int32(0)), self.mesh.handle_array(handles)
        if self.processes:
            mesh = processes.data_parallel_mesh()
            (handle,) = handles
            return processes.replicated(np.int32(0), mesh), processes.global_handle(handle, mesh)
        (handle,) = handles
        return jnp.zeros([], jnp.int32), jnp.asarray(handle, jnp.int32)

    def key(self, params: Any) -> tuple[Any, ...]:
        """What a traced update sees of a state of this plan, to find the plan by."""
        return update_key(self._handle_shape(), jax.tree.leaves(params))

    def _handle_shape(self) -> tuple[int, ...]:
        if self.mesh is not None:
            return tuple(self.mesh.mesh.devices.shape)
        return (jax.process_count(),) if self.processes else ()

    def global_norm(self, grads: Sequence[jax.Array]) -> jax.Array:
        """The gradients' global norm, summed in the same order in every program
        (:func:`jax_mlpo.sharding.norm.global_norm`), over the shards where they are split."""
        if self.mesh is not None:
            return global_norm(grads, self.mesh.mesh, self.mesh.specs)
        if self.processes:
            mesh = processes.data_parallel_mesh()
            specs = [processes.leaf_spec(np.shape(g), mesh.shape[processes.AXIS]) for g in grads]
            return global_norm(grads, mesh, specs)
        return global_norm(grads)

    def grad_shardings(self, params: Sequence[Any]) -> list[NamedSharding | None]:
        """The sharding each leaf's gradient is read in by :meth:`update` (None: one device,
        read as it is). A gradient computed in that sharding is summed as the plain step's
        own backward pass sums it: XLA partitions a gradient's reduction by the sharding its
        consumer asks for, and another partition adds the same terms in another order."""
        if self.mesh is not None:
            return [NamedSharding(self.mesh.mesh, spec) for spec in self.mesh.specs]
        if self.processes:
            mesh = processes.data_parallel_mesh()
            n = mesh.shape[processes.AXIS]
            return [NamedSharding(mesh, processes.leaf_spec(np.shape(p), n)) for p in params]
        return [None] * len(params)

    def update(
        self, host_update: HostUpdate, grads: list[jax.Array], params: list[jax.Array],
        handle: jax.Array, count: jax.Array, scalars: jax.Array,
    ) -> tuple[jax.Array, list[jax.Array]]:  # fmt: skip
        """The update's calls: one, one per process, or one per device of the mesh."""
        if self.mesh is not None:
            return processes.sharded_update(
                host_update, grads, params, handle, count, scalars,
                mesh=self.mesh.mesh, specs=self.mesh.specs,
            )  # fmt: skip
        if self.processes:
            return processes.sharded_update(host_update, grads, params, handle, count, scalars)
        return host_update(grads, params, handle, count, scalars)


def update_key(handle_shape: Sequence[int], leaves: Sequence[Any]) -> tuple[Any, ...]:
    """An update's key: its state's handle shape and its leaves' shapes."""
    return (tuple(handle_shape), *(tuple(np.shape(p)) for p in leaves))


def shard_plan(params: Any, *, backend: str) -> ShardPlan:
    """The plan of concrete ``params`` at init.

    Raises:
      NotImplementedError: params on a mesh of several devices of one process off CPU.
      ValueError: leaves on different meshes, or not placed with a ``NamedSharding``.
    """
    multiprocess = processes.is_multiprocess()
    on_mesh = mesh_plan(params)
    if on_mesh is not None and multiprocess and on_mesh.is_data_parallel():
        on_mesh = None  # the data-parallel layout, which checkpoints can hold as such
    if on_mesh is not None and backend != "cpu":
        raise NotImplementedError(NO_GPU_MESH)
    return ShardPlan(mesh=on_mesh, processes=multiprocess)


def plan_of_update(
    handle: jax.Array, mesh: MeshPlan | None, params: Sequence[Any] = ()
) -> ShardPlan:
    """The plan of a traced update whose state has ``handle``: on ``mesh`` (found by the
    update's key), else by the handle's shape (one element per process, or a scalar).

    Raises:
      ValueError: ``params`` with Explicit mesh axes whose types name other shardings than the
        state was laid out by (its init saw them sharded otherwise).
    """
    if mesh is not None:
        check_explicit_shardings(mesh, params)
    # an update needs only where the calls go: the mesh's devices, or one call per process
    return ShardPlan(mesh=mesh, processes=mesh is None and bool(np.ndim(handle)))


def check_explicit_shardings(mesh: MeshPlan, params: Sequence[Any]) -> None:
    """Checks that the params' shardings in their types (Explicit mesh axes) are those the
    state's engine was laid out by: another layout would reshard the gradients into the
    engine's shards, and the updates out of them, at every step."""
    for k, leaf in enumerate(params):
        typed = jax.typeof(leaf).sharding
        typed_mesh = getattr(typed, "mesh", None)
        if typed_mesh is None or typed_mesh.empty or not all(
            t == AxisType.Explicit for t in typed_mesh.axis_types
        ) or typed_mesh.axis_names != mesh.mesh.axis_names:  # fmt: skip
            continue
        ndim = len(mesh.shapes[k])
        if not NamedSharding(mesh.mesh, typed.spec).is_equivalent_to(
            NamedSharding(mesh.mesh, mesh.specs[k]), ndim
        ):
            raise ValueError(
                f"param leaf {k} is sharded {typed.spec} in update, but the optimizer state "
                f"was laid out at init by params sharded {mesh.specs[k]}: init the optimizer on "
                "the params as they are trained. Under jax.jit (a TrainState made by a jitted "
                "function, an nnx.Optimizer under nnx.jit), the init sees the params as they "
                "are inside the function, not as out_shardings places them: shard them there "
                "before tx.init (jax.sharding.reshard, or jax.lax.with_sharding_constraint "
                "with Auto axes)"
            )
