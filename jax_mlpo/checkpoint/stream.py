"""The offloaded state in a checkpoint: per-leaf zarr3 arrays, written piece by piece.

An offloaded AdamW state is not an orbax leaf: it may be larger than host memory. For every
parameter leaf, each process writes its shard of ``mu``, ``nu`` and (bfloat16 leaves)
``master`` as a 1-D float32 zarr3 array of the shard's flattened elements
(:mod:`~jax_mlpo.checkpoint.shard_file`: uncompressed, readable with ``ts.open``), from an
engine snapshot, subgroup by subgroup. Subgroups cover the leaves in order, so every array's
data arrives in order: it is cut into pieces of ``chunk_elems``, each written with O_DIRECT
once complete and digested (:mod:`~jax_mlpo.checkpoint.digest`) by the thread that writes it.
Host memory: the pieces being filled (only a leaf that straddles two subgroups keeps its three
open between them) and at most ``MAX_IN_FLIGHT`` being written.

:mod:`~jax_mlpo.checkpoint.state_reader` reads them back. A shard's record (``start``,
``size``, ``array``, ``chunk``: the piece length, ``digest``: one per piece) goes into the
checksum manifest.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jax_mlpo.checkpoint import digest
from jax_mlpo.checkpoint.blocks import Region
from jax_mlpo.checkpoint.recycle import SpareFiles
from jax_mlpo.checkpoint.shard_file import (
    PAGE_ELEMS,
    ShardCreator,
    ShardWriter,
    sync_directories,
    whole_pages,
)
from jax_mlpo.engine.layout import Layout, Moment, Segment, Subgroup, is_signed, moment_f32
from jax_mlpo.engine.quantize import moment_dtype_name
from jax_mlpo.tiers.posix import aligned_empty
from jax_mlpo.types import F32

CHUNK_ELEMS = 2 * 2**20  # 8 MiB pieces: requests as large as fio's best
MAX_IN_FLIGHT = 8  # pieces being written or read at once (and the host memory they hold)
IO_THREADS = 4  # each moves one piece at a time and digests it
SYNC_THREADS = 2  # arrays being made durable at once


def quantities(sg_or_layout: Subgroup | Layout) -> tuple[str, ...]:
    """The arrays a state is saved as: its optimizer's moments by name, then ``"master"``."""
    return (*sg_or_layout.moment_names, "master")


def split_quantities(sg: Subgroup, blob: np.ndarray) -> dict[str, Moment | None]:
    p, *moments = sg.split(blob)
    return {**dict(zip(sg.moment_names, moments, strict=True)), "master": p}


def _segment_f32(sg: Subgroup, parts: dict[str, Moment | None], name: str, seg: Segment):
    """A segment's values of one quantity, as the files hold them: float32 (a q8 moment decoded
    into a new array of the segment's size; a bfloat16 one widened where it is copied)."""
    if name == "master":
        return parts[name][seg.span]
    return moment_f32(sg.segment(parts[name], seg), signed=is_signed(name))


class _OpenArray:
    """One shard's array while it is written: the piece being filled and the digests so far."""

    def __init__(self, file: ShardWriter, size: int, chunk: int) -> None:
        self.file, self.size, self.chunk = file, size, chunk
        self.filled = 0  # elements written or buffered
        self.buffer: np.ndarray | None = None
        self.digests: list[concurrent.futures.Future] = []
        self.pending = 0  # pieces being written

    @property
    def complete(self) -> bool:
        return self.filled == self.size


class StateWriter:
    """Writes one offloaded state's shards, as a snapshot yields its subgroups.

    Args:
      directory: the checkpoint item's directory.
      prefix: where this state's arrays go, relative to ``directory``.
      layout: the engine's layout (this process's shards of the leaves).
      regions: where each engine leaf is in the parameter leaves.
      skip: engine leaves this process does not write (another process writes them).
      chunk_elems: the chunk length.
      spares: files of a deleted checkpoint to rewrite (:mod:`~jax_mlpo.checkpoint.recycle`).
    """

    def __init__(
        self, directory: str | os.PathLike, prefix: str, layout: Layout, regions: list[Region],
        skip: Iterable[int] = (), chunk_elems: int = CHUNK_ELEMS, spares: SpareFiles | None = None,
    ) -> None:  # fmt: skip
        self._directory, self._prefix = os.fspath(directory), prefix
        self._layout, self._regions, self._skip = layout, regions, set(skip)
        self._chunk = chunk_elems
        self._open: dict[tuple[str, int], _OpenArray] = {}
        self._done: dict[tuple[str, int], dict[str, Any]] = {}
        self._unfinished: list[_OpenArray] = []  # files not closed yet
        self._spare: list[np.ndarray] = []
        self._in_flight: collections.deque[
            tuple[concurrent.futures.Future, _OpenArray, np.ndarray]
        ] = collections.deque()
        self._finishing: list[concurrent.futures.Future] = []  # files being made durable
        self._io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, "jax_mlpo-ckpt-write")
        # fsyncs wait behind the writes queued in the disk: off the writing threads
        self._syncs = concurrent.futures.ThreadPoolExecutor(SYNC_THREADS, "jax_mlpo-ckpt-sync")
        self._files = ShardCreator(
            [((name, j), self._full_path(name, j), size) for name, j, size in self._arrays()],
            spares,
        )

    def _arrays(self) -> list[tuple[str, int, int]]:
        """``(quantity, engine leaf, size)`` of every array to write, in the order written."""
        out = []
        for j, shape in enumerate(self._layout.shapes):
            size = int(np.prod(shape, dtype=np.int64))
            if j in self._skip or not size:
                continue
            for name in quantities(self._layout):
                if name != "master" or self._layout.has_master(j):
                    out.append((name, j, size))
        return out

    def _full_path(self, name: str, leaf: int) -> str:
        return os.path.join(self._directory, self.array_path(name, leaf))

    def array_path(self, quantity: str, leaf: int) -> str:
        """A shard array's path relative to the item directory."""
        return f"{self._prefix}/{quantity}.{leaf}"

    def write(self, blobs: Iterable[tuple[Subgroup, np.ndarray]]) -> dict[tuple[str, int], Any]:
        """Writes every blob's segments; returns once all is written and durable.

        Args:
          blobs: every subgroup and its blob, in subgroup order (a snapshot's ``blobs()``).

        Returns:
          ``{(quantity, engine leaf): shard record}`` (its region's ``box``, ``start`` and
          ``size``, ``array``, ``chunk``, ``digest`` per chunk) for every array written.

        Raises:
          ValueError: tensorstore failed to write (the message says why: a full disk...).
        """
        try:
            for sg, blob in blobs:
                parts = split_quantities(sg, blob)
                for seg in sg.segments:
                    if seg.leaf in self._skip:
                        continue
                    for name in quantities(sg):
                        if name != "master" or seg.master:
                            data = _segment_f32(sg, parts, name, seg)
                            self._append(name, seg.leaf, seg.leaf_start, data)
            if self._open:
                raise AssertionError(f"arrays {sorted(self._open)[:4]} were not completed")
            while self._in_flight:
                self._settle()
            for future in self._finishing:
                future.result()
            return {
                key: {**record, "digest": [d.result() for d in record["digest"]]}
                for key, record in self._done.items()
            }
        except BaseException:
            concurrent.futures.wait([f for f, _, _ in self._in_flight] + self._finishing)
            for array in self._unfinished:
                array.file.abandon()
            raise
        finally:
            self._files.close()
            self._io.shutdown(wait=True)
            self._syncs.shutdown(wait=True)

    def _array(self, name: str, leaf: int) -> _OpenArray:
        key = (name, leaf)
        if key not in self._open:
            size = int(np.prod(self._layout.shapes[leaf], dtype=np.int64))
            # whole pages (O_DIRECT offsets), unless one piece holds the shard
            chunk = (
                size
                if size <= self._chunk
                else max(PAGE_ELEMS, self._chunk // PAGE_ELEMS * PAGE_ELEMS)
            )
            file = self._files.get(key, self._full_path(name, leaf), size)
            self._open[key] = _OpenArray(file, size, chunk)
            self._unfinished.append(self._open[key])
        return self._open[key]

    def _append(self, name: str, leaf: int, offset: int, data: np.ndarray) -> None:
        array = self._array(name, leaf)
        if offset != array.filled:  # subgroups cover each leaf in order, so this cannot be
            raise AssertionError(f"{name} of leaf {leaf}: element {offset} after {array.filled}")
        done = 0
        while done < data.size:
            if array.buffer is None:  # page-aligned, with room for O_DIRECT's last page
                whole = whole_pages(self._chunk)
                array.buffer = self._spare.pop() if self._spare else aligned_empty(whole)
            at = array.filled % array.chunk
            take = min(array.chunk - at, data.size - done)
            array.buffer[at : at + take] = data[done : done + take]
            array.filled += take
            done += take
            if array.filled % array.chunk == 0 or array.filled == array.size:
                self._flush_chunk(name, leaf, array)

    def _flush_chunk(self, name: str, leaf: int, array: _OpenArray) -> None:
        start = (array.filled - 1) // array.chunk * array.chunk
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            self._settle()
        count = array.filled - start
        piece = start // array.chunk
        future = self._io.submit(_write_piece, array.file, start, array.buffer, count, piece)
        self._in_flight.append((future, array, array.buffer))
        array.digests.append(future)
        array.pending += 1
        array.buffer = None
        if array.complete:
            del self._open[(name, leaf)]
            self._done[(name, leaf)] = {
                **self._regions[leaf].record(), "chunk": array.chunk,
                "array": self.array_path(name, leaf), "digest": array.digests,
            }  # fmt: skip

    def _settle(self) -> None:
        future, array, buffer = self._in_flight.popleft()
        future.result()
        self._spare.append(buffer)  # every buffer is whole_pages(chunk_elems) long
        array.pending -= 1
        if array.complete and not array.pending:
            self._unfinished.remove(array)
            self._finishing.append(self._syncs.submit(array.file.finish))


def _write_piece(file: ShardWriter, start: int, buffer: np.ndarray, count: int, piece: int) -> str:
    digested = digest.of(buffer[:count])
    file.write(start, buffer, count, piece)
    return digested


STATE_DIR = "jax_mlpo_state"  # in the item directory: <state>/process_<k>/<quantity>.<leaf>


def write_streams(
    directory: str | os.PathLike, streams: list[Any], spares: SpareFiles | None = None
) -> dict[str, dict[str, Any]]:
    """Writes the offloaded states' streams (closing their snapshots, whatever happens).

    Args:
      directory: the checkpoint item's directory.
      streams: :class:`~jax_mlpo.checkpoint.snapshot.OffloadedStream` s, open.
      spares: files of a deleted checkpoint to rewrite, or None.

    Returns:
      The manifest's ``streamed`` records of this process: for each array leaf name
      (``"tree/2/mu/3"``), its dtype (float32: the files hold a bfloat16 moment widened,
      exactly, so that a restore may go to either width), the dtype the engine kept it in
      (``state_dtype``), its global shape and the shards this process wrote.
    """
    records: dict[str, dict[str, Any]] = {}
    try:
        for k, stream in enumerate(streams):
            prefix = f"{STATE_DIR}/{k}/process_{jax.process_index()}"
            writer = StateWriter(
                directory, prefix, stream.layout, stream.regions, stream.skip, CHUNK_ELEMS, spares
            )
            with stream.snapshot:
                shards = writer.write(stream.snapshot.blobs())
            if shards:  # each array synced its entry in the process's directory; above it:
                top = os.fspath(directory)
                sync_directories(os.path.dirname(os.path.join(top, prefix)), top)
            held: dict[int, list[int]] = {}  # each leaf's engine leaves in this process
            for j, region in enumerate(stream.regions):
                held.setdefault(region.leaf, []).append(j)
            layout = stream.layout
            kept = dict(zip(layout.moment_names, layout.moment_dtypes, strict=True), master=F32)
            for leaf, shape in enumerate(stream.shapes):
                mine = held.get(leaf)
                if not mine:
                    continue  # this process holds none of it
                for name in quantities(layout):
                    if name == "master" and not layout.has_master(mine[0]):
                        continue
                    records[f"{stream.name}/{name}/{leaf}"] = {
                        "dtype": "float32", "state_dtype": moment_dtype_name(kept[name]),
                        "shape": [int(d) for d in shape],
                        "shards": [shards[(name, j)] for j in mine if (name, j) in shards],
                    }  # fmt: skip
    finally:
        for stream in streams:
            stream.snapshot.close()
    return records
