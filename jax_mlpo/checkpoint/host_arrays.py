"""The tree's large host arrays (the params), written with O_DIRECT as plain zarr3 arrays.

orbax's ``NumpyHandler`` copies every host array before writing it (``deepcopy_host_arrays``),
compresses it and has tensorstore write it through a new file per chunk: saving 688 MiB of
bfloat16 params grew peak RSS by 883-1,201 MiB and took 2.4-12 s on a 2-core VM
(docs/benchmarks.md). :class:`DirectNumpyHandler` is that handler with the copy off, and arrays
of at least :data:`~jax_mlpo.checkpoint.host_reads.DIRECT_BYTES` written by itself: a zarr3
array of one uncompressed chunk (metadata by tensorstore), whose chunk file it writes in 8 MiB
pieces with ``pwrite`` and O_DIRECT from a few page-aligned buffers, digesting the array as it
goes. It writes them before ``serialize`` returns, so an asynchronous save needs no copy of the
params (the next update may donate them): their snapshot is on disk. The arrays keep orbax's
``np.ndarray`` type, so the item is read by plain orbax (its own ``NumpyHandler``, through
tensorstore). jax_mlpo reads them back itself (:mod:`~jax_mlpo.checkpoint.host_reads`; any
other array is left to orbax): a restore of 688 MiB of params and 4.3 GB of state took 2.90 s
that way against 3.99 through tensorstore's reads (medians of 3 interleaved restores).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_mlpo.checkpoint import file_io, host_reads
from jax_mlpo.checkpoint.digest import Digest
from jax_mlpo.checkpoint.recycle import SpareFiles
from jax_mlpo.checkpoint.shard_file import create_data_file, create_metadata, sync_array
from jax_mlpo.tiers.posix import aligned_empty, round_up_pages


class _NoOcdbtMerge(logging.Filter):
    """Drops orbax's warning that it found no OCDBT files to merge: these items have none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


logging.getLogger("absl").addFilter(_NoOcdbtMerge())

PIECE_BYTES = 8 << 20  # requests as large as fio's best
# pieces being written at once: rewriting 672 MiB of params took 0.246 s with 8 against 0.303
# with 4 (medians of 5 interleaved writes); buffers: 128 MiB
IO_THREADS = 8
PRODUCERS = 2  # arrays being copied and digested at once (a core each)


def writes_directly(value: Any) -> bool:
    """Whether :class:`DirectNumpyHandler` writes ``value`` itself, during ``serialize``.

    Others are written by orbax in the background, so an asynchronous save must copy them.
    """
    return (
        isinstance(value, np.ndarray)
        and value.ndim > 0
        and value.nbytes >= host_reads.DIRECT_BYTES
        and value.flags.c_contiguous
        and value.dtype.byteorder in "=<|"
        and (value.dtype.kind in "biuf" or value.dtype.name == "bfloat16")
    )


def _spec(path: str, shape: tuple[int, ...], dtype: np.dtype) -> dict[str, Any]:
    """A zarr3 array of one chunk, raw little-endian bytes: its file is the array's C-order
    bytes (``c/0/0/...``), which plain zarr3 readers (tensorstore, orbax) read."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        "dtype": dtype.name,
        "metadata": {
            "shape": list(shape),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shape)}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        },
    }


class ArrayWriter:
    """Writes arrays as zarr3 arrays of one raw chunk, in pieces, with O_DIRECT.

    :data:`PRODUCERS` arrays are written at once, each by a thread that copies its pieces into
    page-aligned buffers and digests them in order (:mod:`~jax_mlpo.checkpoint.digest`) while
    :data:`IO_THREADS` threads write them. The threads and buffers (``IO_THREADS`` of 8 MiB per
    producer: 128 MiB) are kept between arrays and saves: memory a process touches for the first
    time was slow to come on a 2-core VM (a first copy of 704 MiB took 7 s, the next 0.27 s).
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, "jax_mlpo-arrays")
        self._producers = concurrent.futures.ThreadPoolExecutor(PRODUCERS, "jax_mlpo-digests")
        self._buffers: queue.SimpleQueue[list[np.ndarray]] = queue.SimpleQueue()
        for _ in range(PRODUCERS):
            self._buffers.put([aligned_empty(PIECE_BYTES, np.uint8) for _ in range(IO_THREADS)])

    def write_all(
        self, paths: Sequence[str], values: Sequence[np.ndarray], spares: SpareFiles | None = None
    ) -> list[str]:
        """Writes each of ``values`` at its path (see :meth:`write`); returns their digests."""
        return list(self._producers.map(self.write, paths, values, [spares] * len(paths)))

    def write(self, path: str, value: np.ndarray, spares: SpareFiles | None = None) -> str:
        """Writes ``value`` as the zarr3 array at ``path``; returns its digest (the manifest's,
        over dtype, shape and bytes). ``spares``: files of a deleted checkpoint to rewrite.

        Raises:
          OSError: the file cannot be created or written (``ENOSPC``: a full disk).
        """
        create_metadata(_spec(path, value.shape, value.dtype))
        data = os.path.join(path, "c", *(["0"] * value.ndim))
        os.makedirs(os.path.dirname(data), exist_ok=True)
        raw = value.reshape(-1).view(np.uint8)  # no copy: C-contiguous
        digest = Digest(f"{value.dtype.name}{value.shape}".encode())
        fd = create_data_file(data, round_up_pages(raw.nbytes), spares)  # a full disk fails here
        buffers = self._buffers.get()  # a producer's own
        free, pending = list(buffers), {}
        try:
            for start in range(0, raw.nbytes, PIECE_BYTES):
                piece = raw[start : start + PIECE_BYTES]
                if not free:
                    done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                    for f in done:
                        free.append(pending.pop(f))
                        f.result()
                buffer, n = free.pop(), round_up_pages(piece.nbytes)
                buffer[: piece.nbytes] = piece
                buffer[piece.nbytes : n] = 0  # O_DIRECT writes whole pages; cut off below
                args = (fd, buffer[:n], start, data, file_io.ARRAY, start // PIECE_BYTES)
                pending[self._pool.submit(file_io.write_piece, *args)] = buffer
                digest.update(piece)  # in order, on this thread, while the pieces are written
            for f in concurrent.futures.as_completed(list(pending)):
                pending.pop(f)
                f.result()
            os.ftruncate(fd, raw.nbytes)
            os.fdatasync(fd)
        finally:
            concurrent.futures.wait(pending)  # no write may still use a buffer or the fd
            os.close(fd)
            self._buffers.put(buffers)
        sync_array(path, data)
        return digest.hexdigest()

    def close(self) -> None:
        self._producers.shutdown()
        self._pool.shutdown()


class DirectNumpyHandler(ocp.type_handlers.NumpyHandler):
    """orbax's ``NumpyHandler``, writing large arrays itself before ``serialize`` returns.

    ``digests`` maps ``id(array)`` of each array it wrote to its digest, for the manifest; the
    caller pops them while the arrays are alive.
    """

    def __init__(self) -> None:
        super().__init__(deepcopy_host_arrays=False)  # the snapshot copied what needs a copy
        self.digests: dict[int, str] = {}
        self.spares: SpareFiles | None = None  # set for each save (files to rewrite)
        self._writer: ArrayWriter | None = None  # made at the first large array

    async def serialize(
        self,
        values: Sequence[np.ndarray],
        infos: Sequence[Any],
        args: Sequence[Any] | None = None,
    ) -> list[Any]:
        """Writes the large arrays now, then hands the rest to orbax's background write."""
        args = list(args or [ocp.SaveArgs()] * len(values))
        direct = [k for k, v in enumerate(values) if writes_directly(v)]
        if direct and _writes_host_arrays():
            self._writer = self._writer or ArrayWriter()
            for k in direct:
                await infos[k].await_path_creation()
            await _created(infos[direct[0]].parent_dir)
            paths = [os.fspath(infos[k].parent_dir / infos[k].name) for k in direct]
            arrays = [values[k] for k in direct]
            digests = await asyncio.to_thread(self._writer.write_all, paths, arrays, self.spares)
            self.digests.update({id(a): d for a, d in zip(arrays, digests, strict=True)})
        written = set(direct)
        rest = [k for k in range(len(values)) if k not in written]
        if not rest:
            return []
        return await super().serialize(
            [values[k] for k in rest], [infos[k] for k in rest], [args[k] for k in rest]
        )

    async def deserialize(
        self,
        infos: Sequence[Any],
        args: Sequence[Any] | None = None,
    ) -> list[np.ndarray]:
        """Reads the arrays :class:`ArrayWriter` wrote itself; orbax reads the rest."""
        args = list(args or [ocp.RestoreArgs()] * len(infos))
        found = {}
        for k, (info, arg) in enumerate(zip(infos, args, strict=True)):
            await info.await_path_creation()
            direct = host_reads.one_raw_chunk(os.fspath(info.parent_dir / info.name), arg.dtype)
            if direct is not None:
                found[k] = direct
        out: list[Any] = [None] * len(infos)
        arrays = await asyncio.to_thread(host_reads.take_or_read, list(found.values()))
        for k, array in zip(found, arrays, strict=True):
            out[k] = array
        rest = [k for k in range(len(infos)) if k not in found]
        if rest:
            got = await super().deserialize([infos[k] for k in rest], [args[k] for k in rest])
            for k, value in zip(rest, got, strict=True):
                out[k] = value
        return out

    def close(self) -> None:
        """Stops the writer's threads."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


async def _created(directory: Any, timeout_s: float = 300.0) -> None:
    """Waits until orbax has made the item's directory.

    With orbax's asynchronous directory creation (its default; :func:`~jax_mlpo.checkpoint.manager`
    turns it off) the directory is made by a background thread while ``serialize`` runs, and
    tensorstore making it first would fail orbax's ``mkdir``.

    Raises:
      TimeoutError: it did not appear within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(os.fspath(directory)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"orbax did not create {directory} within {timeout_s:.0f} s")
        await asyncio.sleep(0.005)


def _writes_host_arrays() -> bool:
    """orbax's rule: process 0 writes host arrays (every process holds them whole)."""
    return jax.process_index() == 0


def tree_handler(handler: DirectNumpyHandler) -> ocp.PyTreeCheckpointHandler:
    """orbax's tree handler with ``handler`` for numpy arrays, uncompressed zarr3 without OCDBT.

    The other types orbax supports keep the handlers registered for them. Uncompressed: random
    floats do not compress and zstd's buffers grew RSS by the params' size; without OCDBT: the
    large arrays' chunk files are plain files jax_mlpo writes itself.
    """
    type_handlers = ocp.type_handlers
    registry = type_handlers.create_type_handler_registry(
        *(
            (ty, handler if ty is np.ndarray else type_handlers.get_type_handler(ty))
            for ty in type_handlers.supported_types()
        )
    )
    return ocp.PyTreeCheckpointHandler(
        use_ocdbt=False, use_zarr3=True, use_compression=False, type_handler_registry=registry
    )
