"""The fused Lion kernel on numpy arrays: one call per contiguous segment (``ffi/lion_isa.cc``).

The same float32 operations as the numpy reference (:func:`jax_mlpo.optimizers.lion.
lion_step_reference`), in its order, bit for bit on every instruction set: optax.lion's
``(1 - b) * x + b * t`` and ``sign + wd * p`` as fused multiply-adds computed in float64 and
rounded to float32, as XLA:CPU fuses them; nothing else contracted; denormals kept. The GIL is
released while it runs, and large segments are split over the library's threads.
"""

from __future__ import annotations

import numpy as np

from jax_mlpo.native.library import NATIVE, bits, checked_array, checked_outputs
from jax_mlpo.types import BF16, F32, LionHyper, moment_decay

__all__ = ["lion_step"]


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
