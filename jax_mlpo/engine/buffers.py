"""The host buffers between the tiers and the optimizer: the cache of slots and its I/O pipeline.

**The cache** (:class:`SlotCache`): page-aligned buffers (*slots*), each holding at most one
subgroup's ``[p | m | v]`` blob, in one of three ways:

- **dirty**: updated and kept, newer than its tier (retention across steps);
- **clean**: written back, still intact in a free slot (a hit until a read reuses the slot);
- **busy**: a read filling it or a write-back reading from it (the pipeline's), neither dirty
  nor free.

A read takes an empty slot, or evicts the clean subgroup needed last in this step's order
(Belady), never one needed before the subgroup it reads. With the alternating order the
subgroups the last step wrote last are the first this step needs, so the whole cache is reused,
not only its dirty part: cache reuse with Belady eviction. All memory is allocated (and
touched) when the cache is made.

**The I/O pipeline** (:class:`IOPipeline`) between the cache and the tiers: MLP-Offload's
multi-path asynchronous offloading (prefetch and write-behind on every tier at once), the reads
issued ahead, fallback. :meth:`IOPipeline.acquire` makes a subgroup resident (a hit in the
cache, or the read issued for it), :meth:`IOPipeline.prefetch` keeps ``prefetch_depth`` reads in
flight per tier, and :meth:`IOPipeline.release` keeps the subgroup dirty or writes it back
behind the next ones (a :class:`PendingWrite`, whose slot stays busy until it lands). Between
steps :meth:`IOPipeline.read_ahead` issues the next step's reads into the slots free then. A
write-back that finds its tier full goes to another tier (``fallback_on_full``).

Which blob kind a subgroup is read from and written to is the caller's :class:`BlobKinds`
(copy-on-write while a checkpoint reads the tiers: :mod:`jax_mlpo.engine.snapshot`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from jax_mlpo.engine.placement import TierAssignment
from jax_mlpo.engine.step_metrics import StepMetrics
from jax_mlpo.tiers.errors import TierFullError, TierIOError
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.tiers.posix import aligned_empty

logger = logging.getLogger(__name__)

Future = concurrent.futures.Future

# ---- the cache --------------------------------------------------------------------------------


def touched_buffer(n: int) -> np.ndarray:
    """A page-aligned float32 buffer of ``n`` elements, touched once now.

    Page-aligned so the tiers' O_DIRECT requests use it in place; touched now so that its page
    faults are not paid inside the first step.
    """
    buf = aligned_empty(n, np.float32)
    buf.fill(0.0)
    return buf


class SlotCache:
    """Slots caching subgroups: which are dirty, clean or free, and which a read evicts.

    Args:
      buffers: the slots (float32, page-aligned, each at least the largest blob).
      blob_elems: each subgroup's state length in float32.
      reuse_clean: whether written-back subgroups stay usable as clean hits.
      resident: subgroup -> slot of the subgroups dirty from the start (all of them for a
        host-only state).
    """

    def __init__(
        self,
        buffers: Sequence[np.ndarray],
        blob_elems: Sequence[int],
        *,
        reuse_clean: bool,
        resident: dict[int, int] | None = None,
    ) -> None:
        self.buffers = list(buffers)
        self._elems = list(blob_elems)
        self._reuse_clean = reuse_clean
        self.dirty: dict[int, int] = dict(resident or {})  # subgroup -> slot, newer than disk
        self.clean: dict[int, int] = {}  # subgroup -> free slot still holding it as written
        self._free: list[int] = []
        self._position: dict[int, int] = {}
        self._cursor = -1

    @property
    def blob_elems(self) -> list[int]:
        """Each subgroup's state length in float32."""
        return self._elems

    def blob(self, index: int, slot: int) -> np.ndarray:
        """Subgroup ``index``'s blob in ``slot``."""
        return self.buffers[slot][: self._elems[index]]

    @property
    def cursor(self) -> int:
        """The position in this step's order of the subgroup the step is at (-1: none yet)."""
        return self._cursor

    def holds(self, index: int) -> bool:
        """Whether subgroup ``index`` is resident (dirty or clean)."""
        return index in self.dirty or index in self.clean

    def begin_step(self, order: Sequence[int], busy: Collection[int]) -> None:
        """Starts a step that needs subgroups in ``order``; ``busy`` slots are in I/O."""
        self._position, self._cursor = {i: n for n, i in enumerate(order)}, -1
        taken = set(self.dirty.values()) | set(busy)
        self._free = [s for s in range(len(self.buffers)) if s not in taken]

    def reach(self, index: int) -> None:
        """Marks ``index`` as the subgroup the step is at (those before it are done)."""
        self._cursor = self._position[index]

    def hit(self, index: int) -> int | None:
        """Takes subgroup ``index``'s slot if it is resident (dirty or clean), else None."""
        if index in self.dirty:
            return self.dirty.pop(index)
        if index in self.clean:
            slot = self.clean.pop(index)
            self._free.remove(slot)
            return slot
        return None

    def keep(self, index: int, slot: int) -> None:
        """Keeps the updated subgroup ``index`` in ``slot``, dirty."""
        self.dirty[index] = slot

    def written(self, index: int, slot: int) -> None:
        """Frees ``slot`` once subgroup ``index``'s write-back from it has landed (a clean hit
        from then on, where clean reuse is on)."""
        self._free.append(slot)
        if self._reuse_clean:
            self.clean[index] = slot

    def give_back(self, slot: int) -> None:
        """Frees ``slot``, whose read was dropped before anything used it."""
        self._free.append(slot)

    def claim(self, index: int, *, evict_sooner: bool) -> int | None:
        """A free slot to read subgroup ``index`` into, taken from the free ones.

        An empty slot first, else the one whose clean subgroup is needed last (evicted).

        Args:
          index: the subgroup to read (in this step's order).
          evict_sooner: whether a clean subgroup needed before ``index`` may be evicted.

        Returns:
          The slot, or None: no free slot, or only by evicting a subgroup needed sooner.
        """
        holder = {slot: j for j, slot in self.clean.items()}
        best, best_key = None, -1.0
        for slot in self._free:
            j = holder.get(slot)
            key = math.inf if j is None else self._next_use(j)
            if key > best_key:
                best, best_key = slot, key
        if best is None or not (evict_sooner or best_key > self._position[index]):
            return None
        self._free.remove(best)
        j = holder.get(best)
        if j is not None:
            del self.clean[j]
        return best

    def dirty_needed_last(self) -> tuple[int, int] | None:
        """Takes the dirty subgroup needed last out of the cache, as ``(index, slot)``; None if
        there is none. Its slot is busy until the caller has written it back."""
        if not self.dirty:
            return None
        j = max(self.dirty, key=self._next_use)
        return j, self.dirty.pop(j)

    def free_buffers(self, busy: Collection[int]) -> list[np.ndarray]:
        """The buffers holding no dirty subgroup and not ``busy``, emptied of their clean ones,
        for work between steps."""
        self.clean.clear()
        taken = set(self.dirty.values()) | set(busy)
        return [b for slot, b in enumerate(self.buffers) if slot not in taken]

    def position(self, index: int) -> int:
        """Where subgroup ``index`` is in this step's order."""
        return self._position[index]

    def needed_after(self, j: int, index: int) -> bool:
        """Whether this step needs subgroup ``j`` after subgroup ``index``."""
        return self._position[j] > self._position[index]

    def _next_use(self, index: int) -> float:
        n = self._position[index]
        return n if n > self._cursor else math.inf  # updated already: needed next step at most


# ---- the I/O pipeline -------------------------------------------------------------------------


class BlobKinds(Protocol):
    """Which blob kind holds each subgroup's state on its tier."""

    def current(self, index: int) -> str:
        """The kind subgroup ``index``'s state is read from."""

    def for_write(self, index: int) -> str:
        """The kind a write of subgroup ``index`` goes to; it is the subgroup's state from then."""


class PendingWrite(NamedTuple):
    """A write-back in flight: its slot is busy until the future resolves."""

    future: Future
    slot: int
    subgroup: int
    kind: str


class Resident(NamedTuple):
    """A subgroup made resident by :meth:`IOPipeline.acquire`."""

    slot: int
    hit: bool  # no read was needed (dirty or clean)
    reads: list[Future]  # the reads filling the slot, awaited by :meth:`IOPipeline.await_reads`


class IOPipeline:
    """The reads and write-backs of the subgroups cached in ``cache``.

    Args:
      cache: the host cache the reads fill and the write-backs empty.
      stores: the open tiers (empty when the whole state is resident).
      assignment: where each subgroup lives (None when the whole state is resident).
      kinds: the blob kind each read and write uses.
      prefetch_depth: reads in flight per tier.
      fallback_on_full: write a subgroup to another tier when its own is full.
      io_timeout_s: how long any one request may take before the tier counts as hung.
      companion_reads: reads that go with a subgroup's into the same slot (the baseline's
        gradient blob), as futures.
    """

    def __init__(
        self,
        cache: SlotCache,
        stores: Sequence[FileTierStore],
        assignment: TierAssignment | None,
        kinds: BlobKinds,
        *,
        prefetch_depth: int,
        fallback_on_full: bool,
        io_timeout_s: float | None,
        companion_reads: Callable[[int, int], list[Future]] | None = None,
    ) -> None:
        self.cache = cache
        self._stores = stores
        self._assignment = assignment
        self._kinds = kinds
        self._depth = prefetch_depth
        self._fallback = fallback_on_full
        self.io_timeout_s = io_timeout_s
        self._companion = companion_reads or (lambda i, slot: [])
        self.writes: deque[PendingWrite] = deque()  # oldest first; outlive a step (write-behind)
        self.issued: dict[int, Resident] = {}  # reads issued, not yet acquired
        self._order: Sequence[int] = ()
        self._metrics = StepMetrics(step=0)

    # -- one step -------------------------------------------------------------------------

    def begin_step(self, order: Sequence[int], metrics: StepMetrics) -> None:
        """Starts a step updating subgroups in ``order``; waits are added to ``metrics``."""
        self._order, self._metrics = order, metrics
        busy = [w.slot for w in self.writes] + [r.slot for r in self.issued.values()]
        self.cache.begin_step(order, busy)

    def acquire(self, index: int) -> Resident:
        """Makes subgroup ``index`` (the next in the order) resident: a hit, or its read."""
        self.cache.reach(index)
        while self._writing(index):  # the last step's write-back of it: then a clean hit
            self._reclaim(block=True)
        slot = self.cache.hit(index)
        if slot is not None:
            return Resident(slot, True, [])
        if index not in self.issued and not self._issue(index, block=True):
            raise RuntimeError(f"jax_mlpo: no host buffer for subgroup {index}")
        return self.issued.pop(index)

    def prefetch(self) -> None:
        """Issues reads of the subgroups after the current one, ``prefetch_depth`` per tier."""
        tier_of = self._assignment.tier_of if self._assignment else []
        for j in itertools.islice(self._order, self.cache.cursor + 1, None):
            if self._needs_no_read(j):
                continue
            in_flight = sum(1 for u in self.issued if tier_of[u] == tier_of[j])
            if in_flight >= self._depth or not self._issue(j, block=False):
                break

    def await_reads(self, index: int, resident: Resident) -> None:
        """Waits for the reads filling ``resident`` (time counted as read wait)."""
        t0 = time.monotonic()
        for future in resident.reads:
            self.wait(future, index)
        self._metrics.read_wait_s += time.monotonic() - t0

    def release(self, index: int, slot: int, *, keep: bool) -> None:
        """Keeps the updated subgroup dirty, or writes it back to its (target) tier behind."""
        if keep:
            self.cache.keep(index, slot)
        else:
            self._write_back(index, slot)
        self._reclaim(block=False)

    def end_step(self, *, write_behind: bool) -> None:
        """Waits for the step's write-backs, unless they may finish while the caller runs."""
        if not write_behind:
            while self.writes:
                self._reclaim(block=True)

    # -- between steps ----------------------------------------------------------------------

    def read_ahead(self, order: Sequence[int]) -> Future | None:
        """Issues reads of the next step's subgroups into the slots free now.

        Between steps nothing is updated, so the state a read fetches is the one the next step
        (``order``) needs. A read takes an empty slot, or one whose clean subgroup the step
        needs later than the one read (:meth:`acquire` finds the read in flight or done);
        finished write-backs give their slots first. Nothing blocks.

        Args:
          order: the next step's order.

        Returns:
          The oldest write-back still in flight when a read found no slot (call again once
          it is done: it frees one), or None when there is nothing more to do before the step.
        """
        self.begin_step(order, StepMetrics(step=0))  # waits here belong to no step
        self._reclaim(block=False)
        for j in order:
            if self._needs_no_read(j):
                continue
            if not self._issue(j, block=False):  # no slot now: maybe once a write lands
                return self.writes[0].future if self.writes else None
        return None

    @property
    def reads_ahead(self) -> list[int]:
        """The subgroups whose reads were issued before the step that needs them."""
        return list(self.issued)

    def failed_read_ahead(self) -> tuple[int, BaseException] | None:
        """A read issued ahead that has already failed, as ``(subgroup, error)``, or None."""
        for index, resident in self.issued.items():
            for future in resident.reads:
                if future.done() and not future.cancelled() and future.exception() is not None:
                    return index, future.exception()
        return None

    def cancel_reads(self) -> None:
        """Drops the reads issued ahead of a step, freeing their slots (before the state is
        replaced, or read out between steps through the free buffers).

        Raises:
          TierIOError: if one is still running after ``io_timeout_s`` (its buffer may still
            be written).
        """
        futures = [f for r in self.issued.values() for f in r.reads]
        for future in futures:
            future.cancel()
        _, running = concurrent.futures.wait(futures, timeout=self.io_timeout_s)
        self.issued.clear()
        if running:
            raise TierIOError(
                f"{len(running)} read(s) issued ahead of the next update did not complete "
                f"within io_timeout_s={self.io_timeout_s} s: the tier may be hung"
            )

    def abort(self, *, cancel: bool = True) -> None:
        """Lets no request outlive a failure: cancels (``cancel``) the requests not started
        and waits for the rest."""
        self.cache.clean.clear()
        pending = [f for r in self.issued.values() for f in r.reads]
        pending += [w.future for w in self.writes]
        for f in pending if cancel else ():
            f.cancel()
        self.issued.clear()
        self.writes.clear()
        # a hung tier is abandoned after the timeout: the engine is failed from here on
        concurrent.futures.wait(pending, timeout=self.io_timeout_s)

    def drain(self) -> None:
        """Waits for every write-back in flight; their subgroups stay as clean hits."""
        while self.writes:
            self.cache.written(*self._reclaim_one())

    def free_buffers(self) -> list[np.ndarray]:
        """The cache's buffers holding no dirty subgroup and no read, emptied of their clean
        ones, for work between steps. Call it with no write-back in flight (:meth:`drain`)."""
        return self.cache.free_buffers([r.slot for r in self.issued.values()])

    # -- outside the steps ------------------------------------------------------------------

    def write_all(self, blob: np.ndarray) -> None:
        """Writes ``blob`` (its first elements) as every subgroup's state on its tier."""
        self._write_and_wait((i, blob[:n]) for i, n in enumerate(self.cache.blob_elems))

    def flush(self) -> None:
        """Writes the dirty subgroups to their tiers (they stay resident)."""
        dirty = self.cache.dirty.items()
        self._write_and_wait((i, self.cache.blob(i, slot)) for i, slot in dirty)

    def _write_and_wait(self, blobs: Iterable[tuple[int, np.ndarray]]) -> None:
        """Writes each ``(subgroup, blob)`` to the subgroup's tier, all in flight, then waits."""
        futures = [(self.write(i, blob), i) for i, blob in blobs]
        for future, i in futures:
            self.wait(future, i)

    # -- requests -------------------------------------------------------------------------

    def location(self, index: int) -> tuple[FileTierStore, str]:
        """Where subgroup ``index``'s state is: its tier's store and the blob kind."""
        return self._stores[self._assignment.tier_of[index]], self._kinds.current(index)

    def write(self, index: int, blob: np.ndarray) -> Future:
        """Writes subgroup ``index``'s blob to its tier, as the kind :class:`BlobKinds` says."""
        return self._write(self._stores[self._assignment.tier_of[index]], index, blob)

    def wait(self, future: Future, index: int, tier: int | None = None) -> None:
        """Waits for a request of subgroup ``index`` (on ``tier``, default: where it lives);
        its error names the subgroup and the tier.

        Raises:
          TierIOError: if it failed, or took longer than ``io_timeout_s``.
        """
        try:
            future.result(timeout=self.io_timeout_s)
        except TierIOError as e:
            raise type(e)(f"subgroup {index}: {e}") from e
        except concurrent.futures.TimeoutError:
            tier_of = self._assignment.tier_of if self._assignment else []
            k = tier if tier is not None else (tier_of[index] if tier_of else None)
            where = self._stores[k].tier.path if k is not None else "?"
            raise TierIOError(
                f"subgroup {index}: tier {where!r} did not complete a request within "
                f"io_timeout_s={self.io_timeout_s} s. The file system may be hung or "
                "overloaded: check it, or raise io_timeout_s if it is just slow."
            ) from None

    def _write(self, store: FileTierStore, index: int, blob: np.ndarray) -> Future:
        return store.write(index, blob, self._kinds.for_write(index))

    def _write_back(self, index: int, slot: int) -> None:
        store = self._stores[self._assignment.write_tier(index)]  # a re-planned one moves now
        future = self._write(store, index, self.cache.blob(index, slot))
        self.writes.append(PendingWrite(future, slot, index, self._kinds.current(index)))

    def _writing(self, index: int) -> bool:
        return any(w.subgroup == index for w in self.writes)

    def _needs_no_read(self, index: int) -> bool:
        return self.cache.holds(index) or index in self.issued or self._writing(index)

    def _issue(self, index: int, block: bool) -> bool:
        slot = self._take(index, block)
        if slot is None:
            return False
        store, kind = self.location(index)
        read = store.read(index, self.cache.blob(index, slot), kind)
        self.issued[index] = Resident(slot, False, [read, *self._companion(index, slot)])
        return True

    def _take(self, index: int, block: bool) -> int | None:
        """A slot to read ``index`` into (None: only by evicting something needed sooner)."""
        self._reclaim(block=False)
        while (slot := self.cache.claim(index, evict_sooner=block)) is None:
            if not block:
                return None
            if self.writes:
                self._reclaim(block=True)
            elif not self._evict_dirty() and not self._drop_read_needed_last(index):
                return None
        return slot

    def _drop_read_needed_last(self, index: int) -> bool:
        """Gives up the read of another subgroup needed after ``index`` and frees its slot
        (False: none): reads issued ahead of a step may hold every free slot when a subgroup
        before them still needs one (it was being written when they were issued); that
        subgroup is read again later."""
        later = [j for j in self.issued if j != index and self.cache.needed_after(j, index)]
        if not later:
            return False
        j = max(later, key=self.cache.position)
        dropped = self.issued.pop(j)
        concurrent.futures.wait(dropped.reads, timeout=self.io_timeout_s)
        if not all(f.done() for f in dropped.reads):
            raise TierIOError(
                f"subgroup {j}: a read did not complete within io_timeout_s="
                f"{self.io_timeout_s} s: the tier may be hung"
            )
        self.cache.give_back(dropped.slot)
        return True

    def _evict_dirty(self) -> bool:
        """Writes back the dirty subgroup needed last and frees its slot (False: none).

        Only when every slot holds a dirty subgroup and no write is in flight: a tier that
        retains nothing (``retain_policy="slow_tiers"``) can need a read before any dirty
        subgroup is written back.
        """
        evicted = self.cache.dirty_needed_last()
        if evicted is None:
            return False
        self._write_back(*evicted)
        self._reclaim(block=True)
        return True

    def _reclaim(self, block: bool) -> None:
        """Frees the slots of finished write-backs, oldest first (waits for one if ``block``)."""
        while self.writes and (block or self.writes[0].future.done()):
            t0 = time.monotonic()
            index, slot = self._reclaim_one()
            self._metrics.write_wait_s += time.monotonic() - t0
            self.cache.written(index, slot)
            block = False

    def _reclaim_one(self) -> tuple[int, int]:
        """Waits for the oldest write-back (moving it to another tier if its own is full)."""
        future, slot, index, kind = self.writes.popleft()
        try:
            self.wait(future, index)
        except TierFullError as e:
            if not self._fall_back(index, kind, self.cache.blob(index, slot), e):
                raise
        return index, slot

    def _fall_back(self, index: int, kind: str, blob: np.ndarray, error: TierFullError) -> bool:
        """Writes a subgroup whose tier is full to another tier; False if none takes it.

        The blob left behind on the full tier is never read again (the assignment moves), and
        the buffer still holds the subgroup's state, so nothing is lost.
        """
        if not self._fallback:
            return False
        full = self._assignment.tier_of[index]
        for k, store in enumerate(self._stores):
            if k == full:
                continue
            try:
                self.wait(store.write(index, blob, kind), index, tier=k)
            except TierIOError:
                continue
            self._assignment.moved(index, k)
            logger.warning(
                "jax_mlpo: tier %r is full; subgroup %d moved to tier %r (%s)",
                self._stores[full].tier.path, index, store.tier.path, error,
            )  # fmt: skip
            return True
        return False
