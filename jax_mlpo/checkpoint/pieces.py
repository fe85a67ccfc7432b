"""Which pieces of a saved checkpoint fill a subgroup segment, and where each element goes.

A segment of a restoring engine is a range of its region (a block of a parameter leaf, or the
whole leaf); a saved array is a range of its own region, written in chunks. Where both regions
are the same block, the pieces are ranges of one flattening. Otherwise both sides are cut into
blocks contiguous in their flattenings (:func:`~jax_mlpo.checkpoint.blocks.flat_blocks`) and
intersected, each intersection one strided copy. Row-major order is kept within a block, so
the chunks a segment needs are a run, found by bisection: the others are not read.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from jax_mlpo.checkpoint.blocks import (
    Index,
    Region,
    flat_blocks,
    intersection,
    relative,
    shifted,
)

# One copy from a saved chunk into a subgroup: (quantity, record, chunk k, into, from), where
# into and from are (offset, block shape, selection): the elements ``selection`` of the block
# of ``block shape`` that starts at ``offset`` in the quantity's part of the subgroup (into),
# or in the chunk (from).
Copy = tuple[int, tuple[int, ...], tuple[slice, ...]]
Piece = tuple[str, dict[str, Any], int, Copy, Copy]


def segment_pieces(
    name: str, record: dict[str, Any], saved: Region, region: Region, shape: tuple[int, ...],
    start: int, size: int, at: int,
) -> list[Piece]:  # fmt: skip
    """The copies from one saved array into a segment.

    Args:
      name: the quantity (``mu``, ``nu``, ``master``).
      record: the saved array's record (``chunk``: its piece length).
      saved: the saved array's region.
      region: the segment's engine leaf's region; ``shape`` its parameter leaf's shape.
      start: the segment's first element in its region's block flattening; ``size`` its length.
      at: where the segment starts in its subgroup.

    Returns:
      Every copy with at least one element.
    """
    if saved.box == region.box:
        return _flat_pieces(name, record, saved, start, size, at)
    return _block_pieces(name, record, saved, region, shape, start, size, at)


def _extent(index: Index) -> tuple[int, ...]:
    return tuple(b - a for a, b in index)


def _global_flat(shape: tuple[int, ...], index: Index, *, first: bool) -> int:
    """The row-major position in the leaf of ``index``'s first (or last) element."""
    corner = [a if first else b - 1 for a, b in index]
    return int(np.ravel_multi_index(corner, shape)) if shape else 0


def _flat_pieces(
    name: str, record: dict[str, Any], saved: Region, start: int, size: int, at: int
) -> list[Piece]:
    """Copies from a saved shard of the same block: ranges of one flattening."""
    stop = start + size
    a, b = max(start, saved.start), min(stop, saved.start + saved.size)
    chunk, pieces = record["chunk"], []
    for k in range((a - saved.start) // chunk, (b - 1 - saved.start) // chunk + 1) if a < b else ():
        lo = max(a, saved.start + k * chunk)
        hi = min(b, saved.start + (k + 1) * chunk)
        whole = (slice(None),)
        pieces.append((name, record, k, (at + lo - start, (hi - lo,), whole),
                       (lo - saved.start - k * chunk, (hi - lo,), whole)))  # fmt: skip
    return pieces


def _block_pieces(
    name: str, record: dict[str, Any], saved: Region, region: Region, shape: tuple[int, ...],
    start: int, size: int, at: int,
) -> list[Piece]:  # fmt: skip
    """Copies between shards cut into different blocks (a mesh's, another mesh's or flat
    ranges of the leaf): both sides as blocks, intersected."""
    wanted = [(o - start, shifted(b, region.box))
              for o, b in flat_blocks(_extent(region.box), start, start + size)]  # fmt: skip
    lo = _global_flat(shape, wanted[0][1], first=True)
    hi = _global_flat(shape, wanted[-1][1], first=False)
    chunk, pieces = record["chunk"], []
    count = -(-saved.size // chunk)

    def position(k: int, last: bool) -> int:  # chunk k's first (last) element in the leaf
        i = min(saved.start + k * chunk + (chunk - 1 if last else 0), saved.start + saved.size - 1)
        corner = np.unravel_index(i, _extent(saved.box))
        where = [c + a for c, (a, _) in zip(corner, saved.box, strict=True)]
        return int(np.ravel_multi_index(where, shape))

    # row-major order is kept within a block: the chunks in common with the segment are a run
    first = bisect.bisect_left(range(count), lo, key=lambda k: position(k, True))
    stop = bisect.bisect_right(range(count), hi, key=lambda k: position(k, False))
    for k in range(first, stop):
        begin = saved.start + k * chunk
        end = min(begin + chunk, saved.start + saved.size)
        have = [(o - begin, shifted(b, saved.box))
                for o, b in flat_blocks(_extent(saved.box), begin, end)]  # fmt: skip
        for into_at, into in wanted:
            for from_at, source in have:
                both = intersection(into, source)
                if both is not None:
                    pieces.append((
                        name, record, k,
                        (at + into_at, _extent(into), relative(into, both)),
                        (from_at, _extent(source), relative(source, both)),
                    ))  # fmt: skip
    return pieces
