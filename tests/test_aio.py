"""The kernel-AIO request queue (``ffi/aio_queue.cc``) and the tier's fallback to threads."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from jax_mlpo.config import FileTier
from jax_mlpo.errors import AioUnavailableError
from jax_mlpo.native.kernels import crc32c
from jax_mlpo.tiers import posix
from jax_mlpo.tiers.errors import CorruptBlobError
from jax_mlpo.tiers.file import FileTierStore, TierPermits
from jax_mlpo.tiers.posix import (
    ALIGN,
    AioQueue,
    AioRequest,
    AioSubmitter,
    Chunk,
    ThreadSubmitter,
    aligned_empty,
)


def random_bytes(rng: np.random.Generator, n: int, aligned: bool) -> np.ndarray:
    buf = aligned_empty(n + 1, np.uint8)
    view = buf[:n] if aligned else buf[1 : n + 1]  # off a page boundary: bounced
    view[:] = rng.integers(0, 256, n, dtype=np.uint8)
    return view


@pytest.fixture
def queue():
    q = AioQueue(depth=4)
    yield q
    q.close()


def test_concurrent_callers_round_trip_with_checksums(queue, tmp_path):
    # Four threads, each moving one file of aligned and unaligned chunks through one queue of
    # depth 4 (so requests wait in the queue), then reading it back.
    rng = np.random.default_rng(0)
    chunk, chunks = 64 * 1024, 6
    files = [str(tmp_path / f"f{i}") for i in range(4)]
    data = [[random_bytes(rng, chunk, aligned=k % 2 == 0) for k in range(chunks)] for _ in files]
    errors: list[BaseException] = []

    def round_trip(i: int) -> None:
        try:
            fd = os.open(files[i], os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                writes = [AioRequest(fd, d, k * chunk, chunk, True) for k, d in enumerate(data[i])]
                results = queue.run(writes, blob=i)
                assert [m for m, _ in results] == [chunk] * chunks
                assert [c for _, c in results] == [crc32c(d) for d in data[i]]
                mine = np.random.default_rng(i)  # a Generator is not thread-safe
                outs = [random_bytes(mine, chunk, aligned=k % 3 == 0) for k in range(chunks)]
                reads = [AioRequest(fd, o, k * chunk, chunk, False) for k, o in enumerate(outs)]
                results = queue.run(reads, blob=10 + i)
                for k, (out, (moved, crc)) in enumerate(zip(outs, results, strict=True)):
                    assert moved == chunk and crc == crc32c(data[i][k])
                    assert out.tobytes() == data[i][k].tobytes()
            finally:
                os.close(fd)
        except BaseException as e:  # raised by the main thread below
            errors.append(e)

    threads = [threading.Thread(target=round_trip, args=(i,)) for i in range(len(files))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_padding_is_written_as_zeros_and_dropped_on_read(queue, tmp_path):
    # A blob's last block: 100 bytes of data move as a whole page (O_DIRECT), zero padded.
    path = str(tmp_path / "tail")
    data = np.arange(100, dtype=np.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        ((moved, crc),) = queue.run([AioRequest(fd, data, 0, ALIGN, True)], blob=0)
        page = np.zeros(ALIGN, np.uint8)
        page[:100] = data
        assert moved == ALIGN and crc == crc32c(page)
        out = np.full(100, 7, np.uint8)
        ((moved, crc),) = queue.run([AioRequest(fd, out, 0, ALIGN, False)], blob=1)
        assert moved == ALIGN and crc == crc32c(page)
        assert np.array_equal(out, data)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == page.tobytes()


def test_errors_and_short_transfers_come_back_per_request(queue, tmp_path):
    path = str(tmp_path / "short")
    with open(path, "wb") as f:
        f.write(b"\1" * ALIGN)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = aligned_empty(2 * ALIGN, np.uint8)
        past_end = AioRequest(fd, buf[:ALIGN], ALIGN, ALIGN, False)
        write_to_read_only = AioRequest(fd, buf[ALIGN:], 0, ALIGN, True)
        ok = AioRequest(fd, buf[ALIGN:], 0, ALIGN, False)
        results = queue.run([past_end, write_to_read_only, ok], blob=0)
        assert results[0][0] == 0  # end of file: nothing moved
        assert results[1][0] == -errno.EBADF
        assert results[2][0] == ALIGN
        # the submitter turns them into the tier's errors
        aio = AioSubmitter(2)
        try:
            with pytest.raises(CorruptBlobError, match="short read at byte 4096"):
                aio.move(fd, [Chunk(buf[:ALIGN], ALIGN, ALIGN)], False, 0)
            with pytest.raises(OSError, match="Bad file descriptor at byte 0") as info:
                aio.move(fd, [Chunk(buf[:ALIGN], 0, ALIGN)], True, 1)
            assert info.value.errno == errno.EBADF
        finally:
            aio.close()
    finally:
        os.close(fd)


def test_bad_requests_are_refused_before_the_kernel(queue):
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        queue.run([AioRequest(0, np.zeros(4, np.float32), 0, 16, False)], blob=0)
    with pytest.raises(ValueError, match="moves 8 bytes of 16"):
        queue.run([AioRequest(0, np.zeros(16, np.uint8), 0, 8, False)], blob=0)
    closed = AioQueue(1)
    closed.close()
    with pytest.raises(ValueError, match="closed"):
        closed.run([AioRequest(0, np.zeros(16, np.uint8), 0, 16, False)], blob=0)


def test_a_tier_falls_back_to_threads_where_the_kernel_refuses_aio(tmp_path, monkeypatch, caplog):
    def refused(depth: int):
        raise AioUnavailableError(errno.EAGAIN, "kernel AIO is not available (raise fs.aio-max-nr)")

    monkeypatch.setattr(posix, "AioSubmitter", refused)
    tier = FileTier(str(tmp_path / "tier"), sync=False)
    with caplog.at_level("WARNING", logger="jax_mlpo.tiers.posix"):
        store = FileTierStore(tier, {"state": [5000]}, TierPermits(tier.path, 2, 2))
    try:
        assert isinstance(store._blobs._submit, ThreadSubmitter)
        assert any("fs.aio-max-nr" in r.message and "thread" in r.message for r in caplog.records)
        data = np.arange(5000, dtype=np.float32)
        store.write(0, data).result()
        out = np.empty(5000, np.float32)
        store.read(0, out).result()
        assert np.array_equal(out, data)
    finally:
        store.close()
