"""The host cache and its I/O pipeline (jax_mlpo.engine.buffers) against an in-memory fake tier.

The fake keeps blobs in a dict and records every request; writes can be held back with an
event, so the tests decide when a write-back finishes and check what the pipeline does
meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import errno
import threading
import types

import numpy as np
import pytest

from jax_mlpo.engine.buffers import IOPipeline, PendingWrite, SlotCache, touched_buffer
from jax_mlpo.engine.placement import TierAssignment, TierSplit
from jax_mlpo.engine.snapshot import CopyOnWrite
from jax_mlpo.engine.step_metrics import StepMetrics
from jax_mlpo.tiers.errors import TierFullError, TierIOError

ELEMS = 64  # float32 per blob


class FakeTier:
    """Blobs in a dict; ``hold`` (an Event) makes writes wait until it is set."""

    def __init__(self, path: str, hold: threading.Event | None = None, full: bool = False):
        self.tier = types.SimpleNamespace(path=path)
        self.blobs: dict[int, np.ndarray] = {}
        self.log: list[tuple[str, int]] = []
        self._hold = hold
        self._full = full
        self._pool = concurrent.futures.ThreadPoolExecutor(4)

    def read(self, slot, out, kind="state"):
        self.log.append(("read", slot))
        out[:] = self.blobs[slot]
        future = concurrent.futures.Future()
        future.set_result(None)
        return future

    def write(self, slot, data, kind="state"):
        self.log.append(("write", slot))

        def run():
            if self._hold is not None:
                self._hold.wait(10)
            if self._full:
                raise TierFullError(f"tier {self.tier.path!r}: {OSError(errno.ENOSPC, 'full')}")
            self.blobs[slot] = data.copy()

        return self._pool.submit(run)

    def close(self):
        self._pool.shutdown()


def make_pipeline(
    n, slots, stores, *, retained=0, reuse_clean=True, depth=1, tier_counts=None, timeout=10
):
    counts = tier_counts or (n,)
    split = TierSplit(tuple(counts), (retained,) + (0,) * (len(counts) - 1))
    assignment = TierAssignment(
        [s.tier.path for s in stores], [(1.0, 1.0)] * len(stores), split, [4 * ELEMS] * n,
        adaptive=False,
    )  # fmt: skip
    cache = SlotCache(
        [touched_buffer(ELEMS) for _ in range(slots)], [ELEMS] * n, reuse_clean=reuse_clean
    )
    pipeline = IOPipeline(
        cache, stores, assignment, CopyOnWrite(n), prefetch_depth=depth, fallback_on_full=True,
        io_timeout_s=timeout,
    )  # fmt: skip
    for i, k in enumerate(assignment.tier_of):
        stores[k].blobs[i] = np.full(ELEMS, float(i), np.float32)
    return pipeline, assignment


def run_step(pipeline, order, keep=(), update=True):
    """One step: each subgroup acquired, prefetched past, +1000 added, released."""
    pipeline.begin_step(order, StepMetrics(step=1))
    hits = []
    for i in order:
        resident = pipeline.acquire(i)
        pipeline.prefetch()
        pipeline.await_reads(i, resident)
        if update:
            pipeline.cache.blob(i, resident.slot)[:] += 1000.0
        hits.append(resident.hit)
        pipeline.release(i, resident.slot, keep=i in keep)
    pipeline.end_step(write_behind=True)
    return hits


def test_reads_are_prefetched_in_order_and_writes_are_named():
    hold = threading.Event()
    tier = FakeTier("/a", hold=hold)
    pipeline, _ = make_pipeline(6, 4, [tier], depth=2)
    pipeline.begin_step(list(range(6)), StepMetrics(step=1))
    first = pipeline.acquire(0)
    pipeline.prefetch()
    # the read of 0, then prefetch_depth (2) more ahead: nothing else
    assert tier.log == [("read", 0), ("read", 1), ("read", 2)]
    assert not first.hit and len(first.reads) == 1
    pipeline.await_reads(0, first)
    np.testing.assert_array_equal(pipeline.cache.blob(0, first.slot), 0.0)
    pipeline.release(0, first.slot, keep=False)
    (pending,) = pipeline.writes
    assert isinstance(pending, PendingWrite) and (pending.slot, pending.subgroup) == (first.slot, 0)
    hold.set()
    pipeline.drain()
    assert ("write", 0) in tier.log and not pipeline.writes


def test_dirty_and_clean_hits_need_no_read():
    tier = FakeTier("/a")
    pipeline, _ = make_pipeline(4, 4, [tier])
    assert run_step(pipeline, [0, 1, 2, 3], keep={2, 3}) == [False] * 4
    pipeline.drain()  # 0 and 1 written back: clean in their slots
    assert set(pipeline.cache.dirty) == {2, 3} and set(pipeline.cache.clean) == {0, 1}
    tier.log.clear()
    assert run_step(pipeline, [3, 2, 1, 0], keep={0, 1}) == [True] * 4
    assert [op for op, _ in tier.log] == ["write", "write"]  # 3 and 2 written back, no read
    pipeline.drain()
    for i in range(4):  # every update applied once per step
        slot = pipeline.cache.dirty.get(i, pipeline.cache.clean.get(i))
        np.testing.assert_array_equal(pipeline.cache.blob(i, slot), i + 2000.0)


def test_without_clean_reuse_a_written_back_subgroup_is_read_again():
    tier = FakeTier("/a")
    pipeline, _ = make_pipeline(4, 4, [tier], reuse_clean=False)
    run_step(pipeline, [0, 1, 2, 3])
    pipeline.drain()
    assert pipeline.cache.clean == {}
    tier.log.clear()
    assert run_step(pipeline, [3, 2, 1, 0]) == [False] * 4
    assert sorted(s for op, s in tier.log if op == "read") == [0, 1, 2, 3]


def test_a_read_evicts_the_clean_subgroup_needed_last():
    tier = FakeTier("/a")
    pipeline, _ = make_pipeline(6, 3, [tier], depth=1)
    run_step(pipeline, [0, 1, 2, 3, 4, 5])
    pipeline.drain()
    assert set(pipeline.cache.clean) == {3, 4, 5}  # the last three, clean in the three slots
    tier.log.clear()
    # the next step wants 5, 4, 3 (hits), then 2, 1, 0 (reads): a read never evicts a clean
    # subgroup still needed before the one it reads
    hits = run_step(pipeline, [5, 4, 3, 2, 1, 0])
    assert hits == [True, True, True, False, False, False]
    reads = [s for op, s in tier.log if op == "read"]
    assert reads == [2, 1, 0]
    assert tier.log.index(("read", 2)) > tier.log.index(("write", 3))  # 3 was updated first


def test_every_slot_dirty_and_no_write_in_flight_evicts_the_dirty_needed_last():
    tier = FakeTier("/a")
    pipeline, _ = make_pipeline(5, 2, [tier], depth=1)
    run_step(pipeline, [0, 1, 2, 3, 4], keep={3, 4})
    pipeline.drain()
    assert set(pipeline.cache.dirty) == {3, 4}
    tier.log.clear()
    # an order that needs a read before any dirty subgroup: 0 first
    run_step(pipeline, [0, 4, 3, 2, 1])
    first = tier.log[:2]
    assert first == [("write", 3), ("read", 0)]  # 3 is needed after 4: written back for 0


def test_write_behind_keeps_the_slot_busy_until_the_write_finishes():
    hold = threading.Event()
    tier = FakeTier("/a", hold=hold)
    pipeline, _ = make_pipeline(4, 4, [tier])
    run_step(pipeline, [0, 1, 2, 3])
    assert len(pipeline.writes) == 4 and all(not w.future.done() for w in pipeline.writes)
    assert pipeline.cache.clean == {}
    hold.set()
    pipeline.drain()
    assert not pipeline.writes and set(pipeline.cache.clean) == {0, 1, 2, 3}


def test_a_full_tier_moves_the_subgroup_to_another_and_keeps_its_state():
    full, other = FakeTier("/full", full=True), FakeTier("/other")
    pipeline, assignment = make_pipeline(4, 4, [full, other], tier_counts=(2, 2))
    on_full = [i for i, k in enumerate(assignment.tier_of) if k == 0]
    run_step(pipeline, [0, 1, 2, 3])
    pipeline.drain()
    assert all(assignment.tier_of[i] == 1 for i in on_full)
    for i in on_full:
        np.testing.assert_array_equal(other.blobs[i], i + 1000.0)


def test_a_full_tier_without_another_fails_with_the_tier_named():
    tier = FakeTier("/only", full=True)
    pipeline, _ = make_pipeline(2, 2, [tier])
    with pytest.raises(TierFullError, match="subgroup 0: tier '/only'"):
        run_step(pipeline, [0, 1])  # raised by the step's reclaim, or else the drain
        pipeline.drain()
    pipeline.abort()
    assert not pipeline.writes


def test_abort_lets_nothing_outlive_a_failed_step():
    hold = threading.Event()
    tier = FakeTier("/a", hold=hold)
    pipeline, _ = make_pipeline(4, 4, [tier])
    run_step(pipeline, [0, 1, 2, 3])
    hold.set()
    pipeline.abort()
    assert not pipeline.writes and pipeline.cache.clean == {}


def test_a_hung_request_times_out_naming_the_tier():
    tier = FakeTier("/slow")
    pipeline, _ = make_pipeline(1, 1, [tier], timeout=0.05)
    with pytest.raises(TierIOError, match="tier '/slow' did not complete a request"):
        pipeline.wait(concurrent.futures.Future(), 0)
