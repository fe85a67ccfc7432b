"""How a posix tier's chunk requests reach the kernel (``FileTier.io_submit``).

Both submitters move a blob's chunks with up to ``queue_depth`` requests of the tier in flight,
reads ahead of writes and older blobs ahead of newer ones, and return each chunk's crc32c:

* :class:`AioSubmitter` (``"aio"``, the default): Linux kernel AIO from C++
  (:mod:`jax_mlpo.native.aio`), the submission path of DeepSpeed's libaio swapper: no thread
  per request, no GIL hand-over per chunk.
* :class:`ThreadSubmitter` (``"threads"``): ``queue_depth`` Python threads, each with one
  blocking ``preadv``/``pwritev`` at a time; where kernel AIO is unavailable, and for A/B runs.

A request whose buffer is not page aligned, or that moves more than its buffer (a blob's last
block padded to a page for O_DIRECT), goes through an aligned bounce buffer.

The direct-I/O helpers here (:func:`open_direct` with its page-cache fallback, whole-file
``pread``/``pwrite`` loops, page-aligned buffers) are the checkpoint's too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from jax_mlpo.native.aio import AioQueue, AioRequest, AioUnavailableError
from jax_mlpo.native.crc32c import crc32c
from jax_mlpo.tiers.errors import CorruptBlobError

logger = logging.getLogger(__name__)

ALIGN = 4096
HUGE_PAGE = 2 * 2**20  # x86-64's transparent huge page
_READ, _WRITE = 0, 1  # request priorities: reads first


def aligned_empty(n: int, dtype: Any = np.float32, *, huge_pages: bool = True) -> np.ndarray:
    """A 1-D array of ``n`` elements whose data starts on a page (O_DIRECT-ready), zero-filled.

    Private anonymous ``mmap`` memory: page-aligned, and its pages are only committed when
    touched. From 2 MiB up it is advised for transparent huge pages (``MADV_HUGEPAGE``; the
    kernel's default mode here is ``madvise``). Why: the block layer builds one request from
    physically contiguous memory, so over 4 KiB pages an 8 MiB O_DIRECT request reached this
    disk as ~0.6-1.3 MiB requests, over 2 MiB pages as 2-3.4 MiB ones, and with the device's
    queue (256 requests) the bytes in flight, which set this disk's throughput, grew with them:
    a blocking save of 4 GiB of state moved 2.9-3.7 GB/s against 1.4-1.9
    (docs/benchmarks.md). ``mmap.mmap(-1, n)`` alone would be a *shared* mapping (shmem), which
    ``MADV_HUGEPAGE`` does not cover. ``huge_pages=False``: 4 KiB pages, for memory touched
    once, where faulting in fresh huge pages cost more than the larger requests gained.
    """
    nbytes = max(1, n * np.dtype(dtype).itemsize)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        # a kernel without transparent huge pages refuses: 4 KiB pages, as before
        with contextlib.suppress(OSError):
            memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, np.dtype(dtype), count=n)


def round_up_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (what an O_DIRECT request moves)."""
    return -(-nbytes // ALIGN) * ALIGN


def open_direct(path: str, flags: int, direct: bool = True) -> tuple[int, bool]:
    """``path`` opened with O_DIRECT, or through the page cache where the file system has no
    O_DIRECT (tmpfs refuses it with EINVAL) or ``direct`` is False.

    Returns:
      The file descriptor, and whether it is O_DIRECT.
    """
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


class Chunk(NamedTuple):
    """One request of a blob: ``data`` (uint8) at file ``offset``, moving ``moved`` bytes
    (``data.nbytes``, or that padded to a page with zeros)."""

    data: np.ndarray
    offset: int
    moved: int


class Submitter(Protocol):
    def next_blob(self) -> int:
        """A number for a new blob's requests, after every earlier blob's."""

    def move(self, fd: int, chunks: list[Chunk], write: bool, blob: int) -> list[int]:
        """Moves ``chunks`` of ``fd`` and returns their crc32c once all are done.

        Raises:
          CorruptBlobError: a read came back short (the file is truncated).
          OSError: a request failed (ENOSPC for a short write), with the offset in the message.
        """

    def close(self) -> None:
        """Runs what is queued, then stops."""


def submitter(kind: str, depth: int, name: str) -> Submitter:
    """The submitter ``kind`` (``"aio"`` or ``"threads"``); ``"aio"`` falls back to threads,
    with a warning that names the cause, where the kernel refuses an AIO context."""
    if kind == "aio":
        try:
            return AioSubmitter(depth)
        except AioUnavailableError as e:
            logger.warning("%s: %s; using a thread per request instead", name, e)
    return ThreadSubmitter(depth, name)


def _checked(chunk: Chunk, moved: int, write: bool) -> None:
    if moved < 0:
        raise OSError(-moved, f"{os.strerror(-moved)} at byte {chunk.offset}")
    if moved < chunk.moved and write:
        raise OSError(
            errno.ENOSPC, f"short write at byte {chunk.offset} ({moved} of {chunk.moved} bytes)"
        )
    if moved < chunk.moved:
        raise CorruptBlobError(f"short read at byte {chunk.offset}: the file is truncated")


class AioSubmitter:
    """Chunks through one kernel AIO queue of ``depth`` requests."""

    def __init__(self, depth: int) -> None:
        self._queue = AioQueue(depth)
        self._blobs = itertools.count()

    def next_blob(self) -> int:
        return next(self._blobs)

    def move(self, fd: int, chunks: list[Chunk], write: bool, blob: int) -> list[int]:
        results = self._queue.run([AioRequest(fd, *c, write) for c in chunks], blob)
        for chunk, (moved, _) in zip(chunks, results, strict=True):
            _checked(chunk, moved, write)
        return [crc for _, crc in results]

    def close(self) -> None:
        self._queue.close()


class ThreadSubmitter:
    """``depth`` threads that run chunk requests: reads before writes, then by blob, oldest
    first, then FIFO.

    Ordering by blob lets a blob's trailer, queued once its chunks are written, go before the
    chunks of blobs submitted after it instead of behind all of them.
    """

    def __init__(self, depth: int, name: str) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._blobs = itertools.count()
        self._local = threading.local()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(depth)
        ]
        for t in self._threads:
            t.start()

    def next_blob(self) -> int:
        return next(self._blobs)

    def move(self, fd: int, chunks: list[Chunk], write: bool, blob: int) -> list[int]:
        run = self._write if write else self._read
        futures = [self._submit(_WRITE if write else _READ, blob, run, fd, c) for c in chunks]
        # Every request finishes before the first error is raised: they share a file
        # descriptor and buffers that the caller releases next.
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    def _submit(
        self, priority: int, blob: int, fn: Callable[..., Any], *args: Any
    ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((priority, blob, next(self._seq), future, fn, args))
        return future

    def _bounce(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.buf = aligned_empty(max(nbytes, ALIGN), np.uint8)
        return buf[:nbytes]

    def _in_place(self, chunk: Chunk) -> bool:
        """Whether the request can move the caller's buffer itself (no bounce buffer)."""
        address = chunk.data.__array_interface__["data"][0]
        return chunk.moved == chunk.data.nbytes and address % ALIGN == 0

    def _read(self, fd: int, chunk: Chunk) -> int:
        buf = chunk.data if self._in_place(chunk) else self._bounce(chunk.moved)
        _checked(chunk, pread_full(fd, buf, chunk.offset), write=False)
        if buf is not chunk.data:
            chunk.data[:] = buf[: chunk.data.nbytes]
        return crc32c(buf)

    def _write(self, fd: int, chunk: Chunk) -> int:
        buf = chunk.data
        if not self._in_place(chunk):
            buf = self._bounce(chunk.moved)
            buf[: chunk.data.nbytes] = chunk.data
            buf[chunk.data.nbytes :] = 0
        crc = crc32c(buf)
        _checked(chunk, pwrite_full(fd, buf, chunk.offset), write=True)
        return crc

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
        for _ in self._threads:
            self._queue.put((_WRITE + 1, 0, next(self._seq), None, None, ()))
        for t in self._threads:
            t.join()


def pread_full(fd: int, buf: np.ndarray, offset: int) -> int:
    """Reads ``buf.nbytes`` at ``offset`` with as many ``preadv`` as it takes; the bytes read."""
    return _transfer_full(os.preadv, fd, buf, offset)


def pwrite_full(fd: int, buf: np.ndarray, offset: int) -> int:
    """Writes ``buf`` at ``offset`` with as many ``pwritev`` as it takes; the bytes written."""
    return _transfer_full(os.pwritev, fd, buf, offset)


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
