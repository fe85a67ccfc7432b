"""A file tier's kernel-AIO request queue (``ffi/aio_queue.cc``).

Linux kernel AIO (``io_submit``/``io_getevents``, the syscalls DeepSpeed's libaio swapper
makes) in place of a thread per request: up to ``depth`` chunk requests of a tier in the kernel
at once, reads queued before writes, each chunk's crc32c computed by the thread that asked for
it. :meth:`AioQueue.run` blocks with the GIL released until a blob's requests are all done.

Example::

    queue = AioQueue(depth=8)
    results = queue.run([AioRequest(fd, view, 0, view.nbytes, write=True)], blob=0)
    queue.close()
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple

import numpy as np

from jax_mlpo.errors import AioUnavailableError
from jax_mlpo.native.library import NATIVE

__all__ = ["AioQueue", "AioRequest", "AioUnavailableError"]


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
