"""Muon's two host passes on numpy arrays: one call per contiguous segment (``ffi/muon_isa.cc``).

The same float32 operations as the numpy references (:mod:`jax_mlpo.optimizers.muon`), in their
order, bit for bit on every instruction set. The GIL is released while they run, and large
segments are split over the library's threads.
"""

from __future__ import annotations

import numpy as np

from jax_mlpo.native.library import NATIVE, bits, checked_array, checked_outputs
from jax_mlpo.types import BF16, F32, ApplyHyper, MomentumHyper, moment_decay

__all__ = ["apply_step", "momentum_step"]


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
      update_out: as :func:`jax_mlpo.native.adamw_step`'s; may be ``direction`` itself.
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
