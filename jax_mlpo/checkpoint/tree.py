"""How a checkpoint sees the leaves of a training tree.

A tree to checkpoint (params, an ``optax.chain`` state, a dict of scalars) holds three kinds of
leaves that orbax cannot save as they are: offloaded AdamW states, whose p, m and v live in
their engine rather than in the tree; typed PRNG keys, saved as their ``uint32`` key data; and,
in a multi-process run, global arrays of which this process holds only some shards. Leaves are
named by their path (``"tree/1/0/mu/3"``), which is the same for a tree and for orbax's dict
form of it, so that the manifest and the restore plan can name leaves across the two.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_mlpo.transforms.opt_state import is_offloaded, unwrap

__all__ = ["is_key", "is_offloaded", "is_sharded", "leaves", "path_name", "unwrap"]


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (optax.add_noise's state).

    Such keys are saved as their uint32 key data: orbax has no type handler for key dtypes.
    """
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_sharded(x: Any) -> bool:
    """Whether ``x`` is a global array of which this process holds only some shards."""
    return isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple[Any, ...]) -> str:
    """A leaf's name, ``"1/0/mu/3"``, from its jax key path.

    Args:
      path: the key path, as ``jax.tree_util.tree_flatten_with_path`` gives it.

    Returns:
      The keys' names (dict keys, attribute names, sequence indices) joined by ``/``.
    """
    return "/".join(_key_name(k) for k in path)


def leaves(tree: Any) -> dict[str, Any]:
    """The leaves of ``tree`` by :func:`path_name`, in jax's flattening order.

    Args:
      tree: a pytree (a tree to save, or the dict form orbax restores it in).

    Returns:
      A dict from each leaf's name to the leaf.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_name(path): leaf for path, leaf in flat}
