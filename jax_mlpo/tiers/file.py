"""A tier store: blobs read and written asynchronously under the tier's permits and rate caps.

:class:`FileTierStore` is what the engine sees of a tier: ``read``/``write`` of whole blobs as
futures, each holding a read or write permit and paced by the tier's bandwidth cap, with byte
counts, busy time and an optional trace. The bytes move through the tier's I/O engine:
:mod:`jax_mlpo.tiers.posix` (chunked ``pread``/``pwrite`` with O_DIRECT, the default),
:mod:`jax_mlpo.tiers.zarr` (tensorstore) or :mod:`jax_mlpo.tiers.kvstore` (an object store).
Errors name the tier, the blob's file, the cause and what to do.

Concurrency control per tier (MLP-Offload principle) acts on every request a store issues.
Read and write permits (:class:`TierPermits`) bound a tier's requests in flight, in the process
and across a node; token buckets (:class:`TokenBucket`, :class:`NodeTokenBucket`) cap its bytes
per second, in the process or shared by a node. In the process, a bounded semaphore per
direction caps the requests in flight on a tier. Across the processes of a node, ``n`` lock
files per tier and direction in a shared directory act as a counting semaphore
(:class:`NodePermits`): a request holds an ``flock`` on one of them. The kernel releases an
``flock`` when its holder dies, so a crashed process never leaks a permit.

Every blob request passes through :meth:`FileTierStore._read` or :meth:`FileTierStore._write`,
which consult ``FileTierStore.faults`` (a :class:`~jax_mlpo.tiers.faults.FaultPlan`, None unless
a test attached one through :mod:`jax_mlpo.testing`) before the I/O.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import os
import struct
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from jax.profiler import TraceAnnotation

from jax_mlpo.tiers import kvstore
from jax_mlpo.tiers.errors import CorruptBlobError, TierFullError, TierIOError
from jax_mlpo.tiers.file_tier import FileTier
from jax_mlpo.tiers.lock import TierLock
from jax_mlpo.tiers.object_tier import ObjectTier
from jax_mlpo.tiers.posix import PosixBlobs
from jax_mlpo.tiers.zarr import ZarrBlobs

if TYPE_CHECKING:
    from jax_mlpo.tiers.faults import FaultPlan

__all__ = [
    "CorruptBlobError",
    "FileTierStore",
    "NodePermits",
    "NodeTokenBucket",
    "TierFullError",
    "TierIOError",
    "TierPermits",
    "TokenBucket",
    "open_store",
]

# ---- concurrency control: permits and rate caps ---------------------------------------------


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


# ---- the store --------------------------------------------------------------------------------


def _is_full(error: BaseException | None) -> bool:
    """Whether ``error`` or one of its causes is ``ENOSPC`` (a full file system)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        error = error.__cause__ or error.__context__
    return False


def _trace_name(direction: str, kind: str) -> str:
    """A request's name in the traces: ``"read"``/``"write"``, ``"-grad"``/``"-probe"`` added
    for those kinds (both state kinds are the subgroup's state)."""
    return direction if kind.startswith("state") else f"{direction}-{kind}"


class FileTierStore:
    """The open, locked blobs of one tier: a :class:`~jax_mlpo.config.FileTier` directory, or
    an :class:`~jax_mlpo.tiers.object_tier.ObjectTier` prefix (``directory`` is then None).

    A tier holds blobs of several kinds: ``"state"`` (a subgroup's ``[p | m | v]``), ``"grad"``
    (fp32 gradients, only when gradient conversion is not delayed) and ``"probe"`` (bandwidth
    probe). Slot ``i`` of a kind is subgroup ``i``; any tier can hold any subgroup (a blob takes
    space once written), which lets placement move a subgroup by writing it elsewhere.

    Args:
      tier: the tier's configuration.
      kinds: for each kind, the float32 length of each slot's blob.
      permits: read/write permits of this tier (in the process and on the node).
      node_dir: node-local directory for the shared pacing clock of ``node_bandwidth_cap``.

    Attributes:
      trace: None, or a list each finished request is appended to as ``(name, slot, t0, t1)``
        (``name``: ``"read"``/``"write"``, with ``"-grad"``/``"-probe"`` for those kinds;
        ``time.monotonic()`` at its start, after its permit and pacing reservation, and at its
        end).
      pacing: None, or a list each request paced by the bandwidth cap is appended to as
        ``(name, slot, start, end)``: its reservation on the cap's clock (the request ends at
        ``end`` at the earliest; reservations of one clock do not overlap).
      faults: None, or the :class:`~jax_mlpo.tiers.faults.FaultPlan` every request consults
        before its I/O (:mod:`jax_mlpo.testing`).
    """

    def __init__(
        self,
        tier: FileTier | ObjectTier,
        kinds: dict[str, list[int]],
        permits: TierPermits,
        node_dir: str | None = None,
    ) -> None:
        self.tier = tier
        self._kvstore = None
        if isinstance(tier, ObjectTier):  # a prefix, not a directory
            self.directory = None
            try:
                self._kvstore = kvstore.open_kvstore(tier)
                self._lock = kvstore.ObjectLock(tier, self._kvstore)
            except ValueError as e:
                raise TierIOError(self._explain(e, "opening")) from e
        else:
            self.directory = os.path.abspath(os.path.expanduser(tier.path))
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                self._lock = TierLock(self.directory)
            except OSError as e:  # the directory went read-only (or away) since validation
                raise TierIOError(self._explain(e, "locking the directory of")) from e
        self.permits = permits
        self.bytes_read = 0
        self.bytes_written = 0
        self._busy_s = 0.0  # wall time with at least one request in flight, until the last idle
        self._active = 0
        self._since = 0.0
        self._stats_lock = threading.Lock()
        self.trace: list[tuple[str, int, float, float]] | None = None
        self.pacing: list[tuple[str, int, float, float]] | None = None
        self.faults: FaultPlan | None = None
        self._bucket: TokenBucket | None = None
        try:
            limits = tier.limits
            if limits.node_bandwidth_cap:
                key = hashlib.sha1((limits.permits_key or tier.path).encode()).hexdigest()[:16]
                clock = os.path.join(node_dir or "/dev/shm/jax_mlpo", f"{key}.bucket")
                self._bucket = NodeTokenBucket(clock, limits.node_bandwidth_cap)
            elif limits.bandwidth_cap:
                self._bucket = TokenBucket(limits.bandwidth_cap)
        except BaseException:
            self._lock.release()  # an object tier's lock object would outlive this process
            raise
        workers = 2 * tier.limits.max_concurrency  # reads and writes have their own permits
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=f"jax_mlpo-tier-{os.path.basename(tier.path)}"
        )
        self._blobs: PosixBlobs | ZarrBlobs | kvstore.KvstoreBlobs | None = None
        try:
            if self._kvstore is not None:
                self._blobs = kvstore.KvstoreBlobs(tier, kinds, self._kvstore)
            else:
                engine = PosixBlobs if tier.io_engine == "posix" else ZarrBlobs
                self._blobs = engine(self.directory, tier, kinds)
        except Exception as e:
            self.close()
            raise TierIOError(self._explain(e, "creating the blob files in")) from e

    @property
    def where(self) -> str:
        """The tier's path (names the store in a fault plan's trace)."""
        return self.tier.path

    def blob_path(self, slot: int, kind: str = "state") -> str:
        """The file that holds blob ``slot`` of ``kind`` (its first chunk for tensorstore)."""
        return self._blobs.path(slot, kind)

    def blob_files(self, slot: int, kind: str = "state") -> list[str]:
        """Every file that holds a part of blob ``slot`` of ``kind``."""
        return self._blobs.files(slot, kind)

    def read(self, slot: int, out: np.ndarray, kind: str = "state") -> concurrent.futures.Future:
        """Reads blob ``slot`` of ``kind`` into ``out`` (float32, 1-D, its length), async."""
        return self._pool.submit(self._read, slot, out, kind)

    def write(self, slot: int, data: np.ndarray, kind: str = "state") -> concurrent.futures.Future:
        """Writes ``data`` as blob ``slot`` of ``kind``; the future resolves once it is durable.

        ``data`` must not change until the future resolves.
        """
        return self._pool.submit(self._write, slot, data, kind)

    def discard(self, slot: int, kind: str = "state") -> None:
        """Deletes blob ``slot`` of ``kind``, a copy nobody will read again, to free its space.

        The tensorstore engine keeps it (its rows share arrays); it is overwritten in place by
        the next write of that slot and kind.
        """
        discard = getattr(self._blobs, "discard", None)
        if discard is not None:
            discard(slot, kind)

    def damage_blob(self, slot: int, kind: str = "state") -> None:
        """Flips a bit of stored blob ``slot`` of ``kind``, as bit rot would (fault injection:
        :meth:`jax_mlpo.tiers.faults.FaultPlan.corrupt`); its next read fails its checksum."""
        self._blobs.damage(slot, kind)

    @property
    def bandwidth_cap(self) -> float | None:
        """Bytes per second this process paces the tier to (None: no cap)."""
        bucket = self._bucket
        return bucket.rate if bucket is not None else None

    def set_bandwidth_cap(self, rate: float | None) -> None:
        """Changes the tier's bandwidth cap from the next request on, as a device that slows
        down or recovers would (a ``node_bandwidth_cap`` clock stays shared: this process's
        reservations on it take the new rate).

        Args:
          rate: bytes per second; None removes the cap.

        Raises:
          ValueError: if ``rate`` is not positive.
        """
        if rate is None:
            if self._bucket is not None and not isinstance(self._bucket, NodeTokenBucket):
                self._bucket = None
            elif self._bucket is not None:
                raise ValueError(
                    f"tier {self.tier.path!r}: a node_bandwidth_cap clock cannot be removed "
                    "while the tier is open; give it another rate"
                )
            return
        if not rate > 0:
            raise ValueError(f"tier {self.tier.path!r}: bandwidth cap {rate!r} must be positive")
        if self._bucket is None:
            self._bucket = TokenBucket(rate)
        else:
            self._bucket.rate = float(rate)

    def _read(self, slot: int, out: np.ndarray, kind: str) -> None:
        # the request, from its wait for a permit on, beside XLA's ops in a jax.profiler trace
        annotation = TraceAnnotation("jax_mlpo.tier_read", subgroup=slot, kind=kind)
        with annotation, self.permits.hold("read"):
            bucket = self._bucket  # set_bandwidth_cap may replace it meanwhile
            deadline = self._pace(bucket, "read", kind, slot, out.nbytes)
            t0 = self._begin()
            try:
                if self.faults is not None:
                    self.faults.before(self, "read", slot, kind)
                self._blobs.read(slot, kind, out)
                if bucket is not None:
                    bucket.wait_until(deadline)
            except Exception as e:
                cls = CorruptBlobError if isinstance(e, CorruptBlobError) else TierIOError
                raise cls(
                    self._explain(e, f"reading blob {self.blob_path(slot, kind)} from")
                ) from e
            finally:
                self._end("read", kind, slot, t0, out.nbytes)

    def _write(self, slot: int, data: np.ndarray, kind: str) -> None:
        annotation = TraceAnnotation("jax_mlpo.tier_write", subgroup=slot, kind=kind)
        with annotation, self.permits.hold("write"):
            bucket = self._bucket
            deadline = self._pace(bucket, "write", kind, slot, data.nbytes)
            t0 = self._begin()
            try:
                if self.faults is not None:
                    self.faults.before(self, "write", slot, kind)
                self._blobs.write(slot, kind, data)
                if bucket is not None:
                    bucket.wait_until(deadline)
            except Exception as e:
                cls = TierFullError if _is_full(e) else TierIOError
                raise cls(self._explain(e, f"writing blob {self.blob_path(slot, kind)} to")) from e
            finally:
                self._end("write", kind, slot, t0, data.nbytes)

    def _pace(
        self, bucket: TokenBucket | None, direction: str, kind: str, slot: int, nbytes: int
    ) -> float:
        """Reserves the request's time on the cap's clock; the time it may end (0: no cap)."""
        if bucket is None:
            return 0.0
        start, end = bucket.reserve_span(nbytes)
        if self.pacing is not None:
            self.pacing.append((_trace_name(direction, kind), slot, start, end))
        return end

    @property
    def busy_s(self) -> float:
        """Wall time so far with at least one request of this tier in flight (the current busy
        period included, so differences over any window are exact)."""
        with self._stats_lock:
            current = time.monotonic() - self._since if self._active else 0.0
            return self._busy_s + current

    def _begin(self) -> float:
        now = time.monotonic()
        with self._stats_lock:
            if self._active == 0:
                self._since = now
            self._active += 1
        return now

    def _end(self, direction: str, kind: str, slot: int, t0: float, nbytes: int) -> None:
        now = time.monotonic()
        with self._stats_lock:
            self._active -= 1
            if self._active == 0:
                self._busy_s += now - self._since
            if direction == "read":
                self.bytes_read += nbytes
            else:
                self.bytes_written += nbytes
            if self.trace is not None:
                self.trace.append((_trace_name(direction, kind), slot, t0, now))

    def _explain(self, error: Exception, doing: str) -> str:
        text = str(error)
        remote = kvstore.explain(self.tier, error) if isinstance(self.tier, ObjectTier) else None
        if remote is not None:
            hint = remote
        elif isinstance(error, CorruptBlobError):
            hint = (
                "the blob on disk does not match its checksum (corrupted or half-written). "
                "Restore the optimizer state from your last checkpoint."
            )
        elif _is_full(error):
            hint = (
                "the file system is full. Free space there or configure another tier, then "
                "restore the optimizer state from your last checkpoint (an update that failed "
                "midway leaves it partly updated)."
            )
        elif isinstance(error, FileNotFoundError):
            hint = (
                "the blob's file is missing (deleted, or the tier directory was replaced while "
                "in use). Restore the optimizer state from your last checkpoint."
            )
        elif isinstance(error, OSError) and error.errno == errno.EROFS:
            hint = (
                "the tier's file system is read-only (mounted read-only, or remounted so after "
                "a device error). Choose a writable directory, or remount it read-write."
            )
        elif "Permission denied" in text or "EACCES" in text:
            hint = "permission denied. Fix the directory's permissions or choose another path."
        else:
            hint = "check that the file system is mounted, writable and healthy."
        return f"tier {self.tier.path!r}: error {doing} the tier: {text}. Cause: {hint}"

    def close(self) -> None:
        """Waits for in-flight I/O and releases the tier's lock and permits."""
        self._pool.shutdown(wait=True)
        if self._blobs is not None:
            self._blobs.close()
        if isinstance(self._bucket, NodeTokenBucket):
            self._bucket.close()
        self.permits.close()
        self._lock.release()


def open_store(
    tier: FileTier | ObjectTier, kinds: dict[str, list[int]], node_permits_dir: str
) -> FileTierStore:
    """Opens a tier with its permits: ``max_concurrency`` reads and as many writes in the
    process, and ``node_max_concurrency`` for all processes of the node when set.

    Args:
      tier: the tier's configuration.
      kinds: for each blob kind, the float32 length of each slot's blob.
      node_permits_dir: ``OffloadConfig.node_permits_dir`` (node-local lock files and clocks).
    """
    limits = tier.limits
    node = limits.node_max_concurrency
    permits = TierPermits(
        limits.permits_key or tier.path,
        limits.max_concurrency,
        limits.max_concurrency,
        node_permits_dir if node else None,
        node or 1,
        node or 1,
        node_shared=limits.node_permits == "tier",
    )
    try:
        return FileTierStore(tier, kinds, permits, node_permits_dir)
    except BaseException:
        permits.close()  # the store never took them (its own close would have)
        raise
