"""Each tier's read and write bandwidth for the placement model: given, or probed at start.

The probe moves a few blobs with the tier's own permits and queue depth, all in flight at
once as the pipeline issues them, and remembers the result in the tier directory for the same
tier settings, so a restarted run does not probe again. It moves them from the host buffer
pool's own buffers (before the pool first uses them), so probing costs no host memory beyond
``host_cache``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence

import numpy as np

from jax_mlpo.config import FileTier
from jax_mlpo.tiers.file import FileTierStore

logger = logging.getLogger(__name__)

PROBE_BLOBS = 4
_MAX_PROBE_ELEMS = 8 * 2**20  # 32 MiB per blob: long enough to amortise a request's latency


def probe_kind(max_state_elems: int) -> dict[str, list[int]]:
    """The ``"probe"`` blobs a store must hold for :func:`tier_bandwidth`."""
    return {"probe": [min(max_state_elems, _MAX_PROBE_ELEMS)] * PROBE_BLOBS}


def probe(
    store: FileTierStore, blob_elems: int, buffers: Sequence[np.ndarray]
) -> tuple[float, float]:
    """Measures a tier's read and write bandwidth (bytes/s) with its own concurrency.

    Writes then reads up to :data:`PROBE_BLOBS` blobs of ``blob_elems`` float32 in the store's
    probe array, all requests in flight at once, as the pipeline issues them.

    Args:
      store: the tier.
      blob_elems: elements per blob.
      buffers: float32 host buffers of at least ``blob_elems`` each, one per blob moved
        (their contents are overwritten).

    Returns:
      ``(read, write)`` in bytes/s.
    """
    bufs = [b[:blob_elems] for b in buffers[:PROBE_BLOBS]]
    nbytes = blob_elems * 4 * len(bufs)
    t0 = time.perf_counter()
    for f in [store.write(i, b, kind="probe") for i, b in enumerate(bufs)]:
        f.result()
    write = nbytes / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for f in [store.read(i, b, kind="probe") for i, b in enumerate(bufs)]:
        f.result()
    read = nbytes / (time.perf_counter() - t0)
    return read, write


def cached_probe(
    store: FileTierStore, blob_elems: int, buffers: Sequence[np.ndarray]
) -> tuple[float, float]:
    """:func:`probe`, remembered in the tier directory for the same tier settings (an object
    tier, which has no directory, is probed every time)."""
    tier = store.tier
    if not isinstance(tier, FileTier):
        return probe(store, blob_elems, buffers)
    limits = tier.limits
    key = json.dumps(
        [
            limits.max_concurrency,
            tier.effective_io_mode,
            tier.sync,
            limits.bandwidth_cap,
            blob_elems,
            min(len(buffers), PROBE_BLOBS),
        ]
    )
    path = os.path.join(store.directory, ".jax_mlpo-probe.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("key") == key:
            return saved["read"], saved["write"]
    except (OSError, ValueError, KeyError):
        pass
    read, write = probe(store, blob_elems, buffers)
    with open(path, "w") as f:
        json.dump({"key": key, "read": read, "write": write}, f)
    logger.info(
        "tier %s: probed read %.0f MB/s, write %.0f MB/s", tier.path, read / 1e6, write / 1e6
    )
    return read, write


def tier_bandwidth(
    store: FileTierStore, max_state_elems: int, buffers: Sequence[np.ndarray]
) -> tuple[float, float]:
    """The tier's ``(read, write)`` bytes/s: its ``bandwidth.read``/``bandwidth.write`` where
    given, the (cached) probe for the rest, through ``buffers`` (see :func:`probe`)."""
    tier = store.tier
    given = tier.bandwidth
    if given.read and given.write:
        return float(given.read), float(given.write)
    (elems,) = set(probe_kind(max_state_elems)["probe"])
    read, write = cached_probe(store, elems, buffers)
    return float(given.read or read), float(given.write or write)
