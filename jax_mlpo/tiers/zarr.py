"""Blobs in zarr3 arrays on tensorstore's ``file`` driver (``FileTier.io_engine="tensorstore"``).

Each tier directory holds a zarr3 array ``<kind>-<n>`` of shape ``(blobs, n)`` float32 per kind of
blob and blob length ``n`` (usually two lengths: full subgroups and the shorter last one), a row
per blob cut into chunks of ``chunk_bytes``, each its own file with zarr3's ``crc32c`` codec,
which tensorstore verifies on every read. tensorstore runs the requests of a blob concurrently
(``file_io_concurrency``) with the GIL released.
"""

from __future__ import annotations

import errno
import os
import pathlib
from typing import Any

import numpy as np
import tensorstore as ts

from jax_mlpo.tiers.errors import CorruptBlobError
from jax_mlpo.tiers.file_tier import FileTier
from jax_mlpo.tiers.posix import flip_first_byte


def context_spec(tier: FileTier) -> dict[str, Any]:
    """The tensorstore context of a tier: its own I/O concurrency, sync and mode, no cache."""
    return {
        "file_io_concurrency": {"limit": tier.limits.max_concurrency},
        "file_io_sync": tier.sync,
        "file_io_mode": {"mode": tier.effective_io_mode},
        "cache_pool": {"total_bytes_limit": 0},
    }


def array_spec(path: str, slots: int, slot_elems: int, chunk_elems: int) -> dict[str, Any]:
    """The zarr3 spec of a tier's blob array: a row per slot, cut into checksummed chunks of at
    most ``chunk_elems`` (so one blob is several requests in flight)."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        # An all-zero blob (fresh moments) is still written: the file is the state, not a hint.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": [slots, slot_elems],
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [1, min(slot_elems, chunk_elems)]},
            },
            "data_type": "float32",
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
            "fill_value": 0,
        },
    }


class ZarrBlobs:
    """The blob arrays of one tier directory.

    Args:
      directory: the tier's directory (exists).
      tier: the tier's configuration.
      kinds: for each kind, the float32 length of each slot's blob.
    """

    def __init__(self, directory: str, tier: FileTier, kinds: dict[str, list[int]]) -> None:
        self.directory = directory
        # (kind, slot) -> (array, row); one array per kind and blob length, rows per length
        self._where: dict[str, list[tuple[int, int]]] = {}
        self._arrays: list[ts.TensorStore] = []
        self._names: list[str] = []
        context = ts.Context(context_spec(tier))
        for kind, lengths in kinds.items():
            sizes = sorted(set(lengths))
            counts = dict.fromkeys(sizes, 0)
            where = []
            for n in lengths:
                where.append((len(self._arrays) + sizes.index(n), counts[n]))
                counts[n] += 1
            self._where[kind] = where
            for n in sizes:
                name = f"{kind}-{n}"
                spec = array_spec(
                    os.path.join(directory, name), counts[n], n, tier.chunk_bytes // 4
                )
                self._arrays.append(
                    ts.open(spec, create=True, delete_existing=True, context=context).result()
                )
                self._names.append(name)

    def path(self, slot: int, kind: str) -> str:
        """The file of the blob's first chunk."""
        array, row = self._where[kind][slot]
        return os.path.join(self.directory, self._names[array], "c", str(row), "0")

    def files(self, slot: int, kind: str) -> list[str]:
        """Every file that holds part of the blob (its chunk files)."""
        return sorted(str(p) for p in pathlib.Path(self.path(slot, kind)).parent.iterdir())

    def damage(self, slot: int, kind: str) -> None:
        """Flips a bit of the blob's first byte in its first chunk file (fault injection)."""
        flip_first_byte(self.path(slot, kind))

    def read(self, slot: int, kind: str, out: np.ndarray) -> None:
        array, row = self._where[kind][slot]
        try:
            ts.array(out, copy=False).write(self._arrays[array][row]).result()
        except ValueError as e:
            if "DATA_LOSS" in str(e):
                raise CorruptBlobError(str(e)) from e
            raise

    def write(self, slot: int, kind: str, data: np.ndarray) -> None:
        array, row = self._where[kind][slot]
        try:
            self._arrays[array][row].write(data).result()
        except ValueError as e:
            # tensorstore reports the OS error as text only; give it its errno back so the
            # tier recognises a full disk the way it does for the posix engine
            if "No space left" in str(e):
                raise OSError(errno.ENOSPC, str(e)) from e
            raise

    def close(self) -> None:
        self._arrays.clear()
