"""The snapshot: what a save takes from a training tree, synchronously, before writing it.

A save takes the small part of the tree at the moment it is called (params, scalars, PRNG
keys), so that the next update may run (and donate or overwrite the device buffers) while the
checkpoint is written: small arrays are copied for orbax to write in the background, large
host arrays (the params) are not, since they are written before the save returns
(:mod:`~jax_mlpo.checkpoint.host_arrays`). Every :class:`~jax_mlpo.OffloadedState` becomes its
``count`` in that tree, and its AdamW state an :class:`OffloadedStream`: an engine snapshot
(:mod:`jax_mlpo.engine.snapshot`), read from the host cache and the tiers subgroup by subgroup while
it is written (:mod:`~jax_mlpo.checkpoint.stream`), never held in host memory as a whole. Its arrays
are the *logical* layout, independent of
subgroups, tiers, host cache and process count: ``mu``, ``nu`` and (bfloat16 leaves) ``master``
of every parameter leaf, each process writing its shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jax_mlpo.checkpoint.blocks import Region, engine_regions
from jax_mlpo.checkpoint.host_arrays import writes_directly
from jax_mlpo.checkpoint.tree import is_key, is_offloaded, is_sharded, path_name
from jax_mlpo.engine.layout import Layout
from jax_mlpo.engine.snapshot import StateSnapshot
from jax_mlpo.errors import EngineFailedError, StaleStateError, wait_for_updates
from jax_mlpo.sharding import processes as distributed
from jax_mlpo.transforms.opt_state import OffloadedState, count_of
from jax_mlpo.transforms.runtime import engine_of, mesh_plan_of


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
        wait_for_updates()
    for state in states:
        engine = engine_of(state)
        count, step = int(np.asarray(count_of(state))), engine.step_count
        # an engine over no leaves (an empty group of jax_mlpo.muon) keeps no state to be stale
        if count != step and engine.layout.num_params:
            raise StaleStateError(
                f"the optimizer state to save is at step {count}, but its offloaded state is "
                f"at step {step}: save the state returned by the last update"
            )


@dataclasses.dataclass
class OffloadedStream:
    """An offloaded state's AdamW state, to stream into a checkpoint.

    Attributes:
      name: the state's leaf name in the host tree (``"tree/2"``).
      snapshot: its engine's snapshot at the state's step; the writer closes it.
      layout: its engine's layout.
      shapes: each parameter leaf's global shape.
      regions: where each engine leaf is in the parameter leaves.
      skip: engine leaves this process does not write (another process writes them).
    """

    name: str
    snapshot: StateSnapshot
    layout: Layout
    shapes: list[tuple[int, ...]]
    regions: list[Region]
    skip: list[int]

    @property
    def state_bytes(self) -> int:
        """Bytes this process writes of it."""
        return self.layout.state_bytes


def snapshot(
    tree: Any, params: Any = None, *, concurrent: bool = False
) -> tuple[Any, list[OffloadedStream]]:
    """``tree`` in host memory, offloaded states as their counts; their states as streams.

    Args:
      tree: the tree to save (params, opt_state, scalars).
      params: the params the offloaded states in ``tree`` were initialised with (arrays or
        ``jax.ShapeDtypeStruct``); in a multi-process run they give the global shapes of the
        leaves whose shards each engine holds.
      concurrent: whether updates may run while the streams are written (an async save).

    Returns:
      A copy the caller's later updates cannot change (each offloaded state a dict of its
      ``count``, PRNG keys as their key data, other arrays as numpy arrays; in a multi-process
      run what this process holds of each sharded leaf stays a sharded global array, in host
      memory), and the streams of the offloaded states, open: close them (write them with
      :func:`~jax_mlpo.checkpoint.stream.write_streams`) whatever happens.

    Raises:
      EngineFailedError, StaleStateError: see :func:`check_savable`.
      ValueError: in a multi-process run, for an offloaded state without (its) params.
    """
    check_savable(tree)
    streams: list[OffloadedStream] = []

    def convert(path: tuple[Any, ...], x: Any) -> Any:
        if is_offloaded(x):
            engine = engine_of(x)
            shapes = _global_shapes(x, params)
            regions, skip = engine_regions(x, shapes)
            name = path_name(("tree", *path))
            state = engine.snapshot(concurrent=concurrent)
            streams.append(OffloadedStream(name, state, engine.layout, shapes, regions, skip))
            return {"count": np.array(count_of(x), np.int32)}
        if is_key(x):
            x = jax.random.key_data(x)
        if is_sharded(x):
            return _host_copy(x)
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            # Large arrays (the params) are written before the save returns, without a copy;
            # small ones are copied where updates may run before orbax writes them (device
            # buffers may be donated, numpy ones reused).
            a = np.asarray(x)
            return np.array(a) if concurrent and not writes_directly(a) else a
        return x

    try:
        return jax.tree_util.tree_map_with_path(convert, tree, is_leaf=is_offloaded), streams
    except BaseException:
        for stream in streams:
            stream.snapshot.close()
        raise


def _global_shapes(state: OffloadedState, params: Any) -> list[tuple[int, ...]]:
    """The global shape of each leaf (a multi-process engine holds local shards only, and a
    mesh's engine the distinct shards of its devices)."""
    plan, engine = mesh_plan_of(state), engine_of(state)
    if plan is not None:
        return list(plan.shapes)
    if not distributed.is_multiprocess():
        return list(engine.layout.shapes)
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
