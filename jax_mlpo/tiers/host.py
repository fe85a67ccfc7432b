"""The host buffer pool: page-aligned buffers that cache subgroups between the tiers and AdamW.

Every buffer (a *slot*) holds at most one subgroup's ``[p | m | v]`` blob, in one of three ways:

- **dirty**: updated and kept, newer than its tier (retention across steps);
- **clean**: written back, still intact in a free buffer (a hit until a read reuses the slot);
- **in flight**: a prefetch reading into it, or a write-back (``PendingWrite``) reading from it.

:meth:`HostBufferPool.acquire` makes a subgroup resident (a dirty or clean hit, or the read
issued for it), :meth:`HostBufferPool.prefetch` keeps ``prefetch_depth`` reads in flight per
tier, and :meth:`HostBufferPool.release` keeps the subgroup dirty or writes it back behind the
next ones. A read takes an empty slot, or evicts the clean subgroup needed last in this step's
order (Belady), never one needed before the subgroup it reads. With the alternating order the
subgroups the last step wrote last are the first this step needs, so the whole pool is reused,
not only its dirty part. All memory is allocated (and touched) when the pool is made.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jax_mlpo.layout import Subgroup
from jax_mlpo.replan import TierAssignment
from jax_mlpo.step_metrics import StepMetrics
from jax_mlpo.tiers.errors import TierFullError, TierIOError
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.tiers.submit import aligned_empty

logger = logging.getLogger(__name__)

Future = concurrent.futures.Future
STATE, STATE_ALT = "state", "state.alt"  # a subgroup's blob is one of two kinds (see kind_of)


def other_kind(kind: str) -> str:
    """The blob kind a subgroup's state moves to while its current blob must stay intact."""
    return STATE_ALT if kind == STATE else STATE


def touched_buffer(n: int) -> np.ndarray:
    """A page-aligned float32 buffer of ``n`` elements, touched once now.

    Page-aligned so the tiers' O_DIRECT requests use it in place; touched now so that its page
    faults are not paid inside the first step.
    """
    buf = aligned_empty(n, np.float32)
    buf.fill(0.0)
    return buf


class PendingWrite(NamedTuple):
    """A write-back in flight: its buffer is busy until the future resolves."""

    future: Future
    slot: int
    subgroup: int
    kind: str = STATE


class Resident(NamedTuple):
    """A subgroup made resident by :meth:`HostBufferPool.acquire`."""

    slot: int
    hit: bool  # no read was needed (dirty or clean)
    reads: list[Future]  # the reads filling the slot, awaited by :meth:`HostBufferPool.await_reads`


class HostBufferPool:
    """Host buffers caching subgroups, with their prefetches and write-backs.

    Args:
      buffers: the slots (float32, page-aligned, each at least the largest blob).
      blob_elems: each subgroup's state length in float32.
      stores: the open tiers (empty when the whole state is resident).
      assignment: where each subgroup lives (None when the whole state is resident).
      prefetch_depth: reads in flight per tier.
      reuse_clean: whether written-back subgroups stay usable as clean hits.
      fallback_on_full: write a subgroup to another tier when its own is full.
      io_timeout_s: how long any one request may take before the tier counts as hung.
      companion_reads: reads that go with a subgroup's into the same slot (the baseline's
        gradient blob), as futures.
      resident: subgroup -> slot of the subgroups dirty from the start (all of them for a
        host-only state).
    """

    def __init__(
        self,
        buffers: Sequence[np.ndarray],
        blob_elems: Sequence[int],
        stores: Sequence[FileTierStore],
        assignment: TierAssignment | None,
        *,
        prefetch_depth: int,
        reuse_clean: bool,
        fallback_on_full: bool,
        io_timeout_s: float | None,
        companion_reads: Callable[[int, int], list[Future]] | None = None,
        resident: dict[int, int] | None = None,
    ) -> None:
        self.buffers = list(buffers)
        self._elems = list(blob_elems)
        self._stores = stores
        self._assignment = assignment
        self._depth = prefetch_depth
        self._reuse_clean = reuse_clean
        self._fallback = fallback_on_full
        self._timeout = io_timeout_s
        self._companion = companion_reads or (lambda i, slot: [])
        self.dirty: dict[int, int] = dict(resident or {})  # subgroup -> slot, newer than disk
        self.clean: dict[int, int] = {}  # subgroup -> free slot still holding it as written
        self.writes: deque[PendingWrite] = deque()  # oldest first; outlive a step (write-behind)
        # Each subgroup's state is the blob of kind kind_of[i] on its tier. A checkpoint being
        # read from the tiers while training goes on (jax_mlpo.snapshot) has write-backs go to
        # the other kind, so that the blob it still has to read stays as it was.
        self.kind_of: list[str] = [STATE] * len(self._elems)
        self.write_kind: Callable[[int, str], str] = lambda i, kind: kind
        self._reads: dict[int, Resident] = {}
        self._free: list[int] = []
        self._position: dict[int, int] = {}
        self._order: Sequence[int] = ()
        self._cursor = -1
        self._metrics = StepMetrics(step=0)

    def blob(self, index: int, slot: int) -> np.ndarray:
        """Subgroup ``index``'s blob in ``slot``."""
        return self.buffers[slot][: self._elems[index]]

    # -- one step -------------------------------------------------------------------------

    def begin_step(self, order: Sequence[int], metrics: StepMetrics) -> None:
        """Starts a step updating subgroups in ``order``; waits are added to ``metrics``."""
        self._order, self._metrics, self._cursor = order, metrics, -1
        self._position = {i: n for n, i in enumerate(order)}
        busy = set(self.dirty.values()) | {w.slot for w in self.writes}
        busy |= {r.slot for r in self._reads.values()}  # read ahead of the step
        self._free = [s for s in range(len(self.buffers)) if s not in busy]

    def acquire(self, index: int) -> Resident:
        """Makes subgroup ``index`` (the next in the order) resident: a hit, or its read."""
        self._cursor = self._position[index]
        while self._writing(index):  # the last step's write-back of it: then a clean hit
            self._reclaim(block=True)
        if index in self.dirty:
            return Resident(self.dirty.pop(index), True, [])
        if index in self.clean:
            slot = self.clean.pop(index)
            self._free.remove(slot)
            return Resident(slot, True, [])
        if index not in self._reads and not self._issue(index, block=True):
            raise RuntimeError(f"jax_mlpo: no host buffer for subgroup {index}")
        return self._reads.pop(index)

    def prefetch(self) -> None:
        """Issues reads of the subgroups after the current one, ``prefetch_depth`` per tier."""
        tier_of = self._assignment.tier_of if self._assignment else []
        for j in itertools.islice(self._order, self._cursor + 1, None):
            if j in self.dirty or j in self.clean or j in self._reads or self._writing(j):
                continue
            in_flight = sum(1 for u in self._reads if tier_of[u] == tier_of[j])
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
            self.dirty[index] = slot
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
        """Issues reads of the next step's subgroups into the buffers free now.

        Between steps nothing is updated, so the state a read fetches is the one the next step
        (``order``) needs. A read takes an empty buffer, or one whose clean subgroup the step
        needs later than the one read (:meth:`acquire` finds the read in flight or done);
        finished write-backs give their buffers first. Nothing blocks.

        Args:
          order: the next step's order.

        Returns:
          The oldest write-back still in flight when a read found no buffer (call again once
          it is done: it frees one), or None when there is nothing more to do before the step.
        """
        self.begin_step(order, StepMetrics(step=0))  # waits here belong to no step
        self._reclaim(block=False)
        for j in order:
            if j in self.dirty or j in self.clean or j in self._reads or self._writing(j):
                continue
            if not self._issue(j, block=False):  # no buffer now: maybe once a write lands
                return self.writes[0].future if self.writes else None
        return None

    @property
    def reads_ahead(self) -> list[int]:
        """The subgroups whose reads were issued before the step that needs them."""
        return list(self._reads)

    def failed_read_ahead(self) -> tuple[int, BaseException] | None:
        """A read issued ahead that has already failed, as ``(subgroup, error)``, or None."""
        for index, resident in self._reads.items():
            for future in resident.reads:
                if future.done() and not future.cancelled() and future.exception() is not None:
                    return index, future.exception()
        return None

    def cancel_reads(self) -> None:
        """Drops the reads issued ahead of a step, freeing their buffers (before the state is
        replaced, or read out between steps through the free buffers).

        Raises:
          TierIOError: if one is still running after ``io_timeout_s`` (its buffer may still
            be written).
        """
        futures = [f for r in self._reads.values() for f in r.reads]
        for future in futures:
            future.cancel()
        _, running = concurrent.futures.wait(futures, timeout=self._timeout)
        self._reads.clear()
        if running:
            raise TierIOError(
                f"{len(running)} read(s) issued ahead of the next update did not complete "
                f"within io_timeout_s={self._timeout} s: the tier may be hung"
            )

    def abort(self, *, cancel: bool = True) -> None:
        """Lets no request outlive a failure: cancels (``cancel``) the requests not started
        and waits for the rest."""
        self.clean.clear()
        pending = [f for r in self._reads.values() for f in r.reads]
        pending += [w.future for w in self.writes]
        for f in pending if cancel else ():
            f.cancel()
        self._reads.clear()
        self.writes.clear()
        # a hung tier is abandoned after the timeout: the engine is failed from here on
        concurrent.futures.wait(pending, timeout=self._timeout)

    def drain(self) -> None:
        """Waits for every write-back in flight; their subgroups stay as clean hits."""
        while self.writes:
            index, slot = self._reclaim_one()
            if self._reuse_clean:
                self.clean[index] = slot

    # -- outside the steps ------------------------------------------------------------------

    def write_all(self, blob: np.ndarray) -> None:
        """Writes ``blob`` (its first elements) as every subgroup's state on its tier."""
        self._write_and_wait((i, blob[:n]) for i, n in enumerate(self._elems))

    def flush(self) -> None:
        """Writes the dirty subgroups to their tiers (they stay resident)."""
        self._write_and_wait((i, self.blob(i, slot)) for i, slot in self.dirty.items())

    def _write_and_wait(self, blobs: Iterable[tuple[int, np.ndarray]]) -> None:
        """Writes each ``(subgroup, blob)`` to the subgroup's tier, all in flight, then waits."""
        tier_of = self._assignment.tier_of
        futures = [(self._write(self._stores[tier_of[i]], i, blob), i) for i, blob in blobs]
        for future, i in futures:
            self.wait(future, i)

    def _write(self, store: FileTierStore, index: int, blob: np.ndarray) -> Future:
        """Writes subgroup ``index``'s blob as the kind :attr:`write_kind` says; it is then
        the subgroup's state."""
        kind = self.kind_of[index] = self.write_kind(index, self.kind_of[index])
        return store.write(index, blob, kind)

    def free_buffers(self) -> list[np.ndarray]:
        """The buffers holding no dirty subgroup, emptied of their clean ones, for work between
        steps (:meth:`stream_blobs`). Call it with no write-back in flight (:meth:`drain`)."""
        self.clean.clear()
        busy = set(self.dirty.values()) | {r.slot for r in self._reads.values()}
        return [b for slot, b in enumerate(self.buffers) if slot not in busy]

    def stream_blobs(
        self, subgroups: Sequence[Subgroup], buffers: Sequence[np.ndarray], *, load: bool,
        source: Callable[[int], tuple[FileTierStore, str]] | None = None,
    ) -> Iterator[tuple[Subgroup, np.ndarray]]:  # fmt: skip
        """Yields every subgroup's blob, in order, with the tiers' I/O overlapped.

        A dirty subgroup is yielded from its slot (unless ``source`` is given). The others go
        through ``buffers``: read from their tier ahead of the caller (as many reads in flight
        as there are buffers), or, with ``load``, written to their tier behind the caller once
        it has filled the blob.

        Args:
          subgroups: the subgroups, in the order to yield them.
          buffers: float32 buffers, each at least the largest blob (at least one where a tier
            is read or written).
          load: whether the caller fills the blobs (written back) or reads them.
          source: where subgroup ``i``'s blob is read from, as (store, kind); default its tier
            and :attr:`kind_of`, or its slot when dirty.

        Raises:
          TierIOError: a read or write failed.
        """

        def where(i: int) -> tuple[FileTierStore, str]:
            if source is not None:
                return source(i)
            return self._stores[self._assignment.tier_of[i]], self.kind_of[i]

        free = list(buffers)
        queue: deque[tuple[Subgroup, np.ndarray, np.ndarray | None, Future | None]] = deque()
        try:
            if load:
                for sg in subgroups:
                    if sg.index in self.dirty:  # host memory is where it lives
                        yield sg, self.blob(sg.index, self.dirty[sg.index])
                        continue
                    if not free:  # the oldest write-back in flight gives its buffer
                        done, blob, buffer, future = queue.popleft()
                        self.wait(future, done.index)
                        free.append(buffer)
                    buffer = free.pop()
                    blob = buffer[: sg.state_elems]
                    yield sg, blob
                    queue.append(
                        (sg, blob, buffer, self._write(where(sg.index)[0], sg.index, blob))
                    )
                while queue:
                    done, _, _, future = queue.popleft()
                    self.wait(future, done.index)
                return
            todo = deque(subgroups)
            while todo or queue:
                while todo:  # reads ahead, in order, as far as the buffers allow
                    sg = todo[0]
                    if source is None and sg.index in self.dirty:
                        queue.append((sg, self.blob(sg.index, self.dirty[sg.index]), None, None))
                    elif free:
                        buffer = free.pop()
                        blob = buffer[: sg.state_elems]
                        store, kind = where(sg.index)
                        queue.append((sg, blob, buffer, store.read(sg.index, blob, kind)))
                    else:
                        break
                    todo.popleft()
                sg, blob, buffer, future = queue.popleft()
                if future is not None:
                    self.wait(future, sg.index)
                yield sg, blob
                if buffer is not None:
                    free.append(buffer)
        finally:  # no request may outlive the buffers it uses
            concurrent.futures.wait([e[3] for e in queue if e[3] is not None])

    # -- requests -------------------------------------------------------------------------

    def wait(self, future: Future, index: int, tier: int | None = None) -> None:
        """Waits for a request of subgroup ``index`` (on ``tier``, default: where it lives);
        its error names the subgroup and the tier.

        Raises:
          TierIOError: if it failed, or took longer than ``io_timeout_s``.
        """
        try:
            future.result(timeout=self._timeout)
        except TierIOError as e:
            raise type(e)(f"subgroup {index}: {e}") from e
        except concurrent.futures.TimeoutError:
            tier_of = self._assignment.tier_of if self._assignment else []
            k = tier if tier is not None else (tier_of[index] if tier_of else None)
            where = self._stores[k].tier.path if k is not None else "?"
            raise TierIOError(
                f"subgroup {index}: tier {where!r} did not complete a request within "
                f"io_timeout_s={self._timeout} s. The file system may be hung or overloaded: "
                "check it, or raise io_timeout_s if it is just slow."
            ) from None

    def _write_back(self, index: int, slot: int) -> None:
        store = self._stores[self._assignment.write_tier(index)]  # a re-planned one moves now
        future = self._write(store, index, self.blob(index, slot))
        self.writes.append(PendingWrite(future, slot, index, self.kind_of[index]))

    def _writing(self, index: int) -> bool:
        return any(w.subgroup == index for w in self.writes)

    def _issue(self, index: int, block: bool) -> bool:
        slot = self._take(index, block)
        if slot is None:
            return False
        store = self._stores[self._assignment.tier_of[index]]
        read = store.read(index, self.blob(index, slot), self.kind_of[index])
        futures = [read, *self._companion(index, slot)]
        self._reads[index] = Resident(slot, False, futures)
        return True

    def _next_use(self, index: int) -> float:
        n = self._position[index]
        return n if n > self._cursor else math.inf  # updated already: needed next step at most

    def _take(self, index: int, block: bool) -> int | None:
        """A slot to read ``index`` into (None: only by evicting something needed sooner)."""
        self._reclaim(block=False)
        while True:
            holder = {slot: j for j, slot in self.clean.items()}
            best, best_key = None, -1.0
            for slot in self._free:
                j = holder.get(slot)
                key = math.inf if j is None else self._next_use(j)
                if key > best_key:
                    best, best_key = slot, key
            if best is not None and (block or best_key > self._position[index]):
                break
            if not block:
                return None
            if self.writes:
                self._reclaim(block=True)
            elif not self._evict_dirty():
                return None
        self._free.remove(best)
        j = holder.get(best)
        if j is not None:
            del self.clean[j]
        return best

    def _evict_dirty(self) -> bool:
        """Writes back the dirty subgroup needed last and frees its slot (False: none).

        Only when every slot holds a dirty subgroup and no write is in flight: a tier that
        retains nothing (``retain_policy="slow_tiers"``) can need a read before any dirty
        subgroup is written back.
        """
        if not self.dirty:
            return False
        j = max(self.dirty, key=self._next_use)
        self._write_back(j, self.dirty.pop(j))
        self._reclaim(block=True)
        return True

    def _reclaim(self, block: bool) -> None:
        """Frees the slots of finished write-backs, oldest first (waits for one if ``block``)."""
        while self.writes and (block or self.writes[0].future.done()):
            t0 = time.monotonic()
            index, slot = self._reclaim_one()
            self._metrics.write_wait_s += time.monotonic() - t0
            self._free.append(slot)
            if self._reuse_clean:
                self.clean[index] = slot
            block = False

    def _reclaim_one(self) -> tuple[int, int]:
        """Waits for the oldest write-back (moving it to another tier if its own is full)."""
        future, slot, index, kind = self.writes.popleft()
        try:
            self.wait(future, index)
        except TierFullError as e:
            if not self._fall_back(index, kind, self.blob(index, slot), e):
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
