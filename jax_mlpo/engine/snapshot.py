"""The offloaded state at one step, read out subgroup by subgroup, while training may go on.

A checkpoint of state larger than host memory cannot copy it first. :class:`StateSnapshot`
reads every subgroup's blob as it was at the snapshot's step, in subgroup order, through a
few buffers (:mod:`jax_mlpo.engine.state_stream`):

- **Between steps** (``concurrent=False``): the caller runs no update until the snapshot is
  closed. Resident subgroups come from the host cache, the others are read from their tiers
  into the cache's free buffers (no host memory beyond ``host_cache``).
- **While training goes on** (``concurrent=True``): the dirty subgroups are flushed to their
  tiers when the snapshot is taken (the only wait the training loop sees), then every blob is
  read from its tier at the place it had then, into the snapshot's own two buffers. Until the
  snapshot has read a subgroup, the updates write that subgroup to the *other* blob kind
  (copy-on-write, :class:`CopyOnWrite`), so the blob it still has to read stays intact; once
  read, the old blob is deleted. The disk holds up to twice the state during such a snapshot,
  never more. A state held all in host memory (no tiers) is copied instead: it fits in memory
  by configuration.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import numpy as np

from jax_mlpo.engine.buffers import IOPipeline
from jax_mlpo.engine.layout import Layout, Subgroup
from jax_mlpo.engine.state_stream import READ_AHEAD, spare_buffers, stream_blobs
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.tiers.posix import aligned_empty

logger = logging.getLogger(__name__)

STATE, STATE_ALT = "state", "state.alt"  # the two blob kinds a subgroup's state can be in


class CopyOnWrite:
    """Which of two blob kinds holds each subgroup's state, and the blobs a snapshot protects.

    The engine's I/O pipeline asks it the kind of every read (:meth:`current`) and write
    (:meth:`for_write`). While a concurrent snapshot has not read a subgroup's blob, a write of
    that subgroup goes to the other kind, so that the blob stays as it was.

    Args:
      n: the number of subgroups.
    """

    def __init__(self, n: int) -> None:
        self._kind = [STATE] * n
        self._lock = threading.Lock()
        self._protected: list[str] = []  # each subgroup's kind when the snapshot was taken
        self._pending: set[int] = set()  # not read by the snapshot yet: kept intact
        self._moved: set[int] = set()  # written to the other kind since the snapshot

    def current(self, index: int) -> str:
        """The kind subgroup ``index``'s state is in."""
        return self._kind[index]

    def for_write(self, index: int) -> str:
        """The kind a write of subgroup ``index`` goes to; it is the subgroup's state from then."""
        with self._lock:
            kind = self._kind[index]
            if index in self._pending and kind == self._protected[index]:
                self._moved.add(index)
                kind = STATE_ALT if kind == STATE else STATE
            self._kind[index] = kind
            return kind

    def protect(self) -> list[str]:
        """Keeps every subgroup's blob intact until :meth:`read` (or :meth:`release`).

        Returns:
          Each subgroup's kind now: the blobs protected.
        """
        with self._lock:
            self._protected = list(self._kind)
            self._pending, self._moved = set(range(len(self._kind))), set()
            return list(self._protected)

    def read(self, index: int) -> bool:
        """Ends the protection of subgroup ``index``'s blob; True if it is stale (an update
        wrote the other kind since: nobody's state, to delete)."""
        with self._lock:
            self._pending.discard(index)
            return index in self._moved

    def release(self) -> list[int]:
        """Ends every protection; returns the subgroups whose protected blob is stale and was
        never read (a failed save), to delete."""
        with self._lock:
            stale = sorted(self._pending & self._moved)
            self._pending.clear()
            return stale


class StateSnapshot:
    """Every subgroup's blob at step :attr:`step`, for one pass of :meth:`blobs`.

    Made by :meth:`jax_mlpo.engine.engine.Engine.snapshot`, which has drained and (when
    ``concurrent``) flushed the cache. Close it (or use it as a context manager) when done: a
    concurrent snapshot holds up the deletion of the blobs it protects.

    Args:
      pipeline: the engine's I/O pipeline (and through it, its cache).
      kinds: the engine's blob kinds, which a concurrent snapshot protects until read.
      layout: the engine's layout.
      stores: the engine's tiers (empty when the state is all in host memory).
      tier_of: each subgroup's tier now.
      step: the step the state is at.
      concurrent: whether updates may run while it is read.
      on_close: called once, when closed.
    """

    def __init__(
        self, pipeline: IOPipeline, kinds: CopyOnWrite, layout: Layout,
        stores: list[FileTierStore], tier_of: list[int], step: int, *, concurrent: bool,
        on_close: Callable[[], None],
    ) -> None:  # fmt: skip
        self.step = step
        self.concurrent = concurrent
        self._pipeline, self._kinds, self._layout = pipeline, kinds, layout
        self._stores, self._tier_of = stores, list(tier_of)
        self._on_close = on_close
        self._closed = threading.Event()
        self._copy_on_write = concurrent and bool(stores)
        self._protected: list[str] = []  # each subgroup's blob kind, kept until read
        self._copies: dict[int, np.ndarray] = {}
        self._buffers: list[np.ndarray] = []
        cache = pipeline.cache
        if concurrent and not stores:  # all in host memory: a copy, freed as it is read
            self._copies = {i: cache.blob(i, slot).copy() for i, slot in cache.dirty.items()}
        elif concurrent:
            elems = layout.max_state_elems
            self._buffers = [aligned_empty(elems, np.float32) for _ in range(READ_AHEAD)]
            self._protected = kinds.protect()
        elif stores:
            self._buffers = spare_buffers(pipeline, layout)

    @property
    def host_bytes(self) -> int:
        """Host memory this snapshot holds beyond the engine's cache."""
        cached = self._pipeline.cache.buffers
        own = [b for b in self._buffers if not any(b is p for p in cached)]
        return sum(b.nbytes for b in own) + sum(c.nbytes for c in self._copies.values())

    def blobs(self) -> Iterator[tuple[Subgroup, np.ndarray]]:
        """Yields each subgroup and its blob at :attr:`step`, in subgroup order.

        A blob is valid until the next one is asked for; the caller must not change it.

        Raises:
          TierIOError: a tier read failed.
        """
        sgs = self._layout.subgroups
        if self._copies:
            for sg in sgs:
                yield sg, self._copies[sg.index]
                del self._copies[sg.index]  # freed as it goes
            return
        # all in host memory: every subgroup is dirty, yielded from its slot
        source = self._source if self._copy_on_write else None
        for sg, blob in stream_blobs(self._pipeline, sgs, self._buffers, load=False, source=source):
            yield sg, blob
            # the update wrote the other kind already: this blob is nobody's state now
            if self._copy_on_write and self._kinds.read(sg.index):
                self._discard(sg.index)

    def _source(self, i: int) -> tuple[FileTierStore, str]:
        return self._stores[self._tier_of[i]], self._protected[i]

    def _discard(self, i: int) -> None:
        try:
            self._stores[self._tier_of[i]].discard(i, self._protected[i])
        except OSError as e:  # only space is lost; the blob is never read again
            logger.warning("jax_mlpo: could not delete a stale blob of subgroup %d: %s", i, e)

    def close(self) -> None:
        """Ends the snapshot: updates write in place again; stale blobs are deleted."""
        if self._closed.is_set():
            return
        if self._copy_on_write:
            for i in self._kinds.release():  # never read (a failed save)
                self._discard(i)
        self._buffers, self._copies = [], {}
        self._closed.set()
        self._on_close()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Waits until :meth:`close` has run; False on timeout."""
        return self._closed.wait(timeout)

    def __enter__(self) -> StateSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
