"""Blocks of an array: the index arithmetic of shards, and what a process read of a leaf.

A leaf saved by several processes is a set of shards, each a block of the global array; a
process restoring it reads some of those blocks (a union of whole saved shards, so that each
can be checked against its digest) and cuts the parts it needs out of them. An
:data:`Index` names a block by its ``[start, stop)`` range in each dimension; unlike jax's
tuples of slices it is hashable, comparable and JSON-friendly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mlpo.sharding import processes as distributed
from jax_mlpo.transforms.opt_state import OffloadedState
from jax_mlpo.transforms.runtime import engine_of, mesh_plan_of

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


def intersection(x: Index, y: Index) -> Index | None:
    """The block both ``x`` and ``y`` hold, or None when they share no element."""
    both = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y, strict=True))
    return both if all(a < b for a, b in both) else None


def shifted(index: Index, by: Index) -> Index:
    """``index`` moved by the starts of ``by`` (a block of a block, in the outer array)."""
    return tuple((a + s, b + s) for (a, b), (s, _) in zip(index, by, strict=True))


def flat_blocks(shape: tuple[int, ...], begin: int, end: int) -> list[tuple[int, Index]]:
    """The elements ``[begin, end)`` of an array of ``shape``, in row-major order, as blocks.

    Each block is contiguous in the flattening (rows of a partial first row, whole rows, a
    partial last row, recursively): at most ``2 * len(shape) - 1`` of them.

    Returns:
      ``(offset, block)`` pairs, ``offset`` the block's first element in the flattening.
    """
    if begin >= end:
        return []
    if len(shape) <= 1:
        return [(begin, ((begin, end),))] if shape else [(0, ())]
    inner = math.prod(shape[1:])
    first, last = begin // inner, (end - 1) // inner
    rest = full(shape[1:])

    def within(row: int, a: int, b: int) -> list[tuple[int, Index]]:
        return [(row * inner + o, ((row, row + 1), *blk))
                for o, blk in flat_blocks(shape[1:], a, b)]  # fmt: skip

    if first == last:
        return within(first, begin - first * inner, end - first * inner)
    out = []
    whole_from = first if begin % inner == 0 else first + 1
    if whole_from > first:
        out += within(first, begin - first * inner, inner)
    whole_to = end // inner  # rows [whole_from, whole_to) are whole
    if whole_to > whole_from:
        out.append((whole_from * inner, ((whole_from, whole_to), *rest)))
    if end % inner:
        out += within(whole_to, 0, end - whole_to * inner)
    return out


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
    (:mod:`jax_mlpo.sharding.processes`'s rows), and the leaves it does not write (replicated ones:
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


@dataclasses.dataclass(frozen=True)
class Region:
    """Where the elements of one engine leaf are in its parameter leaf.

    An engine leaf is a contiguous range of a block of the leaf, in the block's row-major
    order: the whole leaf (one device), a range of the flattened leaf (one device per process,
    :mod:`jax_mlpo.sharding.processes`), or a whole block split on any dimensions (params on a mesh,
    :mod:`jax_mlpo.sharding.mesh`). Streamed checkpoint arrays record theirs the same way.

    Attributes:
      leaf: the parameter leaf's index.
      box: the block.
      start: the range's first element in the block's flattening.
      size: its number of elements.
    """

    leaf: int
    box: Index
    start: int
    size: int

    def record(self) -> dict[str, Any]:
        """Its fields as a streamed array's record holds them."""
        return {"box": [list(r) for r in self.box], "start": self.start, "size": self.size}


def engine_regions(
    state: OffloadedState, shapes: list[tuple[int, ...]]
) -> tuple[list[Region], list[int]]:
    """Each of an offloaded state's engine leaves as a :class:`Region` of the parameter leaves,
    and the engine leaves this process does not write (a process of a lower index holds them
    too: each shard is written once).

    Args:
      state: the offloaded state.
      shapes: the parameter leaves' global shapes.
    """
    plan = mesh_plan_of(state)
    if plan is None:
        starts, skip = shard_starts(shapes)
        sizes = [math.prod(s) for s in engine_of(state).layout.shapes]
        return [Region(j, full(shapes[j]), starts[j], sizes[j]) for j in range(len(sizes))], skip
    me, regions, skip = jax.process_index(), [], []
    for j, shard in enumerate(plan.shards):
        shape = plan.shapes[shard.leaf]
        regions.append(Region(shard.leaf, shard.index, 0, volume(shard.index)))
        held = NamedSharding(plan.mesh, plan.specs[shard.leaf]).devices_indices_map(shape)
        if min(d.process_index for d, i in held.items() if index_of(i, shape) == shard.index) < me:
            skip.append(j)
    return regions, skip


def saved_region(record: dict[str, Any], leaf: int, shape: tuple[int, ...]) -> Region:
    """A streamed array's region (one without a ``box``, of format 3, is a flat range of the
    whole leaf)."""
    box = as_index(record["box"]) if "box" in record else full(shape)
    return Region(leaf, box, int(record["start"]), int(record["size"]))


def covers(shape: tuple[int, ...] | list[int], shards: list[dict[str, Any]]) -> bool:
    """Whether a streamed array's saved shards cover a leaf of ``shape`` exactly once: flat
    ranges of the whole leaf that tile it, or whole blocks that tile it."""
    regions = [saved_region(r, 0, tuple(shape)) for r in shards]
    whole = full(shape)
    if all(r.box == whole for r in regions):
        at = 0
        for r in sorted(regions, key=lambda r: r.start):
            if r.start != at or r.size < 0:
                return False
            at += r.size
        return at == volume(whole)
    if any(r.start != 0 or r.size != volume(r.box) for r in regions):
        return False
    return tiles(list(shape), [r.box for r in regions])


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
