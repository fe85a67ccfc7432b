"""The offloaded state read back from a checkpoint: saved pieces into an engine's subgroups.

The reading side of :mod:`~jax_mlpo.checkpoint.stream`: for each subgroup of the restoring
engine in order, the pieces that overlap its segments (in any saved shard) are read, each
checked against its digest before any of its bytes is used, and copied into the subgroup's
blob; the next subgroup's pieces are read meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_mlpo.checkpoint import digest
from jax_mlpo.checkpoint.blocks import Region, saved_region
from jax_mlpo.checkpoint.manifest import CorruptCheckpointError
from jax_mlpo.checkpoint.pieces import Piece, segment_pieces
from jax_mlpo.checkpoint.shard_file import ShardReader, check_array, whole_pages
from jax_mlpo.checkpoint.stream import CHUNK_ELEMS, quantities, split_quantities
from jax_mlpo.engine.layout import Subgroup, is_signed, store_f32
from jax_mlpo.engine.quantize import Quantized
from jax_mlpo.tiers.posix import aligned_empty
from jax_mlpo.types import F32

# Pieces read at once, and subgroups whose pieces are read ahead of the one being filled. Alone,
# this disk reads 2.4x faster with 1 GiB in flight than with 32 MiB (fio), but beside the
# restore's tier writes, 16 x 3 and 32 x 5 restored in 4.04-4.71 and 4.88-4.94 s against
# 4.16-4.25 s (the settings interleaved in one process).
READ_THREADS = 4
READ_AHEAD = 1


class StateReader:
    """Fills an engine's subgroups from the saved shards of one offloaded state, verified.

    The chunks a subgroup needs are read concurrently, and those of the next subgroup while the
    engine writes this one to its tier (host memory: about two subgroups' chunks). Saved and
    restoring shards may be cut differently (flat ranges, blocks of a mesh): each element is
    found in whichever saved shard holds it.

    Args:
      directory: the checkpoint item's directory.
      records: for each ``(quantity, leaf)``, the saved shards' records (every process's), as
        the manifest has them.
      shapes: the parameter leaves' global shapes.
      regions: where each leaf of the restoring engine is in the parameter leaves.
      subgroups: the restoring engine's subgroups, in the order they are filled.
    """

    def __init__(
        self, directory: str | os.PathLike, records: dict[tuple[str, int], list[dict[str, Any]]],
        shapes: list[tuple[int, ...]], regions: list[Region], subgroups: Sequence[Subgroup],
    ) -> None:  # fmt: skip
        self._directory = os.fspath(directory)
        self._saved = {
            (name, leaf): [(r, saved_region(r, leaf, shapes[leaf])) for r in v]
            for (name, leaf), v in records.items()
        }
        self._shapes, self._regions = shapes, regions
        self._subgroups = list(subgroups)
        self._position = {sg.index: k for k, sg in enumerate(self._subgroups)}
        self._files: dict[str, ShardReader] = {}  # each array's data file, checked and open
        self._opening = threading.Lock()  # the I/O threads open them
        # (array, piece) -> (its buffer, the read's future or the verified data)
        self._reads: dict[tuple[str, int], tuple[np.ndarray, Any]] = {}
        self._spare: list[np.ndarray] = []  # buffers of pieces no longer needed, reused
        self._scratch: dict[str, np.ndarray] = {}  # q8 moments' float32, before encoding
        self._planned: dict[int, list[Piece]] = {}  # the next subgroups' pieces, being read
        self._io = concurrent.futures.ThreadPoolExecutor(READ_THREADS, "jax_mlpo-ckpt-read")

    def fill(self, sg: Subgroup, blob: np.ndarray) -> None:
        """Fills ``blob`` with subgroup ``sg``'s saved state (an ``Engine.load`` callback).

        Raises:
          CorruptCheckpointError: a chunk does not match its digest, or an array is missing
            or not what the manifest says.
        """
        pieces = self._planned.pop(sg.index, None)
        if pieces is None:
            pieces = self._pieces(sg)
        self._issue(pieces)
        at = self._position[sg.index]
        for upcoming in self._subgroups[at + 1 : at + 1 + READ_AHEAD]:
            if upcoming.index not in self._planned:  # read while this one is copied and written
                self._planned[upcoming.index] = self._pieces(upcoming)
                self._issue(self._planned[upcoming.index])
        parts = split_quantities(sg, blob)
        # A q8 moment is filled in float32 first and encoded segment by segment (its blocks
        # start at segments): host memory of one subgroup's float32 per q8 moment, reused.
        coded = {k: x for k, x in parts.items() if isinstance(x, Quantized)}
        for name in coded:
            if self._scratch.get(name) is None or self._scratch[name].size < sg.size:
                self._scratch[name] = np.empty(sg.size, F32)
            parts[name] = self._scratch[name][: sg.size]
        for name, record, k, (at, shape, into), (src, src_shape, sel) in pieces:
            data = self._chunk(record, k)
            source = data[src : src + math.prod(src_shape)].reshape(src_shape)[sel]
            parts[name][at : at + math.prod(shape)].reshape(shape)[into] = source
        for name, moment in coded.items():
            for seg in sg.segments:
                store_f32(sg.segment(moment, seg), parts[name][seg.span], signed=is_signed(name))
        keep = {(p[1]["array"], p[2]) for later in self._planned.values() for p in later}
        for key in [key for key in self._reads if key not in keep]:
            buffer, _ = self._reads.pop(key)  # read and used: its buffer serves another
            if buffer.size == whole_pages(CHUNK_ELEMS):
                self._spare.append(buffer)

    def _pieces(self, sg: Subgroup) -> list[Piece]:
        """The copies that fill ``sg``, from the chunks of the saved shards that overlap it."""
        pieces: list[Piece] = []
        for seg in sg.segments:
            region = self._regions[seg.leaf]
            start = region.start + seg.leaf_start  # the segment in its region's block
            for name in quantities(sg):
                if name == "master" and not seg.master:
                    continue
                shape = self._shapes[region.leaf]
                for record, saved in self._saved[(name, region.leaf)]:
                    pieces += segment_pieces(name, record, saved, region, shape, start,
                                             seg.size, seg.start)  # fmt: skip
        return pieces

    def _issue(self, pieces: list[Piece]) -> None:
        for _, record, k, _, _ in pieces:
            key = (record["array"], k)
            if key not in self._reads:
                size = whole_pages(record["chunk"])
                spare = size == whole_pages(CHUNK_ELEMS) and self._spare
                buffer = self._spare.pop() if spare else aligned_empty(size)
                self._reads[key] = (buffer, self._io.submit(self._read, record, k, buffer))

    def _chunk(self, record: dict[str, Any], k: int) -> np.ndarray:
        """Piece ``k`` of ``record``'s array, verified."""
        key = (record["array"], k)
        buffer, got = self._reads[key]
        if not isinstance(got, np.ndarray):
            got = got.result()
            self._reads[key] = (buffer, got)
        return got

    def _read(self, record: dict[str, Any], k: int, buffer: np.ndarray) -> np.ndarray:
        """Reads piece ``k`` of ``record``'s array and checks it against its digest."""
        where = os.path.join(self._directory, record["array"])
        chunk = record["chunk"]
        count = min(chunk, record["size"] - k * chunk)
        file = self._check(record)  # on the I/O thread: ~30 ms per array (tensorstore's open)
        try:
            data = file.read(k * chunk, buffer, count, k)
        except OSError as e:
            raise CorruptCheckpointError(f"{where}: piece {k} cannot be read ({e})") from e
        expected = digest.recorded(record)
        if k >= len(expected) or not digest.matches(data, expected[k]):
            raise CorruptCheckpointError(
                f"{where}: piece {k} does not match its digest (the checkpoint is corrupt: a "
                "changed or half-written file). Restore another step, into a new tx.init."
            )
        return data

    def _check(self, record: dict[str, Any]) -> ShardReader:
        """The array's data file, opened once its metadata is checked against ``record``."""
        path = record["array"]
        with self._opening:
            if path in self._files:
                return self._files[path]
            where = os.path.join(self._directory, path)
            try:
                check_array(where, record["size"])
                self._files[path] = ShardReader(where)
                return self._files[path]
            except (ValueError, OSError) as e:
                raise CorruptCheckpointError(
                    f"{where} cannot be opened as the manifest describes it ({e}): the "
                    "checkpoint is incomplete or corrupt. Restore another step."
                ) from e

    def close(self) -> None:
        """Waits for the reads in flight, stops the reading threads and closes the files."""
        self._io.shutdown(wait=True, cancel_futures=True)
        for file in self._files.values():
            file.close()
        self._files.clear()
