"""Freed XLA buffers go back to the operating system: a fixed mmap threshold for glibc's malloc.

XLA's CPU client allocates every buffer with ``malloc``, and a training step frees and
allocates gigabytes of them (gradients, the backward pass's temporaries). glibc serves blocks
above its mmap threshold with ``mmap`` and unmaps them on ``free``, but it raises that
threshold to the size of each mmapped block it frees (up to 32 MiB). After the first step,
blocks up to that size come from the heap, and freed heap memory mostly stays in the process:
the peak resident set grows step after step. Measured on the beyond-RAM config cut to 6 layers
(experiments/configs/beyond-ram.yaml, ``model_overrides.layers=6``, 8 steps): peak RSS
5.28 GiB after step 1, rising to 5.98 GiB by step 6. With the threshold fixed at 1 MiB it went
from 5.22 to 5.25 GiB. A fixed threshold turns the dynamic adjustment off, so what XLA frees is
returned at once. The cost is a ``mmap``/``munmap`` and fresh zeroed pages per large buffer.

It is a process-wide setting, so the library never sets it on its own: a training script
calls :func:`return_freed_buffers` once, at the start (``experiments/pretrain.py`` does).
"""

from __future__ import annotations

import logging

from jax_mlpo.native.library import NATIVE

logger = logging.getLogger(__name__)

# Blocks of 1 MiB and more are mmapped. Below that the heap's reuse is cheap and small, and
# every XLA buffer that matters at the model's scale is larger.
DEFAULT_THRESHOLD = 1 << 20


def return_freed_buffers(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fixes glibc's mmap threshold, so that freed blocks of ``threshold`` bytes and more are
    unmapped at once instead of kept in the heap.

    Args:
      threshold: the block size from which ``malloc`` maps memory, in bytes (glibc accepts up
        to 32 MiB on 64-bit systems).

    Returns:
      True if it was set; False where the C library is not glibc (nothing changed, logged).

    Raises:
      ValueError: for a threshold outside ``[4096, 32 MiB]``.

    Examples:
      >>> import jax_mlpo
      >>> jax_mlpo.return_freed_buffers()  # before the first step
      True
    """
    if not 4096 <= threshold <= 32 << 20:
        raise ValueError(f"threshold must be within [4096, 32 MiB] bytes, got {threshold}")
    if not NATIVE.set_mmap_threshold(int(threshold)):
        logger.info("jax_mlpo: mallopt(M_MMAP_THRESHOLD, %d) not available or refused (not "
                    "glibc?): heap left as it is", threshold)  # fmt: skip
        return False
    return True
