"""Loading what a restore read into the target: arrays as the target's, states into engines.

Every leaf comes back as the kind of leaf the target has there (a device array on the target's
sharding, a numpy array, a scalar); each process places only its own shards of a global array.
An offloaded state's ``mu``, ``nu`` and ``master`` go into the target's engine (each process its
shards), which writes them into its host cache and tiers; the state returned is the target's,
at the saved step.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_mlpo.checkpoint.blocks import Read, index_of
from jax_mlpo.checkpoint.restore_plan import LeafPlan
from jax_mlpo.checkpoint.tree import is_key, is_offloaded, unwrap
from jax_mlpo.transform import OffloadedAdamWState, engine_of


def load(target: Any, plans: Any, reads: Any) -> Any:
    """Loads restored offloaded states into ``target``'s engines; leaves as ``target``'s.

    Args:
      target: the tree restored into (its offloaded states from a fresh ``tx.init``).
      plans: the restore plan's tree for it (``RestorePlan.leaves["tree"]``).
      reads: what this process read, as :class:`~jax_mlpo.checkpoint.blocks.Read` leaves, of the
        same structure.

    Returns:
      The restored tree, of ``target``'s structure.
    """

    def restore(t: Any, p: Any, r: Any) -> Any:
        if is_offloaded(t):
            count = int(r["count"].whole())
            state = {
                name: [
                    _local(plan, read) if plan is not None else None  # fp32 leaves: no master
                    for plan, read in zip(p[name], r[name], strict=True)
                ]
                for name in ("mu", "nu", "master")
            }
            engine_of(t).load_state_dict(count, state)
            count = like(unwrap(t.count), r["count"])
            return OffloadedAdamWState(count=count, handle=t.handle)
        return like(t, r)

    return jax.tree.map(restore, target, plans, reads, is_leaf=is_offloaded)


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


def _local(plan: LeafPlan, read: Read) -> np.ndarray:
    """This process's shard of an offloaded state's leaf, as its engine holds it."""
    need = plan.need
    if need.sharding is None:
        return read.whole()
    indexes = need.sharding.addressable_devices_indices_map(need.shape).values()
    (index,) = {index_of(i, need.shape) for i in indexes}  # one device per process
    return read.part(index)
