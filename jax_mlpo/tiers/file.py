"""A file tier: subgroup blobs in a zarr3 array on tensorstore's ``file`` driver.

Each tier directory holds a zarr3 array ``<kind>-<n>`` of shape ``(blobs, n)`` float32 per kind of
blob and blob length ``n`` (usually two lengths: full subgroups and the shorter last one), with
one chunk per blob, so every subgroup blob is one file of exactly its size, written and read whole
(large sequential I/O). The ``crc32c`` codec stores a checksum with every chunk and tensorstore
verifies it on every read. Requests run on a per-tier thread pool, each holding a read or write
permit (:mod:`jax_mlpo.tiers.permits`) and blocking in tensorstore with the GIL released.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any

import numpy as np
import tensorstore as ts

from jax_mlpo.config import FileTier
from jax_mlpo.tiers.lock import TierLock
from jax_mlpo.tiers.permits import TierPermits


class TierIOError(OSError):
    """A read or write on a tier failed; the message names the tier, the file and what to do."""


class CorruptBlobError(TierIOError):
    """A blob failed its checksum: what is on disk is not what was written."""


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
        with self._lock:
            start = max(time.monotonic(), self._next)
            self._next = start + nbytes / self.rate
            return self._next

    @staticmethod
    def wait_until(deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def context_spec(tier: FileTier) -> dict[str, Any]:
    """The tensorstore context of a tier: its own I/O concurrency, sync and mode, no cache."""
    return {
        "file_io_concurrency": {"limit": tier.max_concurrency},
        "file_io_sync": tier.sync,
        "file_io_mode": {"mode": tier.io_mode},
        "cache_pool": {"total_bytes_limit": 0},
    }


def array_spec(path: str, slots: int, slot_elems: int, chunk_elems: int) -> dict[str, Any]:
    """The zarr3 spec of a tier's blob array: a row per slot, cut into checksummed chunks of at
    most ``chunk_elems`` (so one blob is several requests in flight)."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        # An all-zero blob (fresh moments) is still written: the file is the state, not a hint.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": [slots, slot_elems],
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [1, min(slot_elems, chunk_elems)]},
            },
            "data_type": "float32",
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
            "fill_value": 0,
        },
    }


class FileTierStore:
    """The open, locked blob arrays of one :class:`~jax_mlpo.config.FileTier`.

    A tier holds blobs of several kinds: ``"state"`` (a subgroup's ``[p | m | v]``), ``"grad"``
    (fp32 gradients, only when gradient conversion is not delayed) and ``"probe"`` (bandwidth
    probe). Slot ``i`` of a kind is subgroup ``i``; any tier can hold any subgroup (zarr3 stores
    only the chunks written), which lets placement move a subgroup by writing it elsewhere.

    Args:
      tier: the tier's configuration.
      kinds: for each kind, the float32 length of each slot's blob.
      permits: read/write permits of this tier (in the process and on the node).
    """

    def __init__(self, tier: FileTier, kinds: dict[str, list[int]], permits: TierPermits) -> None:
        self.tier = tier
        self.directory = os.path.abspath(os.path.expanduser(tier.path))
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._lock = TierLock(self.directory)
        self.permits = permits
        self.bytes_read = 0
        self.bytes_written = 0
        self.busy_s = 0.0  # wall time with at least one request of this tier in flight
        self._active = 0
        self._since = 0.0
        self._stats_lock = threading.Lock()
        self.trace: list[tuple[str, int, float, float]] | None = None
        self._bucket = TokenBucket(tier.bandwidth_cap) if tier.bandwidth_cap else None
        workers = 2 * tier.max_concurrency  # reads and writes have their own permits
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=f"jax_mlpo-tier-{os.path.basename(tier.path)}"
        )
        # (kind, slot) -> (array, row); one array per kind and blob length, rows per length
        self._where: dict[str, list[tuple[int, int]]] = {}
        self._arrays: list[ts.TensorStore] = []
        self._names: list[str] = []
        try:
            context = ts.Context(context_spec(tier))
            for kind, lengths in kinds.items():
                sizes = sorted(set(lengths))
                counts = dict.fromkeys(sizes, 0)
                where = []
                for n in lengths:
                    where.append((len(self._arrays) + sizes.index(n), counts[n]))
                    counts[n] += 1
                self._where[kind] = where
                for n in sizes:
                    name = f"{kind}-{n}"
                    spec = array_spec(
                        os.path.join(self.directory, name), counts[n], n, tier.chunk_bytes // 4
                    )
                    self._arrays.append(
                        ts.open(spec, create=True, delete_existing=True, context=context).result()
                    )
                    self._names.append(name)
        except Exception as e:
            self.close()
            raise TierIOError(self._explain(e, "creating the blob arrays in")) from e

    def blob_path(self, slot: int, kind: str = "state") -> str:
        array, row = self._where[kind][slot]
        return os.path.join(self.directory, self._names[array], "c", str(row), "0")

    def read(self, slot: int, out: np.ndarray, kind: str = "state") -> concurrent.futures.Future:
        """Reads blob ``slot`` of ``kind`` into ``out`` (float32, 1-D, its length), async."""
        return self._pool.submit(self._read, slot, out, kind)

    def write(self, slot: int, data: np.ndarray, kind: str = "state") -> concurrent.futures.Future:
        """Writes ``data`` as blob ``slot`` of ``kind``; the future resolves once it is durable.

        ``data`` must not change until the future resolves.
        """
        return self._pool.submit(self._write, slot, data, kind)

    def _blob(self, slot: int, kind: str) -> ts.TensorStore:
        array, row = self._where[kind][slot]
        return self._arrays[array][row]

    def _read(self, slot: int, out: np.ndarray, kind: str) -> None:
        with self.permits.hold("read"):
            deadline = self._bucket.reserve(out.nbytes) if self._bucket else 0.0
            t0 = self._begin()
            try:
                ts.array(out, copy=False).write(self._blob(slot, kind)).result()
                if self._bucket:
                    self._bucket.wait_until(deadline)
            except Exception as e:
                cls = CorruptBlobError if "DATA_LOSS" in str(e) else TierIOError
                raise cls(
                    self._explain(e, f"reading blob {self.blob_path(slot, kind)} from")
                ) from e
            finally:
                self._end("read", kind, slot, t0, out.nbytes)

    def _write(self, slot: int, data: np.ndarray, kind: str) -> None:
        with self.permits.hold("write"):
            deadline = self._bucket.reserve(data.nbytes) if self._bucket else 0.0
            t0 = self._begin()
            try:
                self._blob(slot, kind).write(data).result()
                if self._bucket:
                    self._bucket.wait_until(deadline)
            except Exception as e:
                raise TierIOError(
                    self._explain(e, f"writing blob {self.blob_path(slot, kind)} to")
                ) from e
            finally:
                self._end("write", kind, slot, t0, data.nbytes)

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
                self.busy_s += now - self._since
            if direction == "read":
                self.bytes_read += nbytes
            else:
                self.bytes_written += nbytes
            if self.trace is not None:  # ("read" | "write" [+ "-grad" / "-probe"], slot, t0, t1)
                name = direction if kind == "state" else f"{direction}-{kind}"
                self.trace.append((name, slot, t0, now))

    def _explain(self, error: Exception, doing: str) -> str:
        text = str(error)
        if "DATA_LOSS" in text:
            hint = (
                "the blob on disk does not match its checksum (corrupted or half-written). "
                "Restore the optimizer state from your last checkpoint."
            )
        elif "No space left" in text or "ENOSPC" in text:
            hint = (
                "the file system is full. Free space there or configure another tier, then "
                "restore the optimizer state from your last checkpoint (an update that failed "
                "midway leaves it partly updated)."
            )
        elif "Permission denied" in text or "EACCES" in text:
            hint = "permission denied. Fix the directory's permissions or choose another path."
        else:
            hint = "check that the file system is mounted, writable and healthy."
        return f"tier {self.tier.path!r}: error {doing} the tier: {text}. Cause: {hint}"

    def close(self) -> None:
        """Waits for in-flight I/O and releases the tier's lock and permits."""
        self._pool.shutdown(wait=True)
        self.permits.close()
        self._lock.release()
