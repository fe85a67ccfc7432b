"""The q8 moment code (:mod:`jax_mlpo.engine.quantize`) in the native library: encode and decode.

The fused AdamW kernel decodes and encodes q8 moments itself; these are for the paths that
move a moment between its q8 blob and float32 (checkpoints, ``state_dict``), and for tests.
"""

from __future__ import annotations

import numpy as np

from jax_mlpo.native.library import NATIVE, checked_array
from jax_mlpo.types import F32, Quantized, num_blocks

__all__ = ["q8_decode", "q8_encode"]

U8 = np.dtype(np.uint8)


def checked_quantized(name: str, q: object, size: int | None, *, writable: bool) -> Quantized:
    """Checks a q8 argument (codes and their blocks' scales) before it crosses into C."""
    if not isinstance(q, Quantized):
        raise ValueError(
            f"{name} must be a jax_mlpo.engine.quantize.Quantized, got {type(q).__name__}"
        )
    codes = checked_array(f"{name}.codes", q.codes, (U8,), size, writable=writable)
    scales = checked_array(f"{name}.scales", q.scales, (F32,), num_blocks(codes.size),
                           writable=writable)  # fmt: skip
    return Quantized(codes, scales)


def q8_encode(x: np.ndarray, out: Quantized, *, signed: bool, seed: int | None = None) -> None:
    """Encodes float32 ``x`` into ``out`` (native, multi-threaded; the reference's bits).

    Args:
      x: float32 values, contiguous.
      out: codes (uint8, ``x.size``) and scales (float32, one per 256 elements) to write.
      signed: m's code, else v's.
      seed: stochastic rounding's seed, or None for rounding to nearest.

    Raises:
      ValueError: on a wrong dtype, size or contiguity.
    """
    x = checked_array("x", x, (F32,), None, writable=False)
    out = checked_quantized("out", out, x.size, writable=True)
    NATIVE.q8_encode(
        x, out.codes, out.scales, signed=bool(signed), seed=None if seed is None else int(seed)
    )


def q8_decode(q: Quantized, *, signed: bool, out: np.ndarray | None = None) -> np.ndarray:
    """The float32 values of q8 codes (native, multi-threaded; the reference's bits).

    Args:
      q: codes and scales.
      signed: m's code, else v's.
      out: a float32 array of ``q.size`` elements to write, or None for a new one.

    Returns:
      ``out`` (or the new array).
    """
    q = checked_quantized("q", q, None, writable=False)
    if out is None:
        out = np.empty(q.size, F32)
    out = checked_array("out", out, (F32,), q.size, writable=True)
    NATIVE.q8_decode(q.codes, q.scales, out, signed=bool(signed))
    return out
