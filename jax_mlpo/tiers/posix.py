"""The file I/O engine: blobs as files moved with O_DIRECT in concurrent chunks, by kernel AIO.

The default I/O engine of a file tier (``FileTier.io_engine="posix"``), from the blob's file to
the kernel's queue, in the order a request runs through it:

* **Blob files** (:class:`PosixBlobs`). One file per blob, ``<kind>-<slot>.blob``, preallocated
  at its first write (so a full disk fails before any byte of the blob is overwritten) and then
  rewritten in place::

    [0, nbytes)              the blob (float32, little-endian)
    [nbytes, data_end)       zero padding to a 4 KiB boundary (O_DIRECT moves whole blocks)
    [data_end, file end)     trailer: magic, blob bytes, chunk bytes, chunk count, the crc32c of
                             every chunk (the last one's covers the padding), zeros, and in the
                             last 4 bytes the crc32c of the rest of the trailer

  Every byte of the file is covered by a checksum. A blob moves as requests of ``chunk_bytes``
  each, ``queue_depth`` of them in flight per tier, reads served before writes (the update waits
  on reads; write-back only has to finish before its buffer is reused). tensorstore's ``file``
  driver reaches 65-75% of the disk's bandwidth here, so the hot path does its own I/O
  (``io_engine="tensorstore"`` remains for comparison). Each chunk's checksum is computed by the
  thread that asked for it (native crc32c, GIL released) and checked against the trailer on
  every read: a torn write (a crash midway through rewriting a blob) or a flipped bit fails
  loudly instead of feeding the optimizer wrong state. With ``io_mode="direct"`` files are
  opened with O_DIRECT, so state does not churn the page cache; on a file system without
  O_DIRECT (tmpfs) the tier logs it once and uses the page cache.
* **Submitters** (``FileTier.io_submit``): how a blob's chunk requests reach the kernel, with up
  to ``queue_depth`` requests of the tier in flight, reads ahead of writes and older blobs ahead
  of newer ones, each chunk's crc32c returned. :class:`AioSubmitter` (``"aio"``, the default)
  hands them to Linux kernel AIO from C++, the submission path of DeepSpeed's libaio swapper: no
  thread per request, no GIL hand-over per chunk. :class:`ThreadSubmitter` (``"threads"``) runs
  ``queue_depth`` Python threads, each with one blocking ``preadv``/``pwritev`` at a time; where
  kernel AIO is unavailable, and for A/B runs. A request whose buffer is not page aligned, or
  that moves more than its buffer (a blob's last block padded to a page for O_DIRECT), goes
  through an aligned bounce buffer.
* **The kernel AIO queue** (:class:`AioQueue`, ``ffi/aio_queue.cc``): ``io_submit`` and
  ``io_getevents``, the syscalls DeepSpeed's libaio swapper makes, in place of a thread per
  request: up to ``depth`` chunk requests of a tier in the kernel at once, reads queued before
  writes. :meth:`AioQueue.run` blocks with the GIL released until a blob's requests are done.
* **Direct-I/O helpers**, the checkpoint's too: :func:`open_direct` with its page-cache
  fallback, whole-file ``pread``/``pwrite`` loops, page-aligned buffers (:func:`aligned_empty`,
  which every host buffer of the engine is).
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
from typing import Any, NamedTuple, Protocol

import numpy as np

from jax_mlpo.errors import AioUnavailableError
from jax_mlpo.native.kernels import crc32c
from jax_mlpo.native.library import NATIVE
from jax_mlpo.tiers.errors import CorruptBlobError
from jax_mlpo.tiers.file_tier import FileTier

logger = logging.getLogger(__name__)

ALIGN = 4096
HUGE_PAGE = 2 * 2**20  # x86-64's transparent huge page
_READ, _WRITE = 0, 1  # request priorities: reads first
MAGIC = b"JXMLPOB\x01"
_HEADER = struct.Struct("<8sQQI")  # magic, blob bytes, chunk bytes, chunk count

# ---- direct I/O -----------------------------------------------------------------------------


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


# ---- the kernel AIO queue ---------------------------------------------------------------------


class AioRequest(NamedTuple):
    """One chunk request.

    Attributes:
      fd: an open file descriptor.
      data: the caller's bytes (C-contiguous ``uint8``): written from, or read into.
      offset: the file offset (a multiple of 4096 for O_DIRECT).
      moved: bytes the request moves, ``data.nbytes`` or more: a blob's last block padded to a
        whole page (zeros written; the padding read is dropped).
      write: a write, else a read.
    """

    fd: int
    data: np.ndarray
    offset: int
    moved: int
    write: bool


class AioQueue:
    """A kernel AIO context with ``depth`` requests in flight, shared by its callers' threads.

    Args:
      depth: requests in the kernel at once.

    Raises:
      AioUnavailableError: the kernel refused the context; its errno says why.
    """

    def __init__(self, depth: int) -> None:
        try:
            self._handle = NATIVE.AioContext(int(depth))
        except OSError as e:
            raise AioUnavailableError(
                e.errno,
                f"kernel AIO is not available ({os.strerror(e.errno)}); raise "
                "fs.aio-max-nr (sysctl) if it is used up, or use FileTier(io_submit='threads')",
            ) from None
        self._users = 0  # run() calls under way: close() must not free the queue under them
        self._lock = threading.Condition()

    def run(self, requests: list[AioRequest], blob: int) -> list[tuple[int, int]]:
        """Moves ``requests`` and waits for all of them.

        Args:
          requests: the chunk requests (their arrays must stay alive until this returns).
          blob: the requests' place among queued ones of the same direction (smaller first).

        Returns:
          Per request, ``(bytes moved or -errno, crc32c of the bytes moved)``; fewer bytes than
          ``moved`` means the end of the file or a full disk.
        """
        for r in requests:
            if r.data.dtype != np.uint8 or not r.data.flags.c_contiguous:
                raise ValueError("an AIO request's data must be C-contiguous uint8")
            if r.moved < r.data.nbytes:
                raise ValueError(f"a request moves {r.moved} bytes of {r.data.nbytes}")
            if not r.write and not r.data.flags.writeable:
                raise ValueError("a read request's data is read-only")
        with self._lock:
            if self._handle is None:
                raise ValueError("the AIO queue is closed")
            self._users += 1
        try:
            return self._handle.run(requests, int(blob))
        finally:
            with self._lock:
                self._users -= 1
                self._lock.notify_all()

    def close(self) -> None:
        """Waits for running calls, then frees the context."""
        with self._lock:
            self._lock.wait_for(lambda: self._users == 0)
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()


# ---- submitters ------------------------------------------------------------------------------


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


# ---- blob files -------------------------------------------------------------------------------


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
        self._direct = tier.effective_io_mode == "direct"
        self._sync = tier.sync
        # A blob file left by an earlier run is not this run's state: start clean, as a fresh
        # zarr array would (restoring goes through checkpoints, never through tier files).
        for kind in kinds:
            for stale in glob.glob(os.path.join(glob.escape(directory), f"{kind}-*.blob")):
                os.unlink(stale)
        self._submit = submitter(
            tier.io_submit, tier.queue_depth, f"jax_mlpo-io-{os.path.basename(directory)}"
        )

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
        return count, round_up_pages(nbytes), round_up_pages(_HEADER.size + 4 * count + 4)

    def _requests(self, view: np.ndarray) -> list[Chunk]:
        """The chunk requests of a blob's bytes; the last one moves the padding too."""
        return [
            Chunk(view[o : o + n], o, round_up_pages(n) if o + n == view.nbytes else n)
            for o, n in self._chunks(view.nbytes)
        ]

    def _open(self, path: str, flags: int) -> int:
        fd, direct = open_direct(path, flags, self._direct)
        if self._direct and not direct:
            self._direct = False
            logger.warning(
                "%s does not support O_DIRECT (tmpfs?); this tier uses the page cache",
                self.directory,
            )
        return fd

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
            blob = self._submit.next_blob()
            raw = np.zeros(trailer_bytes, np.uint8)
            trailer = Chunk(raw, trailer_at, trailer_bytes)
            crcs = self._submit.move(fd, [trailer, *self._requests(view)], False, blob)[1:]
        finally:
            os.close(fd)
        stored = _parse_trailer(raw.tobytes(), path, nbytes, self._chunk, count)
        bad = [i for i, (a, b) in enumerate(zip(crcs, stored, strict=True)) if a != b]
        if bad:
            raise CorruptBlobError(
                f"{path}: {len(bad)} of {count} chunks fail their crc32c (first: chunk {bad[0]}, "
                f"bytes {bad[0] * self._chunk}-{min(nbytes, (bad[0] + 1) * self._chunk)}); "
                "corrupted, or a write was cut short"
            )

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
            blob = self._submit.next_blob()
            crcs = self._submit.move(fd, self._requests(view), True, blob)
            trailer = np.zeros(trailer_bytes, np.uint8)
            body = _HEADER.pack(MAGIC, nbytes, self._chunk, count) + struct.pack(
                f"<{count}I", *crcs
            )
            trailer[: len(body)] = np.frombuffer(body, np.uint8)
            trailer[-4:] = np.frombuffer(struct.pack("<I", crc32c(trailer[:-4])), np.uint8)
            # The trailer goes last: until it lands, a reader sees the old checksums and reports
            # a half-written blob rather than reading it as valid.
            self._submit.move(fd, [Chunk(trailer, trailer_at, trailer_bytes)], True, blob)
            if self._sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def damage(self, slot: int, kind: str) -> None:
        """Flips a bit of the blob's first byte in its file (fault injection).

        Raises:
          FileNotFoundError: the blob was never written.
        """
        flip_first_byte(self.path(slot, kind))

    def discard(self, slot: int, kind: str) -> None:
        """Deletes the blob's file (a later read fails as never written)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(slot, kind))

    def close(self) -> None:
        self._submit.close()


def flip_first_byte(path: str) -> None:
    """Flips the lowest bit of a file's first byte, through the page cache and synced (an
    O_DIRECT read of the range afterwards sees it: the kernel writes the cached page first)."""
    fd = os.open(path, os.O_RDWR)
    try:
        first = os.pread(fd, 1, 0)
        os.pwrite(fd, bytes([first[0] ^ 0x01]), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


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
