"""The disk sweep's probe of our own, for machines without fio (``ffi/disk_probe.cc``).

One point of the request size x requests in flight x direction sweep: O_DIRECT requests at
random aligned offsets of a file, each of ``in_flight`` threads keeping one outstanding, for a
fixed time, as fio's ``randread``/``randwrite``/``randrw`` jobs with ``--direct=1`` do. It lives in
the test-only module (``jax_mlpo._native_testing``): only the disk benchmark runs it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from jax_mlpo.native.library import load

__all__ = ["MODES", "ProbePoint", "lay_out", "probe"]

MODES = {"read": 0, "write": 1, "mixed": 2}


class ProbePoint(NamedTuple):
    """What one probe moved: GB/s read and written, over ``seconds``."""

    read_gbps: float
    write_gbps: float
    seconds: float

    @property
    def total_gbps(self) -> float:
        return self.read_gbps + self.write_gbps


def lay_out(path: str | os.PathLike, nbytes: int, piece: int = 64 << 20) -> None:
    """Writes a file of ``nbytes`` (a multiple of 4096) for the probe, synced.

    Raises:
      OSError: the file cannot be written (a wrong path, a full disk).
    """
    data = b"\x5a" * min(piece, nbytes)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            f.write(data[: min(len(data), left)])
            left -= min(len(data), left)
        f.flush()
        os.fsync(f.fileno())


def probe(path: str | os.PathLike, file_bytes: int, request_bytes: int, in_flight: int,
          mode: str, seconds: float) -> ProbePoint:  # fmt: skip
    """Measures one point on the file at ``path`` (laid out with :func:`lay_out`).

    Args:
      path: the file, on the file system to measure.
      file_bytes: its size.
      request_bytes: each request's size (a multiple of 4096).
      in_flight: requests outstanding at once (one thread each).
      mode: ``"read"``, ``"write"`` or ``"mixed"`` (each request a read or a write, even odds).
      seconds: how long to run.

    Raises:
      OSError: the file cannot be opened, the file system refuses O_DIRECT, or a request
        failed (the message names which).
      ValueError: for arguments out of range.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    read, written, elapsed = load("jax_mlpo._native_testing").disk_probe(
        os.fsdecode(path),
        int(file_bytes),
        int(request_bytes),
        int(in_flight),
        MODES[mode],
        float(seconds),
    )
    t = max(elapsed, 1e-9)
    return ProbePoint(read / t / 1e9, written / t / 1e9, elapsed)
