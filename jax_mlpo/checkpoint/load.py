"""Loading what a restore read into the target: arrays as the target's, states into engines.

Every leaf comes back as the kind of leaf the target has there (a device array on the target's
sharding, a numpy array, a scalar); each process places only its own shards of a global array.
An offloaded state's ``mu``, ``nu`` and ``master`` are streamed from their arrays into the
target's engine subgroup by subgroup (each process its shards, every chunk verified first),
which writes them into its host cache and tiers; the state returned is the target's, at the
saved step.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_mlpo.checkpoint.blocks import Read, index_of
from jax_mlpo.checkpoint.restore_plan import StreamPlan
from jax_mlpo.checkpoint.state_reader import StateReader
from jax_mlpo.checkpoint.tree import is_key, is_offloaded, path_name
from jax_mlpo.transforms.opt_state import count_of, with_count
from jax_mlpo.transforms.runtime import engine_of


def load(
    target: Any, plans: Any, reads: Any, streams: dict[str, StreamPlan], directory: Any
) -> Any:
    """Streams restored offloaded states into ``target``'s engines; leaves as ``target``'s.

    Args:
      target: the tree restored into (its offloaded states from a fresh ``tx.init``).
      plans: the restore plan's tree for it (``RestorePlan.leaves["tree"]``).
      reads: what this process read, as :class:`~jax_mlpo.checkpoint.blocks.Read` leaves, of the
        same structure.
      streams: the restore plan's :class:`StreamPlan` of each offloaded state, by name.
      directory: the item's directory (where the streamed arrays are).

    Returns:
      The restored tree, of ``target``'s structure.

    Raises:
      CorruptCheckpointError: a streamed chunk does not match its digest (the target's engine
        is then failed: its state is partly replaced).
    """

    def restore(path: tuple[Any, ...], t: Any, p: Any, r: Any) -> Any:
        if is_offloaded(t):
            count = int(r["count"].whole())
            engine = engine_of(t)
            if not engine.layout.num_params:  # an empty group's engine: its count alone
                engine.load(count, lambda sg, blob: None)
                return with_count(t, like(count_of(t), r["count"]))
            plan = streams[path_name(("tree", *path))]
            reader = StateReader(
                directory, plan.records, plan.shapes, plan.regions, engine.layout.subgroups
            )
            try:
                engine.load(count, reader.fill)
            finally:
                reader.close()
            return with_count(t, like(count_of(t), r["count"]))
        return like(t, r)

    return jax.tree_util.tree_map_with_path(restore, target, plans, reads, is_leaf=is_offloaded)


def like(target: Any, read: Read) -> Any:
    """``read`` as the kind of leaf ``target`` is (device array, numpy, scalar).

    Args:
      target: the target's leaf (an array, a ``jax.ShapeDtypeStruct``, a scalar...).
      read: what this process read of the saved leaf.

    Returns:
      A device array on ``target``'s sharding (default placement without one), a numpy scalar
      of ``target``'s type, or what orbax restored; typed PRNG keys come back as keys.
    """
    sharding = getattr(target, "sharding", None)
    if isinstance(target, jax.Array | jax.ShapeDtypeStruct) and sharding is not None:
        if sharding.is_fully_addressable:
            value = jax.device_put(read.whole(), sharding)
        else:  # each process places its shards, from the blocks it read
            value = jax.make_array_from_callback(
                read.shape, sharding, lambda idx: read.part(index_of(idx, read.shape))
            )
    elif isinstance(target, jax.Array | jax.ShapeDtypeStruct):
        value = jax.device_put(read.whole())
    elif isinstance(target, np.generic):
        return target.dtype.type(read.whole())
    else:
        return read.whole()
    if is_key(target):
        value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(target))
    return value
