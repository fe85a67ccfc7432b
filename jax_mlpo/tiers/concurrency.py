"""Concurrency control per tier (MLP-Offload principle): permits and rate caps.

Read and write permits bound a tier's requests in flight, in the process and across a node;
token buckets cap its bytes per second, in the process or shared by a node.

In the process, a bounded semaphore per direction caps the requests in flight on a tier. Across
the processes of a node, ``n`` lock files per tier and direction in a
shared directory act as a counting semaphore: a request holds an ``flock`` on one of them. The
kernel releases an ``flock`` when its holder dies, so a crashed process never leaks a permit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
import threading
import time
from collections.abc import Iterator


class NodePermits:
    """``count`` permits shared by every process of a node that uses the same ``directory``.

    Args:
      directory: a directory on a node-local file system (e.g. ``/dev/shm/jax_mlpo``).
      key: what the permits guard (a tier path and a direction).
      count: how many holders at once.
    """

    def __init__(self, directory: str, key: str, count: int) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        self.paths = [os.path.join(directory, f"{digest}.{k}.lock") for k in range(count)]
        self._fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in self.paths]
        # flock is per open file description: threads of this process must not share one slot
        self._local = [threading.Lock() for _ in self.paths]

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        delay = 1e-4
        while True:
            for fd, local in zip(self._fds, self._local, strict=True):
                if not local.acquire(blocking=False):
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    local.release()
                    continue
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    local.release()
                return
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class TierPermits:
    """Read and write permits of one tier.

    Args:
      key: the tier's path (names the node-level lock files).
      reads: read requests in flight in this process.
      writes: write requests in flight in this process.
      node_dir: directory of the node-level permits, or None for none.
      node_reads, node_writes: requests in flight across all processes of the node.
      node_shared: reads and writes draw on one node-level pool of ``node_reads`` permits (at
        most that many requests of the node's processes in the tier, whatever their direction)
        instead of a pool per direction.
    """

    def __init__(
        self,
        key: str,
        reads: int,
        writes: int,
        node_dir: str | None = None,
        node_reads: int = 1,
        node_writes: int = 1,
        node_shared: bool = False,
    ) -> None:
        self._local = {"read": threading.BoundedSemaphore(reads),
                       "write": threading.BoundedSemaphore(writes)}  # fmt: skip
        self._node: dict[str, NodePermits] | None = None
        if node_dir and node_shared:
            shared = NodePermits(node_dir, f"{key}:any", node_reads)
            self._node = {"read": shared, "write": shared}
        elif node_dir:
            self._node = {
                "read": NodePermits(node_dir, f"{key}:read", node_reads),
                "write": NodePermits(node_dir, f"{key}:write", node_writes),
            }
        self.wait_s = {"read": 0.0, "write": 0.0}

    @contextlib.contextmanager
    def hold(self, direction: str) -> Iterator[None]:
        t0 = time.monotonic()
        with self._local[direction]:
            if self._node is None:
                self.wait_s[direction] += time.monotonic() - t0
                yield
                return
            with self._node[direction].hold():
                self.wait_s[direction] += time.monotonic() - t0
                yield

    def close(self) -> None:
        if self._node:
            for permits in {id(p): p for p in self._node.values()}.values():
                permits.close()


class TokenBucket:
    """Paces transfers to ``rate`` bytes/s across all threads of a tier.

    Each transfer reserves ``nbytes / rate`` seconds on a shared virtual clock and, once its real
    I/O is done, sleeps until its reservation ends: the tier never exceeds the cap, and a disk
    slower than the cap is not slowed further.
    """

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Returns the monotonic time at which a transfer of ``nbytes`` may complete."""
        return self.reserve_span(nbytes)[1]

    def reserve_span(self, nbytes: int) -> tuple[float, float]:
        """Reserves ``nbytes / rate`` seconds of the clock for a transfer of ``nbytes``.

        Returns:
          The reservation's (start, end) in ``time.monotonic()`` seconds: it starts when the
          previous one ends, or now if that is later (idle time is not banked as credit); the
          transfer may complete at its end.
        """
        with self._lock:
            start = max(time.monotonic(), self._next)
            self._next = start + nbytes / self.rate
            return start, self._next

    @staticmethod
    def wait_until(deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class NodeTokenBucket(TokenBucket):
    """:class:`TokenBucket` pacing shared by every process of a node (``node_bandwidth_cap``).

    The virtual clock (a float64 ``time.monotonic()`` value: one clock for the whole machine on
    Linux) lives in a file on a node-local file system; ``reserve`` reads and advances it under
    an exclusive ``flock``, so the transfers of all processes queue on one clock and together
    never exceed ``rate``.

    Args:
      path: the clock's file (created).
      rate: bytes per second of the shared device.
    """

    def __init__(self, path: str, rate: float) -> None:
        super().__init__(rate)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def reserve_span(self, nbytes: int) -> tuple[float, float]:
        with self._lock:  # flock belongs to the open file: this process's threads take turns
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, 8, 0)
                start = time.monotonic()
                if len(raw) == 8:
                    start = max(start, struct.unpack("<d", raw)[0])
                deadline = start + nbytes / self.rate
                os.pwrite(self._fd, struct.pack("<d", deadline), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return start, deadline

    def close(self) -> None:
        os.close(self._fd)
