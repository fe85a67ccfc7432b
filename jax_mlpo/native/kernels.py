"""The compiled library's functions on numpy arrays: the fused optimizer kernels, the q8 moment
code and CRC-32C, each with its arguments checked before they cross into C++.

The checks (:func:`checked_array`, :func:`checked_outputs`, :func:`checked_quantized`) give
messages that name the argument: the C++ side only rejects what would corrupt memory. Each
kernel releases the GIL while it runs and splits large segments over the library's threads
(:mod:`jax_mlpo.native.library`); the optimizer kernels run one call per contiguous segment.

- **AdamW** (:func:`adamw_step`, ``ffi/kernels_isa.cc``): the engine's path into the loop. The
  benchmarks' XLA FFI call of the same loop inside ``jax.jit`` is
  :func:`jax_mlpo.native.testing.adamw_update`. Both compute the numpy reference's float32
  operations in its order (:func:`jax_mlpo.optimizers.adamw.adamw_step_reference`), bit for bit,
  on every instruction set. Those are optax's expressions in the form XLA:CPU compiles them: the
  moment updates ``(1 - b) * x + b * t`` and the weight decay ``u + wd * p`` are fused
  multiply-adds, computed in float64 and rounded to float32 (the float32 product is exact in
  float64, so this is XLA's float32 fma except in the rare cases where rounding the sum twice
  moves the last bit); division by the bias corrections is multiplication by their float32
  reciprocals, themselves IEEE divisions; the remaining division and the square root are IEEE
  float32; nothing else is contracted (``-ffp-contract=off``), and denormals are kept whatever
  the calling thread's FTZ/DAZ flags. Hence a jitted ``optax.adamw`` update bit for bit, but for
  those rare cases.
- **Lion** (:func:`lion_step`, ``ffi/lion_isa.cc``): the same float32 operations as the numpy
  reference (:func:`jax_mlpo.optimizers.lion.lion_step_reference`), in its order: optax.lion's
  ``(1 - b) * x + b * t`` and ``sign + wd * p`` as fused multiply-adds computed in float64 and
  rounded to float32, as XLA:CPU fuses them; nothing else contracted; denormals kept.
- **Muon's two host passes** (:func:`momentum_step`, :func:`apply_step`, ``ffi/muon_isa.cc``):
  the numpy references' operations (:mod:`jax_mlpo.optimizers.muon`), in their order.
- **The q8 moment code** (:mod:`jax_mlpo.engine.quantize`; :func:`q8_encode`,
  :func:`q8_decode`): the fused AdamW kernel decodes and encodes q8 moments itself; these are
  for the paths that move a moment between its q8 blob and float32 (checkpoints,
  ``state_dict``), and for tests.
- **CRC-32C** (:func:`crc32c`), the checksum of every chunk the file tiers write and read: the
  standard CRC-32C (Castagnoli), the one zarr3's ``crc32c`` codec and google-crc32c compute (the
  tests compare it with tensorstore's), with the CPU's crc32 instruction where there is one
  (several GB/s; a table otherwise), so that each of a tier's I/O threads checksums the chunk it
  moved while the others move theirs.

:func:`moment_decay` is the decay as the kernels and their references apply it to a moment of a
given dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_mlpo.native.library import NATIVE, address
from jax_mlpo.types import (
    BF16,
    F32,
    AdamWHyper,
    ApplyHyper,
    LionHyper,
    MomentumHyper,
    Quantized,
    num_blocks,
)

__all__ = [
    "adamw_step",
    "apply_step",
    "crc32c",
    "lion_step",
    "moment_decay",
    "momentum_step",
    "q8_decode",
    "q8_encode",
]

U8 = np.dtype(np.uint8)

# ---- arrays crossing into C -------------------------------------------------------------------


def bits(arr: np.ndarray | None) -> np.ndarray | None:
    """``arr`` as C++ takes it: a bfloat16 array as its uint16 bits (numpy exports bfloat16
    through neither DLPack nor the buffer protocol), any other as it is."""
    return arr.view(np.uint16) if arr is not None and arr.dtype == BF16 else arr


def checked_array(
    name: str,
    arr: object,
    dtypes: Sequence[np.dtype],
    size: int | None,
    *,
    writable: bool,
) -> np.ndarray:
    """Checks one array argument of a kernel and returns it as a numpy array.

    Args:
      name: the argument's name, for the error message.
      arr: the argument. Read-only inputs may be anything ``np.asarray`` accepts (a jax.Array
        on the CPU); outputs must be numpy arrays, as a converted copy would be written in vain.
      dtypes: the accepted dtypes.
      size: the element count it must have (the first array's), or None.
      writable: whether the kernel writes to it.

    Returns:
      ``arr`` as a C-contiguous numpy array.

    Raises:
      ValueError: on a wrong type, dtype or size, a non-contiguous array, or a read-only output.
    """
    if not isinstance(arr, np.ndarray):
        if writable:
            raise ValueError(f"{name} must be a writable numpy array, got {type(arr).__name__}")
        arr = np.asarray(arr)
    if arr.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be {want}, got {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {arr.strides})")
    if size is not None and arr.size != size:
        raise ValueError(f"{name} has {arr.size} elements but m has {size}")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only but is written to")
    return arr


def checked_outputs(
    n: int,
    update_out: np.ndarray | None,
    delta_base: np.ndarray | None,
    param_bf16_out: np.ndarray | None,
) -> dict[str, np.ndarray | None]:
    """Checks the outputs every optimizer kernel shares and returns them as C++ takes them.

    Args:
      n: the element count.
      update_out: float32 (or bfloat16, as a difference to ``delta_base``) update, or None.
      delta_base: bfloat16 params the update is a difference to, or None.
      param_bf16_out: bfloat16 new params, or None.

    Returns:
      ``{name: array (bfloat16 as its bits) or None}`` for the three.

    Raises:
      ValueError: as :func:`checked_array`, or for ``delta_base`` without ``update_out``.
    """
    out = {}
    update_dtypes = (F32, BF16) if delta_base is not None else (F32,)
    for name, arr, dtypes, writable in [
        ("update_out", update_out, update_dtypes, True),
        ("delta_base", delta_base, (BF16,), False),
        ("param_bf16_out", param_bf16_out, (BF16,), True),
    ]:
        if arr is not None:
            arr = checked_array(name, arr, dtypes, n, writable=writable)
        out[name] = bits(arr)
    if delta_base is not None and update_out is None:
        raise ValueError("delta_base needs update_out (the update is new_param - delta_base)")
    return out


def overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the bytes of two C-contiguous arrays overlap (empty arrays overlap nothing)."""
    pa, pb = address(a), address(b)
    return a.nbytes > 0 and b.nbytes > 0 and pa < pb + b.nbytes and pb < pa + a.nbytes


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


# ---- the optimizer kernels --------------------------------------------------------------------


def moment_decay(decay: float, moment_dtype: np.dtype) -> float:
    """The first moment's decay as optax applies it to a moment stored in ``moment_dtype``.

    optax's ``decay * mu`` multiplies a Python float by the stored moment, so with
    ``mu_dtype=bfloat16`` the decay is rounded to bfloat16 (0.9 becomes 0.8984375) while the
    product is float32 (XLA keeps the excess precision). Matching optax bit for bit means doing
    the same. The second moment (``nu_dtype``, which optax lacks) keeps its float32 decay: 0.999
    in bfloat16 is 0.99609375, a 4x shorter memory.

    Returns:
      The decay as a Python float, to be rounded to float32 by the caller.
    """
    if np.dtype(moment_dtype) == BF16:
        return float(np.float32(decay).astype(BF16))
    return float(decay)


def adamw_step(
    m: np.ndarray | Quantized,
    v: np.ndarray | Quantized,
    grad: np.ndarray,
    param: np.ndarray,
    update_out: np.ndarray | None,
    hyper: AdamWHyper,
    *,
    update_param: bool = False,
    delta_base: np.ndarray | None = None,
    param_bf16_out: np.ndarray | None = None,
    seed: int | None = None,
) -> None:
    """One fused AdamW step over a contiguous segment, in place (native, multi-threaded).

    Same arguments and the same bits as :func:`jax_mlpo.optimizers.adamw.adamw_step_reference` (the
    module docstring says which float32 operations). Arrays may be views into larger buffers;
    ``grad``, ``delta_base`` and ``param`` (unless ``update_param``) may be read-only.
    ``update_out`` may be ``grad`` itself (the same buffer, the same dtype): the update then
    overwrites the gradient it is computed from; no other written array may overlap another.

    Args:
      m: float32 or bfloat16 first moment, or its q8 code (:class:`Quantized`), updated in
        place.
      v: the same for the second moment.
      grad: float32 or bfloat16 gradient (bfloat16 is converted on the fly).
      param: float32 parameters; read for weight decay, updated in place when ``update_param``.
      update_out: float32 output for the update, or None; with ``delta_base`` it receives
        ``new_param - float32(delta_base)``, or, when it is bfloat16 (which needs
        ``delta_base``), ``bfloat16(new_param) - delta_base`` in bfloat16.
      hyper: the step's scalars.
      update_param: whether to add the update to ``param`` in place.
      delta_base: bfloat16 params the caller will add the update to, or None.
      param_bf16_out: bfloat16 output for the new params (round to nearest even), or None.
      seed: q8 moments are rounded stochastically with this seed
        (:func:`jax_mlpo.engine.quantize.segment_seed`), or to nearest when None.

    Raises:
      ValueError: on a wrong dtype, a non-contiguous or read-only output, a size mismatch,
        overlapping outputs, or ``delta_base`` without ``update_out``.
    """
    moments = []
    for name, x in (("m", m), ("v", v)):
        size = moments[0].size if moments else None
        if isinstance(x, Quantized):
            moments.append(checked_quantized(name, x, size, writable=True))
        else:
            moments.append(checked_array(name, x, (F32, BF16), size, writable=True))
    m, v = moments
    n = m.size
    grad = checked_array("grad", grad, (F32, BF16), n, writable=False)
    param = checked_array("param", param, (F32,), n, writable=update_param)
    out = checked_outputs(n, update_out, delta_base, param_bf16_out)
    # The scalars exactly as the reference computes them: the same Python expressions, rounded
    # once to float32 (nanobind's double -> float conversion rounds to nearest even, like numpy).
    scalars = NATIVE.AdamWScalars()
    scalars.c1, scalars.b1 = float(1.0 - hyper.b1), moment_decay(hyper.b1, _dtype(m))
    scalars.c2, scalars.b2 = float(1.0 - hyper.b2), float(hyper.b2)
    scalars.bc1, scalars.bc2 = float(hyper.bc1), float(hyper.bc2)
    scalars.eps, scalars.weight_decay = float(hyper.eps), float(hyper.weight_decay)
    scalars.neg_lr = float(-hyper.lr)
    scalars.grad_scale = float(hyper.grad_scale) if hyper.grad_scale != 1.0 else 1.0
    scalars.bc1_next, scalars.b1_blend = float(hyper.bc1_next), float(hyper.b1)
    scalars.has_wd, scalars.nesterov = hyper.weight_decay != 0.0, bool(hyper.nesterov)
    q8 = isinstance(m, Quantized), isinstance(v, Quantized)
    NATIVE.adamw_step(
        m.codes if q8[0] else bits(m), v.codes if q8[1] else bits(v), bits(grad), param,
        out["update_out"], out["delta_base"], out["param_bf16_out"],
        m.scales if q8[0] else None, v.scales if q8[1] else None, scalars,
        update_param=bool(update_param), seed=None if seed is None else int(seed),
    )  # fmt: skip


def _dtype(x: np.ndarray | Quantized) -> np.dtype:
    return x.codes.dtype if isinstance(x, Quantized) else x.dtype


def lion_step(
    m: np.ndarray,
    grad: np.ndarray,
    param: np.ndarray,
    update_out: np.ndarray | None,
    hyper: LionHyper,
    *,
    update_param: bool = False,
    delta_base: np.ndarray | None = None,
    param_bf16_out: np.ndarray | None = None,
) -> None:
    """One fused Lion step over a contiguous segment, in place (native, multi-threaded).

    Same arguments and bits as :func:`jax_mlpo.optimizers.lion.lion_step_reference`. Arrays
    may be views into larger buffers; ``update_out`` may be ``grad`` itself (the same buffer
    and dtype); no other written array may overlap another.

    Args:
      m: float32 or bfloat16 moment, updated in place.
      grad: float32 or bfloat16 gradient (bfloat16 is converted on the fly).
      param: float32 parameters; read for weight decay, updated in place when ``update_param``.
      update_out: float32 output for the update, or None; with ``delta_base`` it receives
        ``new_param - float32(delta_base)``, or, when bfloat16, ``bfloat16(new_param) -
        delta_base``.
      hyper: the step's scalars.
      update_param: whether to add the update to ``param`` in place.
      delta_base: bfloat16 params the caller will add the update to, or None.
      param_bf16_out: bfloat16 output for the new params, or None.

    Raises:
      ValueError: on a wrong dtype, a non-contiguous or read-only output, a size mismatch,
        overlapping outputs, or ``delta_base`` without ``update_out``.
    """
    m = checked_array("m", m, (F32, BF16), None, writable=True)
    n = m.size
    grad = checked_array("grad", grad, (F32, BF16), n, writable=False)
    param = checked_array("param", param, (F32,), n, writable=update_param)
    out = checked_outputs(n, update_out, delta_base, param_bf16_out)
    # the scalars as the reference computes them, each rounded once to float32
    scalars = NATIVE.LionScalars()
    scalars.c1, scalars.b1 = float(1.0 - hyper.b1), moment_decay(hyper.b1, m.dtype)
    scalars.c2, scalars.b2 = float(1.0 - hyper.b2), moment_decay(hyper.b2, m.dtype)
    scalars.weight_decay, scalars.neg_lr = float(hyper.weight_decay), float(-hyper.lr)
    scalars.has_wd = hyper.weight_decay != 0.0
    NATIVE.lion_step(
        bits(m),
        bits(grad),
        param,
        out["update_out"],
        out["delta_base"],
        out["param_bf16_out"],
        scalars,
        update_param=bool(update_param),
    )


def momentum_step(m: np.ndarray, grad: np.ndarray, out: np.ndarray, hyper: MomentumHyper) -> None:
    """Muon's momentum pass over a contiguous segment, in place (native, multi-threaded).

    Same arguments and bits as :func:`jax_mlpo.optimizers.muon.momentum_step_reference`.

    Args:
      m: float32 or bfloat16 momentum, advanced in place.
      grad: float32 or bfloat16 gradient.
      out: float32 output for the momentum the device orthogonalizes; may be ``grad`` itself
        when that is float32.

    Raises:
      ValueError: on a wrong dtype, a non-contiguous or read-only output, a size mismatch or
        overlapping outputs.
    """
    m = checked_array("m", m, (F32, BF16), None, writable=True)
    n = m.size
    grad = checked_array("grad", grad, (F32, BF16), n, writable=False)
    out = checked_array("out", out, (F32,), n, writable=True)
    scalars = NATIVE.MomentumScalars()
    scalars.c, scalars.b = float(1.0 - hyper.beta), moment_decay(hyper.beta, m.dtype)
    scalars.beta, scalars.bc = float(hyper.beta), float(hyper.bc)
    scalars.bc_next = float(hyper.bc_next)
    scalars.nesterov = bool(hyper.nesterov)
    NATIVE.momentum_step(bits(m), bits(grad), out, scalars)


def apply_step(
    direction: np.ndarray,
    param: np.ndarray,
    update_out: np.ndarray | None,
    hyper: ApplyHyper,
    *,
    update_param: bool = False,
    delta_base: np.ndarray | None = None,
    param_bf16_out: np.ndarray | None = None,
) -> None:
    """Muon's master pass over a contiguous segment, in place (native, multi-threaded).

    Same arguments and bits as :func:`jax_mlpo.optimizers.muon.apply_step_reference`.

    Args:
      direction: float32, the orthogonalized and scaled momentum.
      param: float32 parameters (the fp32 master), read for weight decay, updated in place
        when ``update_param``.
      update_out: as :func:`adamw_step`'s; may be ``direction`` itself.
      hyper: the step's scalars.
      update_param: whether to add the update to ``param`` in place.
      delta_base: bfloat16 params the caller adds the update to, or None.
      param_bf16_out: bfloat16 output for the new params, or None.

    Raises:
      ValueError: as :func:`momentum_step`, or for ``delta_base`` without ``update_out``.
    """
    direction = checked_array("direction", direction, (F32,), None, writable=False)
    n = direction.size
    param = checked_array("param", param, (F32,), n, writable=update_param)
    out = checked_outputs(n, update_out, delta_base, param_bf16_out)
    scalars = NATIVE.ApplyScalars()
    scalars.weight_decay, scalars.neg_lr = float(hyper.weight_decay), float(-hyper.lr)
    scalars.has_wd = hyper.weight_decay != 0.0
    NATIVE.apply_step(
        direction,
        param,
        out["update_out"],
        out["delta_base"],
        out["param_bf16_out"],
        scalars,
        update_param=bool(update_param),
    )


# ---- the q8 moment code ----------------------------------------------------------------------


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


# ---- CRC-32C ---------------------------------------------------------------------------------


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
