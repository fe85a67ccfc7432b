"""8-bit blockwise moments (``mu_dtype="q8"``, ``nu_dtype="q8"``): the code and its reference.

A q8 moment stores one byte per element and one float32 scale per :data:`BLOCK` elements
(blocks start at each kernel call's first element, i.e. at each segment of a subgroup). The
byte is a small float relative to the block's scale, with 3 mantissa bits:

* m (signed): a sign bit and a 7-bit magnitude code covering 2^-16..1 of the scale;
* v (non-negative): an 8-bit magnitude code covering 2^-32..1 of the scale (v is a squared
  gradient, so its dynamic range is twice m's in binades).

A magnitude code ``u > 0`` stands for the float32 whose bits are ``(u + bias) << 20``; 0 is 0.
The scale is the smallest power of two at or above the block's largest magnitude, so both
``x / scale`` and ``code * scale`` are exact: a block decoded and encoded again gives back its
values bit for bit, which is what makes a checkpoint (stored as float32) resume exactly.

Why this code and not a linear int8 with an absmax scale: v spans many binades within a block,
and a linear code sends every small v to 0, where ``m / (sqrt(v) + eps)`` is ``m / eps``. A
float-like code keeps the same relative precision (at most 1/16 rounding error) over 16 (m) or
32 (v) binades below the block's largest value, and a positive v is never rounded to 0 (the
smallest code stands in for anything below it). Unlike bitsandbytes' dynamic map, which needs a
table search per element, encoding is a handful of integer operations that vectorize.

Rounding is to nearest or stochastic (unbiased: up with probability equal to the dropped
fraction). With 3 mantissa bits a moment whose relative change per step is under ~3-6% can be
stuck under nearest rounding (v with ``b2`` close to 1, where nothing new arrives); stochastic
rounding moves it in expectation. Its random bits are a hash of a seed (the step count, the
subgroup and the segment: :func:`segment_seed`) and the element's index, so a resumed run draws
the same bits.

Edge cases: a block whose largest magnitude is below 2^-90 is stored as zeros (its values would
decode to float32 denormals; a moment that small moves nothing); a block holding a non-finite
value, or one above 2^126, decodes to NaN throughout, as a float32 moment would propagate it.

The native kernel (``jax_mlpo/ffi/kernels_isa.cc``) computes the same bits as the numpy
functions here; tests compare them on every instruction set.
"""

from __future__ import annotations

import numpy as np

from jax_mlpo.types import BLOCK, F32, Quantized, num_blocks

__all__ = ["BLOCK", "Q8", "Quantized", "decode_reference", "encode_reference", "moment_dtype",
           "moment_dtype_name", "num_blocks", "segment_seed"]  # fmt: skip

# How a layout names a q8 moment among its moment dtypes (the codes' storage dtype); users say
# "q8". np.uint8 is never a float moment's dtype, so the two cannot be confused.
Q8 = np.dtype(np.uint8)
NAME = "q8"
BIAS = {True: 889, False: 761}  # signed (m): code 127 is 1.0; unsigned (v): code 255 is 1.0
TOP = {True: 127, False: 255}
FLUSH_BITS = (127 - 90) << 23  # a block below 2^-90 is stored as zeros
MAX_BITS = (127 + 126) << 23  # a block above 2^126 (or non-finite) decodes to NaN


def moment_dtype(spec: object) -> np.dtype:
    """A ``mu_dtype``/``nu_dtype`` as a layout keeps it: ``"q8"`` is :data:`Q8`, anything else
    goes through ``np.dtype`` (``jnp.bfloat16``, ``"bfloat16"``, ``"float32"``...)."""
    return Q8 if isinstance(spec, str) and spec == NAME else np.dtype(spec)


def moment_dtype_name(dtype: np.dtype) -> str:
    """The name a user gives a moment dtype: ``"q8"``, ``"bfloat16"`` or ``"float32"``."""
    return NAME if dtype == Q8 else np.dtype(dtype).name


def segment_seed(count: int, subgroup: int, start: int) -> int:
    """The stochastic rounding's seed of one kernel call: a 32-bit mix of the optimizer step
    count, the subgroup's index and the segment's first element in it."""
    x = (count * 0x9E3779B1 + subgroup * 0x85EBCA77 + start * 0xC2B2AE3D) & 0xFFFFFFFF
    return int(_lowbias32(np.uint32(x)))


def _lowbias32(x: np.ndarray) -> np.ndarray:
    """Chris Wellons' lowbias32 integer hash, elementwise on uint32 (wrapping)."""
    x = np.asarray(x, np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        x = x ^ (x >> np.uint32(16))
    return x


def _blocks(x: np.ndarray) -> np.ndarray:
    """``x`` as rows of BLOCK elements, the last one padded with zeros."""
    n = x.size
    padded = np.zeros(num_blocks(n) * BLOCK, x.dtype)
    padded[:n] = x.reshape(-1)
    return padded.reshape(-1, BLOCK)


def encode_reference(x: np.ndarray, *, signed: bool, seed: int | None = None) -> Quantized:
    """The q8 code of float32 values (numpy; the native kernel's bits).

    Args:
      x: float32 values (any shape; flattened).
      signed: m's code (sign and 7-bit magnitude), else v's (8-bit magnitude, non-negative).
      seed: stochastic rounding's seed (element ``i`` draws a hash of lowbias32(seed) + i,
        shared by m and v: each takes half of its bits), or None for rounding to nearest.

    Returns:
      The codes (uint8, ``x.size``) and scales (float32, one per block).
    """
    x = np.asarray(x, F32).reshape(-1)
    n = x.size
    bits = _blocks(x).view(np.uint32)
    mag = bits & np.uint32(0x7FFFFFFF)
    amax = mag.max(axis=1)
    flush, bad = amax < FLUSH_BITS, amax > MAX_BITS
    e = (amax >> np.uint32(23)) + ((amax & np.uint32(0x7FFFFF)) != 0).astype(np.uint32)
    e = np.where(flush | bad, np.uint32(127), e)  # any exponent: those blocks are overwritten
    scales = (e << np.uint32(23)).view(F32)
    inv = ((np.uint32(254) - e) << np.uint32(23)).view(F32)
    r = (mag.view(F32) * inv[:, None]).view(np.uint32)
    if seed is None:
        add = np.uint32(1 << 19)
    else:
        index = np.arange(bits.size, dtype=np.uint32).reshape(bits.shape)
        with np.errstate(over="ignore"):  # kernels_isa.cc's ElementHash
            h = (_lowbias32(np.uint32(seed)) + index) * np.uint32(0x9E3779B1)
        h = h ^ (h >> np.uint32(16))
        # one hash per element: m takes its low 16 bits, v its high 16, as the dropped 20 bits'
        # top (unbiased to 2^-16 of a step)
        add = ((h & np.uint32(0xFFFF)) if signed else (h >> np.uint32(16))) << np.uint32(4)
    q = (r + add) >> np.uint32(20)
    bias, top = BIAS[signed], TOP[signed]
    u = np.where(q > bias, np.minimum(q - np.uint32(bias), np.uint32(top)), np.uint32(0))
    if signed:
        sign = (bits >> np.uint32(24)) & np.uint32(0x80)
        u = u | np.where(u != 0, sign, np.uint32(0))
    else:
        u = np.where((r != 0) & (u == 0), np.uint32(1), u)
    u[flush | bad] = 0
    scales = np.where(flush, np.float32(0.0), np.where(bad, np.float32(np.nan), scales)).astype(F32)
    return Quantized(u.astype(np.uint8).reshape(-1)[:n], scales)


def decode_reference(q: Quantized, *, signed: bool) -> np.ndarray:
    """float32 values of a q8 code (numpy; the native kernel's bits)."""
    codes = _blocks(np.asarray(q.codes, np.uint8)).astype(np.uint32)
    u = codes & np.uint32(0x7F) if signed else codes
    bits = np.where(u != 0, (u + np.uint32(BIAS[signed])) << np.uint32(20), np.uint32(0))
    if signed:
        bits = bits | ((codes & np.uint32(0x80)) << np.uint32(24))
    values = bits.astype(np.uint32).view(F32) * np.asarray(q.scales, F32)[:, None]
    return values.reshape(-1)[: q.codes.size]
