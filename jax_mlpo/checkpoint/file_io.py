"""A checkpoint's own file I/O, in one place: the pieces of its arrays and its manifest.

Every piece a checkpoint writes or reads with O_DIRECT (the offloaded state's streamed arrays,
:mod:`~jax_mlpo.checkpoint.stream`, the tree's large host arrays,
:mod:`~jax_mlpo.checkpoint.host_arrays`) and its checksum manifest go through :func:`request`,
whichever thread pool moves them. That is where a test's
:class:`~jax_mlpo.tiers.faults.FaultPlan` meets them (:func:`jax_mlpo.testing.checkpoint_faults`
attaches it): with none attached a request pays one ``None`` check. The plan sees each request
as ``(op, kind, slot)``: ``op`` is ``"read"`` or ``"write"``; ``kind`` is :data:`STATE` (a piece
of an offloaded state's array), :data:`ARRAY` (a piece of a large host array: the params) or
:data:`MANIFEST`; ``slot`` is the piece's index in its file (0 for the manifest). orbax's and
tensorstore's own writes (array metadata, small arrays) do not come here.
"""

from __future__ import annotations

import errno
import os

import numpy as np

from jax_mlpo.tiers.faults import FaultPlan
from jax_mlpo.tiers.posix import pread_full, pwrite_full
from jax_mlpo.transforms.runtime import RUNTIME

STATE = "state"  # a piece of an offloaded state's streamed array
ARRAY = "array"  # a piece of a large host array (the params) written by jax_mlpo itself
MANIFEST = "manifest"  # an item's checksum manifest


def attach_faults(plan: FaultPlan | None) -> None:
    """Makes every checkpoint request of this process consult ``plan`` (None: none).

    Raises:
      RuntimeError: a plan is attached already (detach it first, with None).
    """
    checkpoints = RUNTIME.checkpoints
    if plan is not None and checkpoints.faults is not None:
        raise RuntimeError("the checkpoint's I/O already has a fault plan attached")
    checkpoints.faults = plan


class _Piece:
    """One request's bytes in a file, as the fault plan sees them (its ``FaultyStore``)."""

    def __init__(self, path: str, offset: int, nbytes: int) -> None:
        self.where, self._offset, self._nbytes = path, offset, nbytes

    def blob_path(self, slot: int, kind: str) -> str:
        return self.where

    def damage_blob(self, slot: int, kind: str) -> None:
        """Flips a bit in the middle of the piece, as bit rot or a torn write would leave it."""
        pos = self._offset + max(0, self._nbytes // 2)
        with open(self.where, "r+b") as f:
            f.seek(pos)
            byte = f.read(1)
            f.seek(pos)
            f.write(bytes([(byte[0] if byte else 0) ^ 0x10]))
            f.flush()
            os.fsync(f.fileno())


def request(op: str, kind: str, path: str, slot: int, offset: int, nbytes: int) -> None:
    """Lets the attached fault plan act on a request, before its I/O.

    Args:
      op: ``"read"`` or ``"write"``.
      kind: :data:`STATE`, :data:`ARRAY` or :data:`MANIFEST`.
      path: the file.
      slot: the piece's index in the file.
      offset: where the piece starts in the file, in bytes.
      nbytes: the piece's length.

    Raises:
      OSError: a failure the plan injects.
    """
    plan = RUNTIME.checkpoints.faults
    if plan is not None:
        plan.before(_Piece(path, offset, nbytes), op, slot, kind)


def write_piece(fd: int, data: np.ndarray, offset: int, path: str, kind: str, slot: int) -> None:
    """Writes ``data`` (page-aligned bytes, whole pages for O_DIRECT) at ``offset`` of ``fd``.

    Args:
      fd: the file, open for writing.
      data: the bytes.
      offset: where they go, in bytes.
      path: the file's path (for the fault plan and errors).
      kind: :data:`STATE` or :data:`ARRAY`.
      slot: the piece's index in the file.

    Raises:
      OSError: the write failed or was short (``ENOSPC``: the disk is full).
    """
    request("write", kind, path, slot, offset, data.nbytes)
    if pwrite_full(fd, data, offset) < data.nbytes:
        raise OSError(errno.ENOSPC, f"short write at byte {offset} (is the disk full?)", path)


def read_piece(
    fd: int, view: np.ndarray, offset: int, count: int, path: str, kind: str, slot: int
) -> None:
    """Reads at least ``count`` bytes at ``offset`` of ``fd`` into ``view`` (page-aligned,
    whole pages for O_DIRECT).

    Args:
      fd: the file, open for reading.
      view: where the bytes go.
      offset: where they are, in bytes.
      count: the bytes the piece holds (``view`` may be longer: O_DIRECT reads whole pages).
      path: the file's path (for the fault plan and errors).
      kind: :data:`STATE` or :data:`ARRAY`.
      slot: the piece's index in the file.

    Raises:
      OSError: the read failed, or the file ends before the piece does (truncated).
    """
    request("read", kind, path, slot, offset, count)
    if pread_full(fd, view, offset) < count:
        raise OSError(errno.EIO, f"short read at byte {offset} (the file is truncated)", path)
