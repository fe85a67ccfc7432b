"""A file tier: subgroup blobs in a zarr3 array on tensorstore's ``file`` driver.

Each tier directory holds a zarr3 array ``state-<n>`` of shape ``(blobs, n)`` float32 per blob
length ``n`` (usually two: full subgroups and the shorter last one), with one chunk per blob, so
every subgroup blob is one file of exactly its size, written and read whole (large sequential
I/O). The ``crc32c`` codec stores a checksum with every chunk and tensorstore verifies it on every
read. I/O runs on a per-tier thread pool whose size bounds the requests in flight; each request
blocks in tensorstore with the GIL released.
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


def array_spec(path: str, slots: int, slot_elems: int) -> dict[str, Any]:
    """The zarr3 spec of a tier's blob array: one checksummed chunk per slot."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        # An all-zero blob (fresh moments) is still written: the file is the state, not a hint.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": [slots, slot_elems],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, slot_elems]}},
            "data_type": "float32",
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
            "fill_value": 0,
        },
    }


class FileTierStore:
    """The open, locked state array of one :class:`~jax_mlpo.config.FileTier`.

    Args:
      tier: the tier's configuration.
      blob_elems: float32 elements of each blob (slot) it holds.
    """

    def __init__(self, tier: FileTier, blob_elems: list[int]) -> None:
        self.tier = tier
        self.directory = os.path.abspath(os.path.expanduser(tier.path))
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._lock = TierLock(self.directory)
        self.bytes_read = 0
        self.bytes_written = 0
        self.trace: list[tuple[str, int, float, float]] | None = None
        self._bucket = TokenBucket(tier.bandwidth_cap) if tier.bandwidth_cap else None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            tier.max_concurrency, thread_name_prefix=f"jax_mlpo-tier-{os.path.basename(tier.path)}"
        )
        sizes = sorted(set(blob_elems))
        # slot -> (array, row); rows are numbered per blob length
        self._where: list[tuple[int, int]] = []
        counts = dict.fromkeys(sizes, 0)
        for n in blob_elems:
            self._where.append((sizes.index(n), counts[n]))
            counts[n] += 1
        try:
            context = ts.Context(context_spec(tier))
            self._arrays = [
                ts.open(
                    array_spec(os.path.join(self.directory, f"state-{n}"), counts[n], n),
                    create=True,
                    delete_existing=True,
                    context=context,
                ).result()
                for n in sizes
            ]
        except Exception as e:
            self.close()
            raise TierIOError(self._explain(e, "creating the state arrays in")) from e

    def blob_path(self, slot: int) -> str:
        array, row = self._where[slot]
        name = f"state-{self._arrays[array].shape[1]}"
        return os.path.join(self.directory, name, "c", str(row), "0")

    def read(self, slot: int, out: np.ndarray) -> concurrent.futures.Future:
        """Reads blob ``slot`` into ``out`` (float32, 1-D, its length) asynchronously."""
        return self._pool.submit(self._read, slot, out)

    def write(self, slot: int, data: np.ndarray) -> concurrent.futures.Future:
        """Writes ``data`` as blob ``slot``; the future resolves once it is durable.

        ``data`` must not change until the future resolves.
        """
        return self._pool.submit(self._write, slot, data)

    def _blob(self, slot: int) -> ts.TensorStore:
        array, row = self._where[slot]
        return self._arrays[array][row]

    def _read(self, slot: int, out: np.ndarray) -> None:
        deadline = self._bucket.reserve(out.nbytes) if self._bucket else 0.0
        t0 = time.monotonic()
        try:
            ts.array(out, copy=False).write(self._blob(slot)).result()
        except Exception as e:
            cls = CorruptBlobError if "DATA_LOSS" in str(e) else TierIOError
            raise cls(self._explain(e, f"reading blob {self.blob_path(slot)} from")) from e
        if self._bucket:
            self._bucket.wait_until(deadline)
        self._record("read", slot, t0, out.nbytes)

    def _write(self, slot: int, data: np.ndarray) -> None:
        deadline = self._bucket.reserve(data.nbytes) if self._bucket else 0.0
        t0 = time.monotonic()
        try:
            self._blob(slot).write(data).result()
        except Exception as e:
            raise TierIOError(self._explain(e, f"writing blob {self.blob_path(slot)} to")) from e
        if self._bucket:
            self._bucket.wait_until(deadline)
        self._record("write", slot, t0, data.nbytes)

    def _record(self, kind: str, slot: int, t0: float, nbytes: int) -> None:
        if kind == "read":
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        if self.trace is not None:
            self.trace.append((kind, slot, t0, time.monotonic()))

    def _explain(self, error: Exception, doing: str) -> str:
        text = str(error)
        if "DATA_LOSS" in text:
            hint = (
                "the blob on disk does not match its checksum (corrupted or half-written). "
                "Restore the optimizer state from your last checkpoint."
            )
        elif "No space left" in text or "ENOSPC" in text:
            hint = "the file system is full. Free space there or configure another tier."
        elif "Permission denied" in text or "EACCES" in text:
            hint = "permission denied. Fix the directory's permissions or choose another path."
        else:
            hint = "check that the file system is mounted, writable and healthy."
        return f"tier {self.tier.path!r}: error {doing} the tier: {text}. Cause: {hint}"

    def close(self) -> None:
        """Waits for in-flight I/O and releases the tier's lock."""
        self._pool.shutdown(wait=True)
        self._lock.release()
