"""Blocks of an array: the index arithmetic of shards, and what a process read of a leaf.

A leaf saved by several processes is a set of shards, each a block of the global array; a
process restoring it reads some of those blocks (a union of whole saved shards, so that each
can be checked against its sha256) and cuts the parts it needs out of them. An
:data:`Index` names a block by its ``[start, stop)`` range in each dimension; unlike jax's
tuples of slices it is hashable, comparable and JSON-friendly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_mlpo import distributed

Index = tuple[tuple[int, int], ...]  # a block of an array: [start, stop) per dimension


def full(shape: tuple[int, ...] | list[int]) -> Index:
    """The block covering a whole array of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def index_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A shard's index as jax gives it (a tuple of slices) as an :data:`Index`.

    Args:
      index: the slices, one per leading dimension (jax may leave out trailing ones).
      shape: the global array's shape.

    Returns:
      The block, with every dimension's range explicit.
    """
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def as_index(rows: list[list[int]]) -> Index:
    """An :data:`Index` from its JSON form (a list of ``[start, stop]`` pairs)."""
    return tuple((int(a), int(b)) for a, b in rows)


def contains(outer: Index, inner: Index) -> bool:
    """Whether the block ``inner`` lies within the block ``outer``."""
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner, strict=True))


def relative(outer: Index, inner: Index) -> tuple[slice, ...]:
    """The slices of ``inner`` in an array holding the block ``outer``."""
    return tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, inner, strict=True))


def volume(index: Index) -> int:
    """The number of elements in the block ``index``."""
    return math.prod(b - a for a, b in index)


def tiles(shape: list[int], indexes: list[Index]) -> bool:
    """Whether the blocks ``indexes`` cover an array of ``shape`` exactly once.

    Args:
      shape: the array's shape.
      indexes: the blocks, in any order.

    Returns:
      True if every block lies in the array, they do not overlap and together cover it.
    """
    whole = full(shape)
    if any(len(i) != len(whole) or not contains(whole, i) for i in indexes):
        return False
    if sum(map(volume, indexes)) != volume(whole):
        return False
    if len(indexes) <= 1:
        return True
    # The usual case, shards along the first dimension, is checked in n log n on sorted runs;
    # other blocks pairwise (with the volumes adding up, disjoint blocks cover the array).
    if all(i[1:] == whole[1:] for i in indexes):
        rows = sorted(i[0] for i in indexes if volume(i))
        return all(a[1] <= b[0] for a, b in zip(rows, rows[1:], strict=False))
    return not any(
        all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(x, y, strict=True))
        for k, x in enumerate(indexes)
        for y in indexes[k + 1 :]
    )


def shard_starts(shapes: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Where this process's shard of each offloaded leaf starts in the flattened global leaf
    (:mod:`jax_mlpo.distributed`'s rows), and the leaves it does not write (replicated ones:
    process 0 writes those)."""
    n, k = jax.process_count(), jax.process_index()
    starts, skip = [], []
    for leaf, shape in enumerate(shapes):
        if n == 1 or distributed.leaf_spec(shape, n) == P():
            starts.append(0)
            if k != 0:
                skip.append(leaf)
        else:
            starts.append(k * math.prod(distributed.local_shape(shape, n)))
    return starts, skip


def covers(size: int, shards: list[dict[str, Any]]) -> bool:
    """Whether the saved shards' ``[start, start + size)`` ranges tile ``[0, size)`` exactly."""
    at = 0
    for shard in sorted(shards, key=lambda r: r["start"]):
        if shard["start"] != at or shard["size"] < 0:
            return False
        at += shard["size"]
    return at == size


@dataclasses.dataclass(frozen=True)
class Read:
    """What this process read of one leaf: blocks of it, each made of whole saved shards.

    Attributes:
      shape: the leaf's global shape.
      blocks: the blocks read, each as its index and data.
      value: the value orbax returned, when the leaf was read whole (kept as orbax gave it, so
        that scalars and strings come back as they were saved).
    """

    shape: tuple[int, ...]
    blocks: list[tuple[Index, np.ndarray]]
    value: Any = None

    def part(self, index: Index) -> np.ndarray:
        """The block ``index`` of the leaf (a view of what was read).

        Raises:
          AssertionError: no block read contains ``index`` (the restore plan read too little).
        """
        for where, data in self.blocks:
            if contains(where, index):
                return data[relative(where, index)]
        raise AssertionError(f"block {index} of a leaf of shape {self.shape} was not read")

    def whole(self) -> Any:
        """The whole leaf: the value orbax returned, or the block covering all of it."""
        return self.value if self.value is not None else self.part(full(self.shape))


def as_read(value: Any) -> Read:
    """A leaf orbax restored: this process's blocks of a sharded array, or the whole value.

    Args:
      value: a leaf of the tree orbax restored.

    Returns:
      Its :class:`Read`; the blocks of a global array are its addressable shards, one per
      distinct index (replicas hold the same block).
    """
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        blocks = {index_of(s.index, value.shape): s.data for s in value.addressable_shards}
        return Read(tuple(value.shape), [(i, np.asarray(d)) for i, d in blocks.items()])
    a = np.asarray(value)
    return Read(a.shape, [(full(a.shape), a)], value)
