"""Blobs as files read and written with ``pread``/``pwrite``, O_DIRECT, in concurrent chunks.

The default I/O engine of a file tier (``FileTier.io_engine="posix"``). One file per blob,
``<kind>-<slot>.blob``, preallocated at its first write (so a full disk fails before any byte of
the blob is overwritten) and then rewritten in place::

    [0, nbytes)              the blob (float32, little-endian)
    [nbytes, data_end)       zero padding to a 4 KiB boundary (O_DIRECT moves whole blocks)
    [data_end, file end)     trailer: magic, blob bytes, chunk bytes, chunk count, the crc32c of
                             every chunk (the last one's covers the padding), zeros, and in the
                             last 4 bytes the crc32c of the rest of the trailer

Every byte of the file is covered by a checksum.

A blob moves as requests of ``chunk_bytes`` each, ``queue_depth`` of them in flight per tier,
reads served before writes (the update waits on reads; write-back only has to finish before its
buffer is reused), through the tier's submitter (:mod:`jax_mlpo.tiers.submit`): kernel AIO from
C++ by default, as DeepSpeed's libaio swapper moves its state, or a thread per request.
tensorstore's ``file`` driver reaches 65-75% of the disk's bandwidth here, so the hot path does
its own I/O (``io_engine="tensorstore"`` remains for comparison). Each chunk's checksum is
computed by the thread that asked for it (native crc32c, GIL released) and checked against the
trailer on every read: a torn write (a crash midway through rewriting a blob) or a flipped bit
fails loudly instead of feeding the optimizer wrong state.

With ``io_mode="direct"`` files are opened with O_DIRECT, so state does not churn the page
cache. On a file system without O_DIRECT (tmpfs) the tier logs it once and uses the page cache.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import struct

import numpy as np

from jax_mlpo.native.crc32c import crc32c
from jax_mlpo.tiers.errors import CorruptBlobError
from jax_mlpo.tiers.file_tier import FileTier
from jax_mlpo.tiers.submit import ALIGN, Chunk, open_direct, round_up_pages, submitter

logger = logging.getLogger(__name__)

MAGIC = b"JXMLPOB\x01"
_HEADER = struct.Struct("<8sQQI")  # magic, blob bytes, chunk bytes, chunk count


class PosixBlobs:
    """The blob files of one tier directory.

    Args:
      directory: the tier's directory (exists, locked by the caller).
      tier: the tier's configuration (``chunk_bytes``, ``queue_depth``, ``io_mode``, ``sync``).
      kinds: for each kind, the float32 length of each slot's blob.
    """

    def __init__(self, directory: str, tier: FileTier, kinds: dict[str, list[int]]) -> None:
        self.directory = directory
        self._nbytes = {kind: [4 * n for n in lengths] for kind, lengths in kinds.items()}
        self._chunk = max(ALIGN, tier.chunk_bytes // ALIGN * ALIGN)
        self._direct = tier.effective_io_mode == "direct"
        self._sync = tier.sync
        # A blob file left by an earlier run is not this run's state: start clean, as a fresh
        # zarr array would (restoring goes through checkpoints, never through tier files).
        for kind in kinds:
            for stale in glob.glob(os.path.join(glob.escape(directory), f"{kind}-*.blob")):
                os.unlink(stale)
        self._submit = submitter(
            tier.io_submit, tier.queue_depth, f"jax_mlpo-io-{os.path.basename(directory)}"
        )

    def path(self, slot: int, kind: str) -> str:
        return os.path.join(self.directory, f"{kind}-{slot}.blob")

    def files(self, slot: int, kind: str) -> list[str]:
        """Every file that holds part of the blob (one)."""
        return [self.path(slot, kind)]

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(o, min(self._chunk, nbytes - o)) for o in range(0, nbytes, self._chunk)] or [
            (0, 0)
        ]

    def _layout(self, nbytes: int) -> tuple[int, int, int]:
        """(chunk count, trailer offset, trailer bytes) of a blob of ``nbytes``."""
        count = len(self._chunks(nbytes))
        return count, round_up_pages(nbytes), round_up_pages(_HEADER.size + 4 * count + 4)

    def _requests(self, view: np.ndarray) -> list[Chunk]:
        """The chunk requests of a blob's bytes; the last one moves the padding too."""
        return [
            Chunk(view[o : o + n], o, round_up_pages(n) if o + n == view.nbytes else n)
            for o, n in self._chunks(view.nbytes)
        ]

    def _open(self, path: str, flags: int) -> int:
        fd, direct = open_direct(path, flags, self._direct)
        if self._direct and not direct:
            self._direct = False
            logger.warning(
                "%s does not support O_DIRECT (tmpfs?); this tier uses the page cache",
                self.directory,
            )
        return fd

    # ---- reads ----------------------------------------------------------------------------

    def read(self, slot: int, kind: str, out: np.ndarray) -> None:
        """Reads blob ``slot`` of ``kind`` into ``out`` (contiguous, its length) and checks it.

        Raises:
          CorruptBlobError: the file is truncated, or a chunk or the trailer fails its checksum.
          OSError: the file is missing (never written) or unreadable.
        """
        path = self.path(slot, kind)
        nbytes = self._nbytes[kind][slot]
        view = _bytes_of(out, nbytes)
        count, trailer_at, trailer_bytes = self._layout(nbytes)
        try:
            fd = self._open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                e.errno, f"the blob was never written (no file {path})", path
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < trailer_at + trailer_bytes:
                raise CorruptBlobError(
                    f"{path} is {size} bytes, a blob of {nbytes} bytes needs "
                    f"{trailer_at + trailer_bytes}: the file is truncated"
                )
            blob = self._submit.next_blob()
            raw = np.zeros(trailer_bytes, np.uint8)
            trailer = Chunk(raw, trailer_at, trailer_bytes)
            crcs = self._submit.move(fd, [trailer, *self._requests(view)], False, blob)[1:]
        finally:
            os.close(fd)
        stored = _parse_trailer(raw.tobytes(), path, nbytes, self._chunk, count)
        bad = [i for i, (a, b) in enumerate(zip(crcs, stored, strict=True)) if a != b]
        if bad:
            raise CorruptBlobError(
                f"{path}: {len(bad)} of {count} chunks fail their crc32c (first: chunk {bad[0]}, "
                f"bytes {bad[0] * self._chunk}-{min(nbytes, (bad[0] + 1) * self._chunk)}); "
                "corrupted, or a write was cut short"
            )

    # ---- writes ---------------------------------------------------------------------------

    def write(self, slot: int, kind: str, data: np.ndarray) -> None:
        """Writes ``data`` as blob ``slot`` of ``kind``; durable on return when ``sync``."""
        path = self.path(slot, kind)
        nbytes = self._nbytes[kind][slot]
        view = _bytes_of(data, nbytes)
        count, trailer_at, trailer_bytes = self._layout(nbytes)
        fd = self._open(path, os.O_WRONLY | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size != trailer_at + trailer_bytes:
                if size > trailer_at + trailer_bytes:
                    os.ftruncate(fd, trailer_at + trailer_bytes)
                # Reserve the blocks now: a full disk fails here, before the old blob is touched.
                os.posix_fallocate(fd, 0, trailer_at + trailer_bytes)
            blob = self._submit.next_blob()
            crcs = self._submit.move(fd, self._requests(view), True, blob)
            trailer = np.zeros(trailer_bytes, np.uint8)
            body = _HEADER.pack(MAGIC, nbytes, self._chunk, count) + struct.pack(
                f"<{count}I", *crcs
            )
            trailer[: len(body)] = np.frombuffer(body, np.uint8)
            trailer[-4:] = np.frombuffer(struct.pack("<I", crc32c(trailer[:-4])), np.uint8)
            # The trailer goes last: until it lands, a reader sees the old checksums and reports
            # a half-written blob rather than reading it as valid.
            self._submit.move(fd, [Chunk(trailer, trailer_at, trailer_bytes)], True, blob)
            if self._sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def damage(self, slot: int, kind: str) -> None:
        """Flips a bit of the blob's first byte in its file (fault injection).

        Raises:
          FileNotFoundError: the blob was never written.
        """
        flip_first_byte(self.path(slot, kind))

    def discard(self, slot: int, kind: str) -> None:
        """Deletes the blob's file (a later read fails as never written)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(slot, kind))

    def close(self) -> None:
        self._submit.close()


def flip_first_byte(path: str) -> None:
    """Flips the lowest bit of a file's first byte, through the page cache and synced (an
    O_DIRECT read of the range afterwards sees it: the kernel writes the cached page first)."""
    fd = os.open(path, os.O_RDWR)
    try:
        first = os.pread(fd, 1, 0)
        os.pwrite(fd, bytes([first[0] ^ 0x01]), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _bytes_of(arr: np.ndarray, nbytes: int) -> np.ndarray:
    if not arr.flags.c_contiguous or arr.nbytes != nbytes:
        raise ValueError(
            f"a blob buffer must be C-contiguous and {nbytes} bytes, got "
            f"{arr.nbytes} bytes (contiguous: {arr.flags.c_contiguous})"
        )
    return arr.reshape(-1).view(np.uint8)


def _parse_trailer(raw: bytes, path: str, nbytes: int, chunk: int, count: int) -> tuple[int, ...]:
    magic, stored_bytes, stored_chunk, stored_count = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptBlobError(f"{path}: no jax_mlpo blob trailer (magic {magic!r})")
    (crc,) = struct.unpack_from("<I", raw, len(raw) - 4)
    if (stored_bytes, stored_chunk, stored_count) != (nbytes, chunk, count) or crc != (
        crc32c(raw[:-4])
    ):
        raise CorruptBlobError(
            f"{path}: the trailer is corrupt or describes another blob ({stored_bytes} bytes in "
            f"chunks of {stored_chunk}; expected {nbytes} in chunks of {chunk})"
        )
    return struct.unpack_from(f"<{count}I", raw, _HEADER.size)
