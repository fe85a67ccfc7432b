"""The fused AdamW kernel on numpy arrays: one call per contiguous segment.

:func:`adamw_step` is the engine's path into the loop (``jax_mlpo/ffi/kernels_isa.cc``): the
GIL released while it runs, multi-threaded over large segments. The benchmarks' XLA FFI call of
the same loop inside ``jax.jit`` is :func:`jax_mlpo.native.testing.adamw_update`.

Both compute the numpy reference's float32 operations in its order
(:func:`jax_mlpo.optimizers.adamw.adamw_step_reference`), bit for bit, on every instruction
set. Those are optax's expressions in the form XLA:CPU compiles them: the moment updates
``(1 - b) * x + b * t`` and the weight decay ``u + wd * p`` are fused multiply-adds, computed
in float64 and rounded to float32 (the float32 product is exact in float64, so this is XLA's
float32 fma except in the rare cases where rounding the sum twice moves the last bit); division
by the bias corrections is multiplication by their float32 reciprocals, themselves IEEE
divisions; the remaining division and the square root are IEEE float32; nothing else is
contracted (``-ffp-contract=off``), and denormals are kept whatever the calling thread's
FTZ/DAZ flags. Hence a jitted ``optax.adamw`` update bit for bit, but for those rare cases.
"""

from __future__ import annotations

import numpy as np

from jax_mlpo.native.library import NATIVE, bits, checked_array, checked_outputs
from jax_mlpo.native.quantize import checked_quantized
from jax_mlpo.types import BF16, F32, AdamWHyper, Quantized, moment_decay

__all__ = ["adamw_step"]


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
