"""Blobs as files read and written with ``pread``/``pwrite``, O_DIRECT, in concurrent chunks.

The default I/O engine of a file tier (``FileTier.io_engine="posix"``). One file per blob,
``<kind>-<slot>.blob``, preallocated at its first write (so a full disk fails before any byte of
the blob is overwritten) and then rewritten in place::

    [0, nbytes)              the blob (float32, little-endian)
    [nbytes, data_end)       zero padding to a 4 KiB boundary (O_DIRECT moves whole blocks)
    [data_end, file end)     trailer: magic, blob bytes, chunk bytes, chunk count, the crc32c of
                             every chunk (the last one's covers the padding), zeros, and in the
                             last 4 bytes the crc32c of the rest of the trailer

Every byte of the file is covered by a checksum.

A blob moves as requests of ``chunk_bytes`` each, ``queue_depth`` of them in flight per tier on
a small thread pool that serves reads before writes (the update waits on reads; write-back only
has to finish before its buffer is reused). This is how DeepSpeed's libaio swapper reaches the
disk's bandwidth; tensorstore's ``file`` driver reaches 65-75% of it here, so the hot path does
its own I/O (``io_engine="tensorstore"`` remains for comparison). Each chunk's checksum is
computed by the thread that moved it (native crc32c, GIL released) and checked against the
trailer on every read: a torn write (a crash midway through rewriting a blob) or a flipped bit
fails loudly instead of feeding the optimizer wrong state.

With ``io_mode="direct"`` files are opened with O_DIRECT, so state does not churn the page
cache; buffers that are not 4 KiB aligned (or a blob's last, partial block) go through a
per-thread aligned bounce buffer. On a file system without O_DIRECT (tmpfs) the tier logs it
once and uses the page cache.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import glob
import itertools
import logging
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_mlpo.config import FileTier
from jax_mlpo.native.crc32c import crc32c
from jax_mlpo.tiers.errors import CorruptBlobError

logger = logging.getLogger(__name__)

ALIGN = 4096
MAGIC = b"JXMLPOB\x01"
_HEADER = struct.Struct("<8sQQI")  # magic, blob bytes, chunk bytes, chunk count
_READ, _WRITE = 0, 1  # request priorities: reads first


def aligned_empty(n: int, dtype: Any = np.float32) -> np.ndarray:
    """A 1-D array of ``n`` elements whose data starts on a page (O_DIRECT-ready), zero-filled.

    Anonymous ``mmap`` memory: page-aligned, and its pages are only committed when touched.
    """
    nbytes = max(1, n * np.dtype(dtype).itemsize)
    return np.frombuffer(mmap.mmap(-1, nbytes), np.dtype(dtype), count=n)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _aligned(arr: np.ndarray) -> bool:
    return arr.ctypes.data % ALIGN == 0


class ChunkQueue:
    """``depth`` threads that run chunk requests: reads before writes, then by blob, oldest
    first, then FIFO.

    Ordering by blob lets a blob's trailer, queued once its chunks are written, go before the
    chunks of blobs submitted after it instead of behind all of them.

    Args:
      depth: requests in flight.
      name: thread name prefix.
    """

    def __init__(self, depth: int, name: str) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._blobs = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(depth)
        ]
        for t in self._threads:
            t.start()

    def next_blob(self) -> int:
        """A number for a new blob's requests, after every earlier blob's."""
        return next(self._blobs)

    def submit(
        self, priority: int, blob: int, fn: Callable[..., Any], *args: Any
    ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((priority, blob, next(self._seq), future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            _, _, _, future, fn, args = self._queue.get()
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter, who raises it
                future.set_exception(e)

    def close(self) -> None:
        """Runs what is queued, then stops the threads."""
        for _ in self._threads:
            self._queue.put((_WRITE + 1, 0, next(self._seq), None, None, ()))
        for t in self._threads:
            t.join()


def _wait_all(futures: list[concurrent.futures.Future]) -> list[Any]:
    """Results of all ``futures``; raises the first error only once none is still running (the
    requests share a file descriptor and buffers that the caller releases next)."""
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


class PosixBlobs:
    """The blob files of one tier directory.

    Args:
      directory: the tier's directory (exists, locked by the caller).
      tier: the tier's configuration (``chunk_bytes``, ``queue_depth``, ``io_mode``, ``sync``).
      kinds: for each kind, the float32 length of each slot's blob.
    """

    def __init__(self, directory: str, tier: FileTier, kinds: dict[str, list[int]]) -> None:
        self.directory = directory
        self._nbytes = {kind: [4 * n for n in lengths] for kind, lengths in kinds.items()}
        self._chunk = max(ALIGN, tier.chunk_bytes // ALIGN * ALIGN)
        self._direct = tier.io_mode == "direct"
        self._sync = tier.sync
        self._local = threading.local()
        # A blob file left by an earlier run is not this run's state: start clean, as a fresh
        # zarr array would (restoring goes through checkpoints, never through tier files).
        for kind in kinds:
            for stale in glob.glob(os.path.join(glob.escape(directory), f"{kind}-*.blob")):
                os.unlink(stale)
        self._queue = ChunkQueue(tier.queue_depth, f"jax_mlpo-io-{os.path.basename(directory)}")

    def path(self, slot: int, kind: str) -> str:
        return os.path.join(self.directory, f"{kind}-{slot}.blob")

    def files(self, slot: int, kind: str) -> list[str]:
        """Every file that holds part of the blob (one)."""
        return [self.path(slot, kind)]

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(o, min(self._chunk, nbytes - o)) for o in range(0, nbytes, self._chunk)] or [
            (0, 0)
        ]

    def _layout(self, nbytes: int) -> tuple[int, int, int]:
        """(chunk count, trailer offset, trailer bytes) of a blob of ``nbytes``."""
        count = len(self._chunks(nbytes))
        return count, _round_up(nbytes), _round_up(_HEADER.size + 4 * count + 4)

    def _tail(self, n: int, last: bool) -> int:
        """Bytes a request moves for ``n`` bytes of blob: the last one takes the padding too."""
        return _round_up(n) if last else n

    def _open(self, path: str, flags: int) -> int:
        if self._direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False
                logger.warning(
                    "%s does not support O_DIRECT (tmpfs?); this tier uses the page cache",
                    self.directory,
                )
        return os.open(path, flags, 0o600)

    def _bounce(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = aligned_empty(max(nbytes, ALIGN), np.uint8)
        return buf[:nbytes]

    # ---- reads ----------------------------------------------------------------------------

    def read(self, slot: int, kind: str, out: np.ndarray) -> None:
        """Reads blob ``slot`` of ``kind`` into ``out`` (contiguous, its length) and checks it.

        Raises:
          CorruptBlobError: the file is truncated, or a chunk or the trailer fails its checksum.
          OSError: the file is missing (never written) or unreadable.
        """
        path = self.path(slot, kind)
        nbytes = self._nbytes[kind][slot]
        view = _bytes_of(out, nbytes)
        count, trailer_at, trailer_bytes = self._layout(nbytes)
        try:
            fd = self._open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                e.errno, f"the blob was never written (no file {path})", path
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < trailer_at + trailer_bytes:
                raise CorruptBlobError(
                    f"{path} is {size} bytes, a blob of {nbytes} bytes needs "
                    f"{trailer_at + trailer_bytes}: the file is truncated"
                )
            blob = self._queue.next_blob()
            trailer = self._queue.submit(
                _READ, blob, self._read_trailer, fd, trailer_at, trailer_bytes
            )
            parts = [
                self._queue.submit(
                    _READ, blob, self._read_chunk, fd, view[o : o + n], o, o + n == nbytes
                )
                for o, n in self._chunks(nbytes)
            ]
            crcs = _wait_all([trailer, *parts])
        finally:
            os.close(fd)
        stored = _parse_trailer(crcs[0], path, nbytes, self._chunk, count)
        bad = [i for i, (a, b) in enumerate(zip(crcs[1:], stored, strict=True)) if a != b]
        if bad:
            raise CorruptBlobError(
                f"{path}: {len(bad)} of {count} chunks fail their crc32c (first: chunk {bad[0]}, "
                f"bytes {bad[0] * self._chunk}-{min(nbytes, (bad[0] + 1) * self._chunk)}); "
                "corrupted, or a write was cut short"
            )

    def _read_chunk(self, fd: int, dst: np.ndarray, offset: int, last: bool) -> int:
        n = dst.nbytes
        moved = self._tail(n, last)
        if moved == n and (not self._direct or _aligned(dst)):
            got = _pread_full(fd, dst, offset)
            crc = crc32c(dst)
        else:
            bounce = self._bounce(moved)
            got = _pread_full(fd, bounce, offset)
            dst[:] = bounce[:n]
            crc = crc32c(bounce)
        if got < moved:
            raise CorruptBlobError(f"short read at byte {offset}: the file is truncated")
        return crc

    def _read_trailer(self, fd: int, offset: int, nbytes: int) -> bytes:
        buf = self._bounce(nbytes)  # copied out below, so the thread may reuse it
        if _pread_full(fd, buf, offset) < nbytes:
            raise CorruptBlobError(f"short read of the trailer at byte {offset}: truncated file")
        return buf.tobytes()

    # ---- writes ---------------------------------------------------------------------------

    def write(self, slot: int, kind: str, data: np.ndarray) -> None:
        """Writes ``data`` as blob ``slot`` of ``kind``; durable on return when ``sync``."""
        path = self.path(slot, kind)
        nbytes = self._nbytes[kind][slot]
        view = _bytes_of(data, nbytes)
        count, trailer_at, trailer_bytes = self._layout(nbytes)
        fd = self._open(path, os.O_WRONLY | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size != trailer_at + trailer_bytes:
                if size > trailer_at + trailer_bytes:
                    os.ftruncate(fd, trailer_at + trailer_bytes)
                # Reserve the blocks now: a full disk fails here, before the old blob is touched.
                os.posix_fallocate(fd, 0, trailer_at + trailer_bytes)
            blob = self._queue.next_blob()
            crcs = _wait_all(
                [
                    self._queue.submit(
                        _WRITE, blob, self._write_chunk, fd, view[o : o + n], o, o + n == nbytes
                    )
                    for o, n in self._chunks(nbytes)
                ]
            )
            # built in this (blob) thread's bounce buffer, which waits for the write below
            trailer = self._bounce(trailer_bytes)
            trailer[:] = 0
            body = _HEADER.pack(MAGIC, nbytes, self._chunk, count) + struct.pack(
                f"<{count}I", *crcs
            )
            trailer[: len(body)] = np.frombuffer(body, np.uint8)
            trailer[-4:] = np.frombuffer(struct.pack("<I", crc32c(trailer[:-4])), np.uint8)
            # The trailer goes last: until it lands, a reader sees the old checksums and reports
            # a half-written blob rather than reading it as valid.
            request = (self._write_chunk, fd, trailer, trailer_at, False)
            _wait_all([self._queue.submit(_WRITE, blob, *request)])
            if self._sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _write_chunk(self, fd: int, src: np.ndarray, offset: int, last: bool) -> int:
        n = src.nbytes
        moved = self._tail(n, last)
        if moved == n and (not self._direct or _aligned(src)):
            crc = crc32c(src)
            put = _pwrite_full(fd, src, offset)
        else:
            bounce = self._bounce(moved)
            bounce[:n] = src
            bounce[n:] = 0
            crc = crc32c(bounce)
            put = _pwrite_full(fd, bounce, offset)
        if put < moved:
            raise OSError(errno.ENOSPC, f"short write at byte {offset} ({put} of {moved} bytes)")
        return crc

    def discard(self, slot: int, kind: str) -> None:
        """Deletes the blob's file (a later read fails as never written)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(slot, kind))

    def close(self) -> None:
        self._queue.close()


def _bytes_of(arr: np.ndarray, nbytes: int) -> np.ndarray:
    if not arr.flags.c_contiguous or arr.nbytes != nbytes:
        raise ValueError(
            f"a blob buffer must be C-contiguous and {nbytes} bytes, got "
            f"{arr.nbytes} bytes (contiguous: {arr.flags.c_contiguous})"
        )
    return arr.reshape(-1).view(np.uint8)


def _parse_trailer(raw: bytes, path: str, nbytes: int, chunk: int, count: int) -> tuple[int, ...]:
    magic, stored_bytes, stored_chunk, stored_count = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptBlobError(f"{path}: no jax_mlpo blob trailer (magic {magic!r})")
    (crc,) = struct.unpack_from("<I", raw, len(raw) - 4)
    if (stored_bytes, stored_chunk, stored_count) != (nbytes, chunk, count) or crc != (
        crc32c(raw[:-4])
    ):
        raise CorruptBlobError(
            f"{path}: the trailer is corrupt or describes another blob ({stored_bytes} bytes in "
            f"chunks of {stored_chunk}; expected {nbytes} in chunks of {chunk})"
        )
    return struct.unpack_from(f"<{count}I", raw, _HEADER.size)


def _transfer_full(op: Callable[..., int], fd: int, buf: np.ndarray, offset: int) -> int:
    """Repeats ``op`` (``os.preadv`` or ``os.pwritev``) until all of ``buf`` moved or it moves
    nothing (end of file, full disk); returns the bytes moved."""
    done = 0
    while done < buf.nbytes:
        moved = op(fd, [buf[done:]], offset + done)
        if moved == 0:
            break
        done += moved
    return done


def _pread_full(fd: int, buf: np.ndarray, offset: int) -> int:
    return _transfer_full(os.preadv, fd, buf, offset)


def _pwrite_full(fd: int, buf: np.ndarray, offset: int) -> int:
    return _transfer_full(os.pwritev, fd, buf, offset)
