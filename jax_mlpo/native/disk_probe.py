"""The disk sweep's probe of our own, for machines without fio (``ffi/disk_probe.cc``).

One point of the request size x requests in flight x direction sweep: O_DIRECT requests at
random aligned offsets of a file, each of ``in_flight`` threads keeping one outstanding, for a
fixed time, as fio's ``randread``/``randwrite``/``randrw`` jobs with ``--direct=1`` do.
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

from jax_mlpo.native.library import LIB, declare

__all__ = ["MODES", "ProbePoint", "lay_out", "probe"]

MODES = {"read": 0, "write": 1, "mixed": 2}
_ERROR_CAPACITY = 1024

declare(
    LIB,
    [(
        "jax_mlpo_disk_probe",
        [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
         ctypes.c_double, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
         ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_int64],
        ctypes.c_int,
    )],
)  # fmt: skip


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
    read, written, elapsed = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_double()
    error = ctypes.create_string_buffer(_ERROR_CAPACITY)
    rc = LIB.jax_mlpo_disk_probe(
        os.fsencode(path), file_bytes, request_bytes, in_flight, MODES[mode], seconds,
        ctypes.byref(read), ctypes.byref(written), ctypes.byref(elapsed), error, _ERROR_CAPACITY,
    )  # fmt: skip
    if rc != 0:
        message = error.value.decode(errors="replace")
        raise (ValueError if message.startswith("bad probe") else OSError)(message)
    t = max(elapsed.value, 1e-9)
    return ProbePoint(read.value / t / 1e9, written.value / t / 1e9, elapsed.value)
