"""The snapshot: what a save takes from a training tree, synchronously, before writing it.

A save copies the tree to host memory at the moment it is called, so that the next update may
run (and donate or overwrite the device buffers, and rewrite the tiers) while orbax writes the
copy in the background. Every :class:`~jax_mlpo.OffloadedAdamWState` is replaced by its
engine's state in the *logical* layout, independent of subgroups, tiers, host cache and process
count:

- ``count``: the step count (the offloaded state is at exactly this step);
- ``mu`` and ``nu``: float32 arrays of each parameter leaf's (global) shape;
- ``master``: the fp32 master copy of each bfloat16 leaf (None for float32 leaves).

With several processes each engine holds only its shards; they become global arrays with the
params' ``data`` sharding, so that orbax writes each process's shards as it does for any sharded
``jax.Array``. The snapshot holds the (process's share of the) optimizer state in host memory
for the duration of the write: 12 bytes per parameter with bfloat16 params, 8 with float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlpo import distributed
from jax_mlpo.checkpoint.tree import is_key, is_offloaded, is_sharded, unwrap
from jax_mlpo.engine import EngineFailedError, StaleStateError
from jax_mlpo.transform import engine_of

if TYPE_CHECKING:
    from jax_mlpo.engine import Engine


def check_savable(tree: Any) -> None:
    """Raises unless every offloaded state in ``tree`` is the current one of a healthy engine.

    Waits for the updates in flight (their ordered host callbacks) first.

    Args:
      tree: a pytree that may hold offloaded AdamW states (e.g. an ``optax.chain`` state).

    Raises:
      EngineFailedError: an update failed midway; the offloaded state is partly updated.
      StaleStateError: a state is not the one its engine was last advanced to.
    """
    states = [s for s in jax.tree.leaves(tree, is_leaf=is_offloaded) if is_offloaded(s)]
    # Checked before the barrier too: the barrier re-raises a failed update less clearly.
    for _ in range(2):
        if any(engine_of(s).failed for s in states):
            raise EngineFailedError(
                "an update of this optimizer failed midway, so its offloaded state is partly "
                "updated and cannot be checkpointed. Restore from your last checkpoint (into a "
                "new tx.init) and continue from there."
            )
        jax.effects_barrier()
    for state in states:
        count, step = int(np.asarray(unwrap(state.count))), engine_of(state).step_count
        if count != step:
            raise StaleStateError(
                f"the optimizer state to save is at step {count}, but its offloaded state is "
                f"at step {step}: save the state returned by the last update"
            )


def snapshot(tree: Any, params: Any = None) -> Any:
    """``tree`` in host memory, offloaded states in the logical layout.

    Args:
      tree: the tree to save (params, opt_state, scalars).
      params: the params the offloaded states in ``tree`` were initialised with (arrays or
        ``jax.ShapeDtypeStruct``); in a multi-process run they give the global shapes of the
        leaves whose shards each engine holds.

    Returns:
      A copy the caller's later updates cannot change: each offloaded state a dict of
      ``count``, ``mu``, ``nu`` and ``master``, PRNG keys as their key data, other arrays as
      numpy arrays. In a multi-process run what this process holds of each sharded leaf stays
      a (sharded) global array, in host memory.

    Raises:
      EngineFailedError, StaleStateError: see :func:`check_savable`.
      ValueError: in a multi-process run, for an offloaded state without (its) params.
    """
    multiprocess = distributed.is_multiprocess()

    def convert(x: Any) -> Any:
        if is_offloaded(x):
            engine = engine_of(x)
            state = engine.state_dict()  # fresh arrays, from the cache and the tiers
            if multiprocess:
                state = _global_state(state, _global_shapes(engine, params))
            return {"count": np.array(unwrap(x.count), np.int32), **state}
        if is_key(x):
            x = jax.random.key_data(x)
        if is_sharded(x):
            return _host_copy(x)
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            return np.array(x)  # a copy: device buffers may be donated, numpy ones reused
        return x

    check_savable(tree)
    return jax.tree.map(convert, tree, is_leaf=is_offloaded)


def _global_shapes(engine: Engine, params: Any) -> list[tuple[int, ...]]:
    """The global shape of each leaf of a multi-process engine, which holds local shards only."""
    if params is None:
        raise ValueError(
            "in a multi-process run, an offloaded optimizer state is saved with its params "
            "(OffloadSave(opt_state, params=params); jax_mlpo.checkpoint.save does it): each "
            "process's engine holds only its shards, and the params give the global shapes"
        )
    shapes = [tuple(int(d) for d in np.shape(x)) for x in jax.tree.leaves(params)]
    local = tuple(distributed.local_shape(s, jax.process_count()) for s in shapes)
    if local != engine.layout.shapes:
        raise ValueError(
            f"the params saved with the optimizer state have leaves of shapes {shapes[:8]}, "
            f"whose shards {list(local[:8])} are not the optimizer's "
            f"{list(engine.layout.shapes[:8])}: pass the params it was initialised with"
        )
    return shapes


def _global_state(
    state: dict[str, list[np.ndarray | None]], shapes: list[tuple[int, ...]]
) -> dict[str, list[Any]]:
    """This process's ``state_dict`` (its shards) as global arrays sharded like the params.

    A leaf that is replicated over the processes stays a host array: every process holds the
    same state for it, and orbax writes host arrays once, from process 0.
    """
    mesh = distributed.data_parallel_mesh()
    n = mesh.shape[distributed.AXIS]

    def put(local: np.ndarray | None, shape: tuple[int, ...]) -> Any:
        spec = distributed.leaf_spec(shape, n)
        if local is None or spec == P():
            return local
        sharding = _in_host_memory(NamedSharding(mesh, spec))
        return jax.make_array_from_process_local_data(sharding, local, shape)

    return {
        name: [put(a, s) for a, s in zip(leaves, shapes, strict=True)]
        for name, leaves in state.items()
    }


def _in_host_memory(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """``sharding`` in the devices' pinned host memory, where they have one.

    A snapshot must not take accelerator memory (the offloaded state is off the accelerator
    because it does not fit there); orbax writes arrays in host memory as it writes any other.
    """
    device = next(iter(sharding.addressable_devices))
    if any(m.kind == "pinned_host" for m in device.addressable_memories()):
        return sharding.with_memory_kind("pinned_host")
    return sharding


def _host_copy(x: jax.Array) -> jax.Array:
    """A copy of this process's shards of ``x``, which the caller's later updates cannot change."""
    # The device buffers may be donated to the next update, so each shard is copied out.
    sharding = _in_host_memory(x.sharding)
    shards = []
    for shard in x.addressable_shards:
        where = jax.sharding.SingleDeviceSharding(shard.device, memory_kind=sharding.memory_kind)
        shards.append(jax.device_put(np.array(shard.data), where))
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
