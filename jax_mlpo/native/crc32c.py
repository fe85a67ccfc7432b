"""CRC-32C, the checksum of every chunk the file tiers write and read.

The standard CRC-32C (Castagnoli), the one zarr3's ``crc32c`` codec and google-crc32c compute
(the tests compare it with tensorstore's). Native, with the CPU's crc32 instruction where there
is one (several GB/s; a table otherwise), and the GIL released, so that each of a tier's I/O
threads checksums the chunk it moved while the others move theirs.
"""

from __future__ import annotations

import numpy as np

from jax_mlpo.native.library import NATIVE

__all__ = ["crc32c"]


def crc32c(data: np.ndarray | memoryview | bytes, crc: int = 0) -> int:
    """CRC-32C of ``data``'s bytes, continuing from ``crc``.

    Args:
      data: a C-contiguous numpy array, a contiguous buffer or bytes.
      crc: the checksum of the bytes before ``data`` (0 to start).

    Returns:
      The checksum as an unsigned 32-bit int.

    Raises:
      ValueError: if ``data`` is a numpy array that is not C-contiguous.
    """
    view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else None
    if view is not None:
        arr = np.frombuffer(view, np.uint8)
    else:
        if not data.flags.c_contiguous:
            raise ValueError("crc32c needs a C-contiguous array")
        arr = data.reshape(-1).view(np.uint8)
    return NATIVE.crc32c(arr, int(crc))
