"""File tiers: byte-exact blobs, checksums, bandwidth caps, locks and resource hygiene."""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jax_mlpo.config import FileTier, TierLimits
from jax_mlpo.testing import tier_faults
from jax_mlpo.tiers.file import (
    CorruptBlobError,
    FileTierStore,
    NodeTokenBucket,
    TierIOError,
    TierPermits,
    TokenBucket,
)
from jax_mlpo.tiers.lock import TierInUseError, TierLock
from jax_mlpo.tiers.posix import ALIGN, aligned_empty

CRC = 4  # bytes the crc32c codec appends to every chunk file (tensorstore engine)
# "posix-threads": the posix engine with a thread per request instead of kernel AIO
ENGINES = ["posix", "posix-threads", "tensorstore"]
LOCK_MODULE = Path(__file__).resolve().parents[1] / "jax_mlpo" / "tiers" / "lock.py"


def random_blob(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 with arbitrary bit patterns (NaN payloads, infinities, denormals included)."""
    return rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


def tier_config(path, io_engine: str = "posix", **tier_kwargs) -> FileTier:
    if io_engine == "posix-threads":
        io_engine, tier_kwargs["io_submit"] = "posix", "threads"
    return FileTier(str(path), io_engine=io_engine, **tier_kwargs)


def open_store(path, lengths, **tier_kwargs) -> FileTierStore:
    """A store holding ``"state"`` blobs of the given lengths, one slot each."""
    tier = tier_config(path, **tier_kwargs)
    permits = TierPermits(tier.path, tier.limits.max_concurrency, tier.limits.max_concurrency)
    return FileTierStore(tier, {"state": list(lengths)}, permits)


def posix_file_bytes(n: int, chunk_bytes: int = 8 << 20) -> int:
    """Size of a posix-engine blob file: the data padded to 4 KiB, then a 4 KiB-padded trailer
    (24-byte header, a crc32c per chunk, the trailer's own crc32c)."""
    chunks = max(1, -(-4 * n // chunk_bytes))
    return -(-4 * n // ALIGN) * ALIGN + -(-(24 + 4 * chunks + 4) // ALIGN) * ALIGN


def blob_file_bytes(engine: str, n: int) -> int:
    return posix_file_bytes(n) if engine.startswith("posix") else 4 * n + CRC


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- data round trips ---------------------------------------------------------------------------


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc only")
def test_io_buffers_are_private_and_advised_for_huge_pages():
    # Large buffers ask for transparent huge pages (larger requests reach the disk); a shared
    # mapping would be shmem, which the advice does not cover.
    from jax_mlpo.tiers import posix

    large = aligned_empty(posix.HUGE_PAGE)  # 8 MiB of float32
    small = aligned_empty(1000)
    for buf in (large, small):
        assert buf.ctypes.data % ALIGN == 0 and not buf.any()
        assert "sh" not in vm_flags(buf.ctypes.data)  # private, not shared
    assert "hg" in vm_flags(large.ctypes.data)
    assert "hg" not in vm_flags(small.ctypes.data)
    assert "hg" not in vm_flags(aligned_empty(posix.HUGE_PAGE, huge_pages=False).ctypes.data)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("engine", ENGINES)
def test_blobs_split_into_chunks_round_trip_and_every_chunk_is_checked(engine, aligned, tmp_path):
    rng = np.random.default_rng(1)
    lengths = [10_000, 1024, 3]  # 1024-element chunks: 10 chunks (the last partial), 1, 1
    store = open_store(tmp_path / "tier", lengths, sync=False, chunk_bytes=4096, io_engine=engine)

    def buffer(n: int) -> np.ndarray:
        # page-aligned buffers go to O_DIRECT in place; others through the bounce buffer
        return aligned_empty(n) if aligned else np.empty(n + 1, np.float32)[1:]

    try:
        blobs = [random_blob(rng, n) for n in lengths]
        for slot, blob in enumerate(blobs):
            src = buffer(len(blob))
            src[:] = blob
            store.write(slot, src).result()
        for slot, blob in enumerate(blobs):
            out = buffer(len(blob))
            store.read(slot, out).result()
            assert same_bytes(out, blob), f"slot {slot}"
        if engine.startswith("posix"):
            (path,) = store.blob_files(0)
            assert store._blobs._direct  # /tmp supports O_DIRECT here; tmpfs would not
            assert os.path.getsize(path) == posix_file_bytes(10_000, 4096)
            # flip one byte in chunk 7 of 10: that chunk is named
            with open(path, "r+b") as f:
                f.seek(7 * 4096 + 5)
                byte = f.read(1)
                f.seek(7 * 4096 + 5)
                f.write(bytes([byte[0] ^ 0x01]))
            match = "chunk 7"
        else:
            chunks = [Path(p) for p in store.blob_files(0)]
            assert len(chunks) == 10
            # zarr stores the partial last chunk whole: 10 chunks of 1024 elements
            assert sum(p.stat().st_size - CRC for p in chunks) == 4 * 10 * 1024
            victim = sorted(chunks)[7]
            data = bytearray(victim.read_bytes())
            data[5] ^= 0x01
            victim.write_bytes(bytes(data))
            match = "checksum"
        with pytest.raises(CorruptBlobError, match=match):
            store.read(0, np.empty(lengths[0], np.float32)).result()
    finally:
        store.close()


LENGTHS = [1, 7, 4096, 7, 100_000, 3, 4096]


@pytest.mark.parametrize("engine", ENGINES)
def test_round_trip_is_byte_exact(engine, tmp_path):
    rng = np.random.default_rng(0)
    store = open_store(tmp_path / "tier", LENGTHS, sync=False, io_engine=engine)
    try:
        blobs = [random_blob(rng, n) for n in LENGTHS]
        for slot, blob in enumerate(blobs):
            store.write(slot, blob).result()
        for slot, blob in enumerate(blobs):
            out = np.full(len(blob), np.nan, np.float32)
            store.read(slot, out).result()
            assert same_bytes(out, blob), f"slot {slot}"
            # one file per blob, holding the blob and its checksum(s)
            assert os.path.getsize(store.blob_path(slot)) == blob_file_bytes(engine, len(blob))
        # overwriting one blob leaves the others alone
        blobs[3] = random_blob(rng, LENGTHS[3])
        store.write(3, blobs[3]).result()
        for slot, blob in enumerate(blobs):
            out = np.empty(len(blob), np.float32)
            store.read(slot, out).result()
            assert same_bytes(out, blob), f"slot {slot} after overwrite"
        assert store.bytes_written == 4 * (sum(LENGTHS) + LENGTHS[3])
        assert store.bytes_read == 4 * 2 * sum(LENGTHS)
    finally:
        store.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_concurrent_reads_and_writes_are_byte_exact(engine, tmp_path):
    rng = np.random.default_rng(1)
    lengths = [1000, 333, 4096, 1, 2048] * 5
    store = open_store(
        tmp_path / "tier",
        lengths,
        limits=TierLimits(max_concurrency=4),
        sync=False,
        chunk_bytes=4096,
        io_engine=engine,
    )
    try:
        blobs = [random_blob(rng, n) for n in lengths]
        writes = [store.write(slot, blob) for slot, blob in enumerate(blobs)]  # all outstanding
        for f in writes:
            f.result()
        outs = [np.empty(n, np.float32) for n in lengths]
        reads = [store.read(slot, out) for slot, out in enumerate(outs)]
        for f in reads:
            f.result()
        for slot, (out, blob) in enumerate(zip(outs, blobs, strict=True)):
            assert same_bytes(out, blob), f"slot {slot}"

        # Rewrite the even slots while reading the odd ones, all in flight together.
        new = {s: random_blob(rng, lengths[s]) for s in range(0, len(lengths), 2)}
        outs = {s: np.empty(lengths[s], np.float32) for s in range(1, len(lengths), 2)}
        futures = []
        for s in range(len(lengths)):
            futures.append(store.write(s, new[s]) if s in new else store.read(s, outs[s]))
        for f in futures:
            f.result()
        for s, out in outs.items():
            assert same_bytes(out, blobs[s]), f"odd slot {s}"
        for s, blob in new.items():
            out = np.empty(lengths[s], np.float32)
            store.read(s, out).result()
            assert same_bytes(out, blob), f"rewritten slot {s}"
    finally:
        store.close()


def max_overlap(spans) -> int:
    events = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
    depth = best = 0
    for _, step in events:
        depth += step
        best = max(best, depth)
    return best


def test_requests_in_flight_bounded_per_direction(tmp_path):
    # The cap makes each request last ~10 ms, so requests that may overlap do.
    n, slots = 2048, 8
    store = open_store(
        tmp_path / "tier",
        [n] * 2 * slots,
        limits=TierLimits(max_concurrency=2, bandwidth_cap=4 * n * 100),
        sync=False,
    )
    try:
        for f in [store.write(s, np.full(n, s, np.float32)) for s in range(slots, 2 * slots)]:
            f.result()
        store.trace = []
        outs = [np.empty(n, np.float32) for _ in range(slots)]
        futures = [store.write(s, np.full(n, s, np.float32)) for s in range(slots)]
        futures += [store.read(slots + s, out) for s, out in enumerate(outs)]
        for f in futures:
            f.result()
        for kind in ("read", "write"):
            spans = [(t0, t1) for k, _, t0, t1 in store.trace if k == kind]
            assert len(spans) == slots
            assert max_overlap(spans) == 2, kind
        assert max_overlap([(t0, t1) for _, _, t0, t1 in store.trace]) <= 4
        for s, out in enumerate(outs):
            assert np.all(out == slots + s)
    finally:
        store.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_blob_kinds_are_separate(engine, tmp_path):
    tier = tier_config(tmp_path / "tier", sync=False, io_engine=engine)
    kinds = {"state": [30, 30, 9], "grad": [10, 10, 3]}
    store = FileTierStore(tier, kinds, TierPermits(tier.path, 2, 2))
    try:
        rng = np.random.default_rng(5)
        data = {(k, s): random_blob(rng, n) for k, ns in kinds.items() for s, n in enumerate(ns)}
        for f in [store.write(s, x, kind=k) for (k, s), x in data.items()]:
            f.result()
        paths = {store.blob_path(s, kind=k) for (k, s) in data}
        assert len(paths) == len(data)  # one file per (kind, slot)
        for (k, s), x in data.items():
            out = np.empty(len(x), np.float32)
            store.read(s, out, kind=k).result()
            assert same_bytes(out, x), (k, s)
            assert os.path.getsize(store.blob_path(s, kind=k)) == blob_file_bytes(engine, len(x))
    finally:
        store.close()


# -- corruption ---------------------------------------------------------------------------------

CORRUPTIONS = {
    "tensorstore": [
        ("data-first", lambda n, size: 0),
        ("data-last", lambda n, size: size - CRC - 1),
        ("crc", lambda n, size: size - 2),
    ],
    "posix": [
        ("data-first", lambda n, size: 0),
        ("data-last", lambda n, size: 4 * n - 1),
        ("trailer-magic", lambda n, size: -(-4 * n // ALIGN) * ALIGN),
        ("trailer-length", lambda n, size: -(-4 * n // ALIGN) * ALIGN + 8),
        ("chunk-crc", lambda n, size: -(-4 * n // ALIGN) * ALIGN + 25),
        ("data-padding", lambda n, size: 4 * n + 1),
        ("trailer-padding", lambda n, size: size - 100),
        ("trailer-crc", lambda n, size: size - 2),
    ],
}
CORRUPTIONS["posix-threads"] = CORRUPTIONS["posix"]
CORRUPTION_CASES = [(e, n, w) for e, cases in CORRUPTIONS.items() for n, w in cases]


@pytest.mark.parametrize(
    "engine,where",
    [(e, w) for e, _, w in CORRUPTION_CASES],
    ids=[f"{e}-{n}" for e, n, _ in CORRUPTION_CASES],
)
def test_flipped_byte_is_detected(engine, where, tmp_path):
    rng = np.random.default_rng(2)
    lengths = [64, 5, 64, 1]
    tier_path = str(tmp_path / "tier")
    store = open_store(tier_path, lengths, sync=False, io_engine=engine)
    try:
        blobs = [random_blob(rng, n) for n in lengths]
        for slot, blob in enumerate(blobs):
            store.write(slot, blob).result()
        for slot in range(len(lengths)):
            path = Path(store.blob_path(slot))
            original = path.read_bytes()
            assert len(original) == blob_file_bytes(engine, lengths[slot])
            corrupt = bytearray(original)
            corrupt[where(lengths[slot], len(original))] ^= 0x10
            path.write_bytes(bytes(corrupt))
            with pytest.raises(CorruptBlobError) as info:
                store.read(slot, np.empty(lengths[slot], np.float32)).result()
            message = str(info.value)
            assert f"tier {tier_path!r}" in message
            assert str(path) in message
            assert "checksum" in message
            # the other blobs are untouched and still read back exactly
            for other in set(range(len(lengths))) - {slot}:
                out = np.empty(lengths[other], np.float32)
                store.read(other, out).result()
                assert same_bytes(out, blobs[other])
            path.write_bytes(original)
            out = np.empty(lengths[slot], np.float32)
            store.read(slot, out).result()
            assert same_bytes(out, blobs[slot])
    finally:
        store.close()


def test_torn_write_is_detected(tmp_path):
    # A crash after a rewrite's chunks landed but before its trailer did: new data, old checksums.
    rng = np.random.default_rng(3)
    store = open_store(tmp_path / "tier", [3000], sync=False, chunk_bytes=4096)
    try:
        old, new = random_blob(rng, 3000), random_blob(rng, 3000)
        store.write(0, old).result()
        with open(store.blob_path(0), "r+b") as f:
            f.write(new[:1024].tobytes())  # the first chunk of the rewrite only
        with pytest.raises(CorruptBlobError, match="1 of 3 chunks fail their crc32c"):
            store.read(0, np.empty(3000, np.float32)).result()
        store.write(0, new).result()  # a complete rewrite heals it
        out = np.empty(3000, np.float32)
        store.read(0, out).result()
        assert same_bytes(out, new)
    finally:
        store.close()


def test_truncated_and_missing_blob_files_are_named(tmp_path):
    store = open_store(tmp_path / "tier", [3000, 10], sync=False)
    try:
        store.write(0, np.ones(3000, np.float32)).result()
        path = store.blob_path(0)
        os.truncate(path, 4096)
        with pytest.raises(CorruptBlobError, match=r"state-0\.blob is 4096 bytes.*truncated"):
            store.read(0, np.empty(3000, np.float32)).result()
        with pytest.raises(TierIOError, match=r"never written.*state-1\.blob.*Restore"):
            store.read(1, np.empty(10, np.float32)).result()
    finally:
        store.close()


def test_posix_tier_without_o_direct_uses_the_page_cache(tmp_path, caplog, monkeypatch):
    # A file system that refuses O_DIRECT (EINVAL at open, as older tmpfs and some network file
    # systems do): the tier says so once and still round-trips exactly through the page cache.
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr("jax_mlpo.tiers.posix.os.open", refusing_open)
    rng = np.random.default_rng(4)
    store = open_store(tmp_path / "tier", [5000, 3], sync=True, chunk_bytes=8192)
    try:
        blobs = [random_blob(rng, 5000), random_blob(rng, 3)]
        with caplog.at_level("WARNING", logger="jax_mlpo.tiers.posix"):
            for slot, blob in enumerate(blobs):
                store.write(slot, blob).result()
        assert [r.message for r in caplog.records] == [
            f"{tmp_path / 'tier'} does not support O_DIRECT (tmpfs?); this tier uses the page cache"
        ]
        for slot, blob in enumerate(blobs):
            out = aligned_empty(len(blob))
            store.read(slot, out).result()
            assert same_bytes(out, blob)
    finally:
        store.close()


@pytest.mark.parametrize("engine", ["posix", "posix-threads"])
def test_reads_are_served_before_queued_writes(engine, tmp_path):
    # One request in flight: reads submitted after a burst of writes still go first.
    n, slots = 4096, 6
    store = open_store(
        tmp_path / "tier",
        [n] * 2 * slots,
        io_engine=engine,
        limits=TierLimits(max_concurrency=8),
        queue_depth=1,
        chunk_bytes=4096,
        sync=False,
    )
    try:
        for f in [store.write(s, np.full(n, s, np.float32)) for s in range(slots, 2 * slots)]:
            f.result()
        store.trace = []
        with tier_faults(store) as plan:  # no faults: it records the requests as they start
            writes = [store.write(s, np.full(n, s, np.float32)) for s in range(slots)]
            plan.wait_for(slots, op="write")  # every write has started its I/O
            outs = [np.empty(n, np.float32) for _ in range(2)]
            reads = [store.read(slots + s, out) for s, out in enumerate(outs)]
            for f in writes + reads:
                f.result()
        assert [e.op for e in plan.trace] == ["write"] * slots + ["read"] * 2
        ends = {(k, s): t1 for k, s, _, t1 in store.trace}
        last_read = max(ends[("read", slots + s)] for s in range(2))
        assert last_read < max(ends[("write", s)] for s in range(slots))
        for s, out in enumerate(outs):
            assert np.all(out == slots + s)
    finally:
        store.close()


# -- bandwidth cap ------------------------------------------------------------------------------


def assert_paced(spans, rate: float) -> None:
    """``spans``: (nbytes, reservation start, reservation end) on one clock. They follow each
    other without overlap, each as long as its bytes take at ``rate``."""
    spans = sorted(spans, key=lambda span: span[1])
    for nbytes, start, end in spans:
        assert end - start == pytest.approx(nbytes / rate, rel=1e-9)
    for (_, _, end), (_, start, _) in zip(spans[:-1], spans[1:], strict=True):
        assert start >= end, (end, start)


def test_token_bucket_paces_threads_together():
    rate, nbytes, per_thread, threads = 4e6, 50_000, 10, 4
    bucket = TokenBucket(rate)
    time.sleep(0.05)  # idle time since the bucket was made must not be banked as credit
    done: list[tuple[float, float, float, float]] = []  # asked, start, end, returned

    def transfer():
        for _ in range(per_thread):
            asked = time.monotonic()
            start, end = bucket.reserve_span(nbytes)
            bucket.wait_until(end)
            done.append((asked, start, end, time.monotonic()))

    workers = [threading.Thread(target=transfer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(done) == per_thread * threads
    # one clock for every thread: reservations back to back, none overlapping
    assert_paced([(nbytes, start, end) for _, start, end, _ in done], rate)
    for asked, start, end, returned in done:
        assert start >= asked  # no reservation starts before it was asked for (no credit)
        assert returned >= end  # the transfer waited for its reservation's end
    assert bucket.reserve(nbytes) >= max(end for _, _, end, _ in done) + nbytes / rate


def test_bandwidth_cap_paces_a_store(tmp_path):
    n, slots, cap = 16_384, 4, 2_000_000
    store = open_store(
        tmp_path / "tier", [n] * slots, limits=TierLimits(bandwidth_cap=cap), sync=False
    )
    try:
        store.trace, store.pacing = [], []
        data = np.ones(n, np.float32)
        outs = [np.empty(n, np.float32) for _ in range(slots)]
        futures = [store.write(s, data) for s in range(slots)]
        for f in futures:
            f.result()
        futures = [store.read(s, out) for s, out in enumerate(outs)]
        for f in futures:
            f.result()
        moved = 2 * slots * 4 * n
        assert store.bytes_read + store.bytes_written == moved
        requests = [(name, slot) for name in ("write", "read") for slot in range(slots)]
        assert sorted((name, slot) for name, slot, _, _ in store.pacing) == sorted(requests)
        assert_paced([(4 * n, start, end) for _, _, start, end in store.pacing], cap)
        ended = {(name, slot): t1 for name, slot, _, t1 in store.trace}
        for name, slot, _, end in store.pacing:  # none ended before its reservation did
            assert ended[(name, slot)] >= end, (name, slot)
        # a device that slows down: the new cap from the next request on
        store.set_bandwidth_cap(cap / 4)
        assert store.bandwidth_cap == cap / 4
        store.pacing = []
        store.write(0, data).result()
        assert_paced([(4 * n, start, end) for _, _, start, end in store.pacing], cap / 4)
        store.set_bandwidth_cap(None)
        store.pacing = []
        store.write(0, data).result()
        assert store.bandwidth_cap is None and store.pacing == []
    finally:
        store.close()


# -- locks --------------------------------------------------------------------------------------


def test_second_lock_in_same_process(tmp_path):
    first = TierLock(str(tmp_path))
    try:
        with pytest.raises(
            TierInUseError, match=f"in use by pid {os.getpid()} on {socket.gethostname()}"
        ) as info:
            TierLock(str(tmp_path))
        assert str(tmp_path / TierLock.FILENAME) in str(info.value)
    finally:
        first.release()
    second = TierLock(str(tmp_path))  # released: free again
    assert second.previous_owner is None  # a clean release leaves no owner record
    second.release()


def test_second_store_on_same_directory(tmp_path):
    store = open_store(tmp_path / "tier", [8], sync=False)
    try:
        with pytest.raises(TierInUseError, match=f"pid {os.getpid()}"):
            open_store(tmp_path / "tier", [8], sync=False)
        store.write(0, np.arange(8, dtype=np.float32)).result()  # the first is unharmed
    finally:
        store.close()
    open_store(tmp_path / "tier", [8], sync=False).close()


def test_lock_file_and_directory_permissions(tmp_path):
    tier = tmp_path / "fresh"
    store = open_store(tier, [8], sync=False)
    try:
        assert stat.S_IMODE(tier.stat().st_mode) == 0o700
        assert stat.S_IMODE((tier / TierLock.FILENAME).stat().st_mode) == 0o600
    finally:
        store.close()


CHILD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("tier_lock", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
lock = module.TierLock(sys.argv[2])
print("locked", flush=True)
time.sleep(60)
"""


def test_lock_held_by_another_process_then_stale(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(LOCK_MODULE), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        before = fd_count()
        for _ in range(3):
            with pytest.raises(TierInUseError, match=f"in use by pid {child.pid} on "):
                TierLock(str(tmp_path))
        assert fd_count() == before  # failed attempts close their descriptor
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    # The kernel dropped the dead child's lock; its owner record is reported as stale.
    lock = TierLock(str(tmp_path))
    try:
        assert lock.previous_owner is not None and f"pid {child.pid} " in lock.previous_owner
    finally:
        lock.release()


# -- resource hygiene ---------------------------------------------------------------------------


@pytest.mark.parametrize("node_permits", [False, True], ids=["process-permits", "node-permits"])
def test_no_file_descriptor_leak(node_permits, tmp_path):
    def cycle(i: int) -> None:
        tier = FileTier(str(tmp_path / f"tier{i % 3}"), sync=False)
        node = dict(node_dir=str(tmp_path / "permits"), node_reads=2, node_writes=2)
        permits = TierPermits(tier.path, 2, 2, **(node if node_permits else {}))
        store = FileTierStore(tier, {"state": [10, 7, 10]}, permits)
        store.write(1, np.ones(7, np.float32)).result()
        store.read(1, np.empty(7, np.float32)).result()
        with pytest.raises(TierIOError, match="never written"):  # the error path closes too
            store.read(2, np.empty(10, np.float32)).result()
        store.close()

    for i in range(3):  # warm up tensorstore's own long-lived resources
        cycle(i)
    before = fd_count()
    for i in range(20):
        cycle(i)
    assert fd_count() == before


def test_busy_time_counts_the_request_in_flight(tmp_path):
    # Write-behind keeps a tier busy across step boundaries: a window that ends mid-request
    # must still see the time (the re-plan divides by it).
    n = 4096
    store = open_store(tmp_path / "tier", [n], sync=False)
    try:
        before = store.busy_s
        with tier_faults(store) as plan:
            plan.hang("write")  # in flight until released
            future = store.write(0, np.ones(n, np.float32))
            plan.wait_for(1, op="write", outcome="hung")
            mid = store.busy_s
            later = store.busy_s
            assert not future.done() and before < mid < later  # the open period counts
            plan.release()
            future.result()
        done = store.busy_s
        assert later <= done == store.busy_s  # idle: the period is closed, nothing accrues
    finally:
        store.close()


def test_node_bandwidth_cap_is_shared_by_the_node(tmp_path):
    # Two stores of one tier (as two processes of a node see it: their own proc<k> directories,
    # one permits key) pace on one clock: together they move at most the cap.
    n, blobs, rate = 8192, 4, 4 * 8192 / 0.05  # 50 ms per blob at the cap
    stores = []
    for k in range(2):
        tier = FileTier(
            str(tmp_path / "tier" / f"proc{k}"),
            limits=TierLimits(node_bandwidth_cap=rate, permits_key=str(tmp_path / "tier")),
            sync=False,
        )
        permits = TierPermits(tier.path, 4, 4)
        stores.append(FileTierStore(tier, {"state": [n] * blobs}, permits, str(tmp_path / "n")))
    try:
        for s in stores:
            s.trace, s.pacing = [], []
        futures = [s.write(i, np.ones(n, np.float32)) for s in stores for i in range(blobs)]
        for f in futures:
            f.result()
        # 8 reservations on one clock, whichever store made them
        spans = [(4 * n, start, end) for s in stores for _, _, start, end in s.pacing]
        assert len(spans) == 2 * blobs
        assert_paced(spans, rate)
        for s in stores:
            ended = {slot: t1 for _, slot, _, t1 in s.trace}
            assert all(ended[slot] >= end for _, slot, _, end in s.pacing)
    finally:
        for s in stores:
            s.close()


def test_node_clocks_queue_together_and_process_clocks_do_not(tmp_path):
    # Reservations only (nobody waits for them): 10 s each, so the order of the calls decides.
    nbytes, rate = 1000, 100.0
    path = str(tmp_path / "clock")
    node = [NodeTokenBucket(path, rate), NodeTokenBucket(path, rate)]  # two processes' views
    try:
        spans = [node[k % 2].reserve_span(nbytes) for k in range(4)]
    finally:
        for bucket in node:
            bucket.close()
    assert_paced([(nbytes, *span) for span in spans], rate)
    assert [b[0] for b in spans[1:]] == [a[1] for a in spans[:-1]]  # each right after the last
    process = [TokenBucket(rate), TokenBucket(rate)]
    first, second = (bucket.reserve_span(nbytes) for bucket in process)
    assert second[0] < first[1]  # each process's clock is its own: both reserve at once


@pytest.mark.parametrize("io_engine", ["posix", "tensorstore"])
def test_a_full_file_system_is_recognised_by_its_errno(tmp_path, io_engine):
    """ENOSPC from the I/O engine is a TierFullError (which the pool falls back on); any other
    OSError stays a plain TierIOError."""
    from jax_mlpo.tiers.file import TierFullError

    store = open_store(tmp_path / io_engine, [64], io_engine=io_engine, sync=False)
    try:
        with tier_faults(store) as plan:
            plan.fail("write", nth=1, errno=errno.ENOSPC).fail("write", nth=2, errno=errno.EIO)
            for code, want in ((errno.ENOSPC, TierFullError), (errno.EIO, TierIOError)):
                with pytest.raises(TierIOError) as info:
                    store.write(0, np.zeros(64, np.float32)).result()
                assert type(info.value) is want, (code, info.value)
                assert os.strerror(code) in str(info.value)
                assert store.blob_path(0) in str(info.value)
                if want is TierFullError:
                    assert "the file system is full" in str(info.value)
            store.write(0, np.ones(64, np.float32)).result()  # the tier still works afterwards
        assert plan.outcomes("write") == ["failed", "failed", "passed"]
        out = np.empty(64, np.float32)
        store.read(0, out).result()
        assert np.all(out == 1.0)
    finally:
        store.close()
