"""The offloaded state at one step, read out subgroup by subgroup, while training may go on.

A checkpoint of state larger than host memory cannot copy it first. :class:`StateSnapshot`
reads every subgroup's blob as it was at the snapshot's step, in subgroup order, through a
few buffers:

- **Between steps** (``concurrent=False``): the caller runs no update until the snapshot is
  closed. Resident subgroups come from the host cache, the others are read from their tiers
  into the pool's free buffers (no host memory beyond ``host_cache``).
- **While training goes on** (``concurrent=True``): the dirty subgroups are flushed to their
  tiers when the snapshot is taken (the only wait the training loop sees), then every blob is
  read from its tier at the place it had then, into the snapshot's own two buffers. Until the
  snapshot has read a subgroup, the updates write that subgroup to the *other* blob kind
  (copy-on-write, :attr:`~jax_mlpo.tiers.host.HostBufferPool.kind_of`), so the blob it still
  has to read stays intact; once read, the old blob is deleted. The disk holds up to twice the
  state during such a snapshot, never more. A state held all in host memory (no tiers) is
  copied instead: it fits in memory by configuration.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import numpy as np

from jax_mlpo.layout import Layout, Subgroup
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.tiers.host import HostBufferPool, other_kind
from jax_mlpo.tiers.submit import aligned_empty

logger = logging.getLogger(__name__)

READ_AHEAD = 2  # a concurrent snapshot's buffers: one blob read while the last is consumed


def spare_buffers(pool: HostBufferPool, layout: Layout) -> list[np.ndarray]:
    """Buffers for work between steps: the pool's free ones, topped up to ``READ_AHEAD`` with
    blobs beyond the pool (where dirty subgroups hold the rest), so that one subgroup's tier
    I/O overlaps the next one's use."""
    free = pool.free_buffers()
    extra = max(0, READ_AHEAD - len(free))
    return free + [aligned_empty(layout.max_state_elems, np.float32) for _ in range(extra)]


class StateSnapshot:
    """Every subgroup's blob at step :attr:`step`, for one pass of :meth:`blobs`.

    Made by :meth:`jax_mlpo.engine.Engine.snapshot`, which has drained and (when
    ``concurrent``) flushed the pool. Close it (or use it as a context manager) when done: a
    concurrent snapshot holds up the deletion of the blobs it protects.

    Args:
      pool: the engine's buffer pool.
      layout: the engine's layout.
      stores: the engine's tiers (empty when the state is all in host memory).
      tier_of: each subgroup's tier now.
      step: the step the state is at.
      concurrent: whether updates may run while it is read.
      on_close: called once, when closed.
    """

    def __init__(
        self, pool: HostBufferPool, layout: Layout, stores: list[FileTierStore],
        tier_of: list[int], step: int, *, concurrent: bool, on_close: Callable[[], None],
    ) -> None:  # fmt: skip
        self.step = step
        self.concurrent = concurrent
        self._pool, self._layout, self._stores = pool, layout, stores
        self._on_close = on_close
        self._lock = threading.Lock()
        self._closed = threading.Event()
        n = len(layout.subgroups)
        self._pending = set(range(n))  # not read yet: their blobs must stay as they are
        self._moved: set[int] = set()  # written to the other kind since the snapshot
        self._where = [(tier_of[i], pool.kind_of[i]) for i in range(n)] if stores else []
        self._copies: dict[int, np.ndarray] = {}
        self._buffers: list[np.ndarray] = []
        if concurrent and not stores:  # all in host memory: a copy, freed as it is read
            self._copies = {i: pool.blob(i, slot).copy() for i, slot in pool.dirty.items()}
        elif concurrent:
            elems = layout.max_state_elems
            self._buffers = [aligned_empty(elems, np.float32) for _ in range(READ_AHEAD)]
            pool.write_kind = self._write_kind
        elif stores:
            self._buffers = spare_buffers(pool, layout)

    @property
    def host_bytes(self) -> int:
        """Host memory this snapshot holds beyond the engine's pool."""
        own = [b for b in self._buffers if not any(b is p for p in self._pool.buffers)]
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
        source = self._source if self.concurrent else None
        for sg, blob in self._pool.stream_blobs(sgs, self._buffers, load=False, source=source):
            yield sg, blob
            self._read(sg.index)

    def _source(self, i: int) -> tuple[FileTierStore, str]:
        tier, kind = self._where[i]
        return self._stores[tier], kind

    def _write_kind(self, i: int, kind: str) -> str:
        """The pool's choice of blob kind for a write of subgroup ``i`` (copy-on-write)."""
        with self._lock:
            if i in self._pending and kind == self._where[i][1]:
                self._moved.add(i)
                return other_kind(kind)
            return kind

    def _read(self, i: int) -> None:
        with self._lock:
            self._pending.discard(i)
            stale = i in self._moved
        if stale:  # the update wrote the other kind already: this blob is nobody's state now
            self._discard(i)

    def _discard(self, i: int) -> None:
        tier, kind = self._where[i]
        try:
            self._stores[tier].discard(i, kind)
        except OSError as e:  # only space is lost; the blob is never read again
            logger.warning("jax_mlpo: could not delete a stale blob of subgroup %d: %s", i, e)

    def close(self) -> None:
        """Ends the snapshot: updates write in place again; stale blobs are deleted."""
        if self._closed.is_set():
            return
        if self.concurrent and self._stores:
            with self._lock:
                self._pool.write_kind = lambda i, kind: kind
                stale = sorted(self._pending & self._moved)  # never read (a failed save)
                self._pending.clear()
            for i in stale:
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
