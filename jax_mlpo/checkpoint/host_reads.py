"""The params' large arrays read back as :mod:`~jax_mlpo.checkpoint.host_arrays` wrote them.

Each is a zarr3 array of one raw chunk: :func:`one_raw_chunk` recognises it, :func:`read_all`
reads its data file with O_DIRECT pieces straight into a new array, and :func:`prefetch` starts
that for a whole item while a restore streams the offloaded state, so that
:class:`~jax_mlpo.checkpoint.host_arrays.DirectNumpyHandler` finds them read
(:func:`take_or_read`). Anything else
(another layout, dtype, a missing or short file) is left to orbax, which says what is wrong.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_mlpo.checkpoint import file_io
from jax_mlpo.tiers.posix import aligned_empty, open_direct, round_up_pages
from jax_mlpo.transforms.runtime import RUNTIME

# Arrays of at least this many bytes are written by host_arrays itself, and read back here;
# smaller ones are orbax's both ways (a copy costs little there). One figure for both sides.
DIRECT_BYTES = 1 << 20
READ_PIECE_BYTES = 8 << 20
READ_THREADS = 32  # pieces being read at once: into the arrays themselves, so no memory
# The arrays read are fresh memory, whose pages are faulted in as the reads land, so they are
# made over 4 KiB pages: orbax's tree restores (688 MiB of params and the small rest) took
# 0.59 s [0.47-0.70] with 4 KiB pages, 0.86 [0.43-0.91] with huge pages, 1.73 [0.91-3.40]
# through orbax's own reads (medians of 3 interleaved restores on a 2-core VM).


def one_raw_chunk(path: str, dtype: Any = None) -> tuple[str, tuple[int, ...], np.dtype] | None:
    """``(data file, shape, dtype)`` of the array at ``path`` where it is what ``ArrayWriter``
    writes (a zarr3 array of one raw little-endian chunk, at least :data:`DIRECT_BYTES`, its data
    file whole) and ``dtype`` (a restore's requested dtype, or None) is its own; otherwise
    None, for orbax to read it (and report what is wrong with it)."""
    try:
        with open(os.path.join(path, "zarr.json")) as f:
            meta = json.load(f)
        shape = tuple(int(d) for d in meta["shape"])
        saved = np.dtype(meta["data_type"])
        grid = meta["chunk_grid"]["configuration"]["chunk_shape"]
        codecs = meta["codecs"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    nbytes = int(np.prod(shape, dtype=np.int64)) * saved.itemsize
    raw = [c.get("name") for c in codecs] == ["bytes"] and codecs[0].get("configuration", {}).get(
        "endian", "little"
    ) in ("little", None)
    data = os.path.join(path, "c", *(["0"] * len(shape)))
    if (
        not raw or list(grid) != list(shape) or not shape or nbytes < DIRECT_BYTES
        or (dtype is not None and np.dtype(dtype) != saved)
        or not os.path.isfile(data) or os.path.getsize(data) != nbytes
    ):  # fmt: skip
        return None
    return data, shape, saved


def read_all(arrays: Sequence[tuple[str, tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Each ``(data file, shape, dtype)`` of ``arrays`` (from :func:`one_raw_chunk`), read as
    ``ArrayWriter`` wrote it: O_DIRECT pieces of :data:`READ_PIECE_BYTES`, :data:`READ_THREADS`
    at once, straight into each new (page-aligned) array, so no buffer beyond the arrays
    themselves. The caller checks their digests (the manifest).

    Raises:
      OSError: a file cannot be opened or is shorter than its array (truncated).
    """
    out, fds, pieces = [], [], []
    with concurrent.futures.ThreadPoolExecutor(READ_THREADS, "jax_mlpo-arrays-read") as pool:
        try:
            for data, shape, dtype in arrays:
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                buffer = aligned_empty(round_up_pages(nbytes), np.uint8, huge_pages=False)
                fds.append(open_direct(data, os.O_RDONLY)[0])
                for start in range(0, nbytes, READ_PIECE_BYTES):
                    n = min(READ_PIECE_BYTES, nbytes - start)
                    view = buffer[start : start + round_up_pages(n)]
                    args = (fds[-1], view, start, n, data, file_io.ARRAY, start // READ_PIECE_BYTES)
                    pieces.append(pool.submit(file_io.read_piece, *args))
                out.append(buffer[:nbytes].view(dtype).reshape(shape))
            for piece in pieces:
                piece.result()
        finally:
            concurrent.futures.wait(pieces)  # no read may still use an fd
            for fd in fds:
                os.close(fd)
    return out


def prefetch(item: str) -> Callable[[], None]:
    """Starts reading the arrays of the item directory ``item`` that :func:`read_all` reads, in
    a background thread, for ``DirectNumpyHandler`` to take when orbax asks for them.

    orbax restores a checkpoint's items in name order, so the offloaded state (``opt_state``)
    streams into its engine before the ``params`` are read: read beside that stream, they cost
    the restore no time of their own.

    Returns:
      A function that drops what was read and not taken (call it once the restore is over).
    """
    arrays = []
    for name in sorted(os.listdir(item)) if os.path.isdir(item) else ():
        found = one_raw_chunk(os.path.join(item, name))
        if found is not None:
            arrays.append(found)
    futures = {data: concurrent.futures.Future() for data, _, _ in arrays}

    def read() -> None:
        try:
            for (data, _, _), array in zip(arrays, read_all(arrays), strict=True):
                futures[data].set_result(array)
        except BaseException as e:  # noqa: BLE001 - the handler reads them again, and says why
            for future in futures.values():
                if not future.done():
                    future.set_exception(e)

    with RUNTIME.checkpoints.lock:
        RUNTIME.checkpoints.prefetched.update(futures)
    if arrays:
        threading.Thread(target=read, name="jax_mlpo-params-prefetch", daemon=True).start()

    def drop() -> None:
        with RUNTIME.checkpoints.lock:
            for data in futures:
                RUNTIME.checkpoints.prefetched.pop(data, None)

    return drop


def take_or_read(arrays: Sequence[tuple[str, tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Each of ``arrays`` (from :func:`one_raw_chunk`): the one :func:`prefetch` read (waiting
    for it), or, where it did not (or failed: this read then says why), read now."""
    out: list[np.ndarray | None] = []
    for data, _, _ in arrays:
        with RUNTIME.checkpoints.lock:
            future = RUNTIME.checkpoints.prefetched.pop(data, None)
        ok = future is not None and future.exception() is None
        out.append(future.result() if ok else None)
    unread = [k for k, array in enumerate(out) if array is None]
    if unread:
        for k, array in zip(unread, read_all([arrays[k] for k in unread]), strict=True):
            out[k] = array
    return out
