"""One shard of an offloaded state's array on disk: a zarr3 array moved by O_DIRECT I/O.

Each shard array is a zarr3 array (``zarr.json`` written by tensorstore) of a single chunk, the
whole shard, uncompressed little-endian float32: its chunk file ``c/0`` is the shard's raw
bytes, so that the checkpoint is read by any zarr3 reader (``ts.open``), while jax_mlpo writes
and reads that file itself, in pieces of ``piece`` elements, with ``pwrite``/``pread`` and
O_DIRECT from page-aligned buffers. tensorstore's ``file`` driver writes each chunk to a new file
and renames it, at 43-57% of the disk here (docs/design.md); a preallocated file rewritten in
place is what reaches the disk's bandwidth, as the tiers' posix engine does.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jax_mlpo.checkpoint import file_io
from jax_mlpo.checkpoint.recycle import SpareFiles
from jax_mlpo.tiers.posix import ALIGN, open_direct, round_up_pages

logger = logging.getLogger(__name__)

DATA_FILE = os.path.join("c", "0")  # zarr3's default chunk key of chunk (0,)
PAGE_ELEMS = ALIGN // 4  # float32 per page: O_DIRECT moves whole pages
# tensorstore's file driver fsyncs every file it writes (its ``file_io_sync``): beside a
# checkpoint's own I/O that held the stream's thread 1.36-1.68 s of a 5.5-6.1 s save, ~25 ms
# per array (the stream's thread timed by phase). The metadata is written unsynced,
# then made durable with the data.
_UNSYNCED = ts.Context({"file_io_sync": False})


def create_metadata(spec: dict[str, Any]) -> None:
    """Creates (or replaces) the zarr3 array of ``spec``: its ``zarr.json``, not yet durable
    (:func:`sync_array` makes it so)."""
    ts.open(spec, create=True, delete_existing=True, context=_UNSYNCED).result()


def sync_array(path: str, data: str) -> None:
    """Makes an array's ``zarr.json`` durable, and the directory entries from its data file
    ``data`` (synced by its writer) up to the array's own, in the directory holding it."""
    _fsync(os.path.join(path, "zarr.json"))
    sync_directories(os.path.dirname(data), os.path.dirname(path))


def sync_directories(directory: str, top: str) -> None:
    """fsyncs ``directory`` and every directory above it up to ``top``: the entries of the files
    and directories created in them become durable."""
    while True:
        _fsync(directory)
        if len(directory) <= len(top):
            return
        directory = os.path.dirname(directory)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def array_spec(path: str, size: int) -> dict[str, Any]:
    """The zarr3 spec of a shard's array: ``size`` float32 in one chunk."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        "metadata": {
            "shape": [size],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, size)]}},
            "data_type": "float32",
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "fill_value": 0,
        },
    }


def create_data_file(path: str, nbytes: int, spares: SpareFiles | None = None) -> int:
    """Opens a new data file for O_DIRECT writes of ``nbytes``, with its space reserved.

    Where ``spares`` has a file of a deleted checkpoint at least as large, that file is renamed
    to ``path`` and rewritten (:mod:`~jax_mlpo.checkpoint.recycle`); the writer overwrites every
    byte up to its size and cuts the rest off.

    Returns:
      The file descriptor, write-only.

    Raises:
      OSError: the file cannot be created or its space reserved (``ENOSPC``: a full disk).
    """
    flags = os.O_WRONLY | os.O_CREAT
    if spares is None or not spares.take(path, nbytes):
        flags |= os.O_TRUNC
    fd, _ = open_direct(path, flags)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)  # a full disk fails here, before any write
    except BaseException:
        os.close(fd)
        raise
    return fd


def whole_pages(elems: int) -> int:
    """``elems`` float32 rounded up to whole pages (what O_DIRECT moves)."""
    return round_up_pages(4 * elems) // 4


def _page_view(buffer: np.ndarray, count: int) -> np.ndarray:
    """The bytes of ``buffer`` that ``count`` elements take in whole pages."""
    need = 4 * whole_pages(count)
    if buffer.nbytes < need:
        raise ValueError(f"a buffer of {buffer.nbytes} bytes cannot take {need}")
    return buffer.view(np.uint8)[:need]


class ShardWriter:
    """Creates a shard's array and writes its data file, piece by piece, in any order.

    Args:
      path: the array's directory.
      size: the shard's elements.
      spares: files of a deleted checkpoint to rewrite, or None.

    Raises:
      OSError: the file cannot be created or its space reserved (``ENOSPC``: a full disk).
    """

    def __init__(self, path: str, size: int, spares: SpareFiles | None = None) -> None:
        self.path, self.size = path, size
        create_metadata(array_spec(path, size))
        self._data = os.path.join(path, DATA_FILE)
        os.makedirs(os.path.dirname(self._data), exist_ok=True)
        self._fd = create_data_file(self._data, 4 * whole_pages(size), spares)

    def write(self, start: int, buffer: np.ndarray, count: int, piece: int = 0) -> None:
        """Writes ``buffer[:count]`` at element ``start``.

        ``buffer`` is page-aligned float32 with room up to the page after ``count`` elements;
        that room is zeroed and written too (O_DIRECT moves whole pages), then cut off by
        :meth:`finish`. ``piece``: its index in the array (a fault plan's ``slot``).

        Raises:
          OSError: the write failed or was short (``ENOSPC``: a full disk).
        """
        n = 4 * count
        raw = _page_view(buffer, count)
        raw[n:] = 0
        file_io.write_piece(self._fd, raw, 4 * start, self._data, file_io.STATE, piece)

    def finish(self) -> None:
        """Cuts the page padding off, makes the array durable and closes its file."""
        try:
            os.ftruncate(self._fd, 4 * self.size)
            os.fdatasync(self._fd)
        finally:
            os.close(self._fd)
        sync_array(self.path, os.path.join(self.path, DATA_FILE))

    def abandon(self) -> None:
        """Closes the file after a failure (the checkpoint is not published)."""
        os.close(self._fd)


class ShardCreator:
    """Creates shard arrays (:class:`ShardWriter`) ahead of their use, on a thread of its own.

    Creating one (tensorstore writing its ``zarr.json``, the data file opened and its space
    reserved) took 33 ms here: the 63 arrays of a 4.3 GB save, created as the stream reached
    them, held it 2.1 s of 7 (on a 2-core VM).

    Args:
      wanted: ``(key, path, size)`` of every array, in the order they will be asked for.
      spares: files of a deleted checkpoint to rewrite, or None.
      ahead: arrays created before they are asked for (files open at once).
    """

    def __init__(
        self, wanted: Sequence[tuple[Hashable, str, int]], spares: SpareFiles | None = None,
        ahead: int = 8,
    ) -> None:  # fmt: skip
        self._wanted, self._next = list(wanted), 0
        self._spares = spares
        self._made: dict[Hashable, concurrent.futures.Future[ShardWriter]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jax_mlpo-ckpt-create")
        for _ in range(ahead):
            self._create_next()

    def _create_next(self) -> None:
        if self._next < len(self._wanted):
            key, path, size = self._wanted[self._next]
            self._next += 1
            self._made[key] = self._pool.submit(ShardWriter, path, size, self._spares)

    def get(self, key: Hashable, path: str, size: int) -> ShardWriter:
        """The array ``key`` (at ``path``, of ``size`` elements), created ahead or now.

        Raises:
          OSError: it could not be created (``ENOSPC``: a full disk).
        """
        future = self._made.pop(key, None)
        self._create_next()
        return future.result() if future is not None else ShardWriter(path, size, self._spares)

    def close(self) -> None:
        """Stops creating; closes the files created and not asked for."""
        self._next = len(self._wanted)
        self._pool.shutdown(wait=True)
        for future in self._made.values():
            if future.exception() is None:
                future.result().abandon()
        self._made.clear()


def check_array(path: str, size: int) -> None:
    """Raises unless ``path`` holds the zarr3 array of a ``size``-element shard.

    Raises:
      ValueError: tensorstore cannot open it as that array (missing, or other metadata).
    """
    ts.open(array_spec(path, size), open=True).result()


class ShardReader:
    """A shard's data file, open for reading pieces (``pread``: from any thread at once).

    Args:
      path: the array's directory.

    Raises:
      OSError: the file is missing.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._data = os.path.join(path, DATA_FILE)
        self._fd, _ = open_direct(self._data, os.O_RDONLY)

    def read(self, start: int, buffer: np.ndarray, count: int, piece: int = 0) -> np.ndarray:
        """Reads elements ``[start, start + count)`` into ``buffer`` (page-aligned float32 with
        room up to the page after ``count``); returns ``buffer[:count]``. ``piece``: its index
        in the array (a fault plan's ``slot``).

        Raises:
          OSError: the read failed, or the file is short (truncated).
        """
        view = _page_view(buffer, count)
        file_io.read_piece(self._fd, view, 4 * start, 4 * count, self._data, file_io.STATE, piece)
        return buffer[:count]

    def close(self) -> None:
        os.close(self._fd)
