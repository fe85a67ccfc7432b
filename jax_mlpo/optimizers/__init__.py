"""The per-subgroup math of each offloaded optimizer, behind one interface.

The engine makes a subgroup's state blob resident and hands it, with the update's leaves, to
its optimizer's :meth:`HostOptimizer.update`, which advances the moments in place and writes
the update where the leaves say (:mod:`jax_mlpo.engine.leaves`). An optimizer names its moments (the
blob's parts after the fp32 master, and the arrays of ``state_dict`` and of checkpoints) and
reads the step's scalars by name (:mod:`jax_mlpo.engine.scalars`). :mod:`.adamw`, :mod:`.lion` and
:mod:`.muon` are the built-in ones; each has a numpy reference and a fused native kernel that
matches it bit for bit. :mod:`jax_mlpo.extend` is how one is added from outside.
"""

from __future__ import annotations

import numpy as np

from jax_mlpo.engine.leaves import segment_calls
from jax_mlpo.engine.optimizer import HostOptimizer
from jax_mlpo.types import BF16, F32

__all__ = ["HostOptimizer", "fma64", "segment_calls", "write_update"]


def write_update(
    u: np.ndarray, param: np.ndarray, update_out: np.ndarray | None, update_param: bool,
    delta_base: np.ndarray | None, param_bf16_out: np.ndarray | None,
) -> None:  # fmt: skip
    """Where a reference kernel's float32 update ``u`` goes, as the native kernels write it.

    Args:
      u: the update optax would return.
      param: the float32 params (the fp32 master of bfloat16 ones), ``param + u`` in place
        when ``update_param``.
      update_out: ``u``; with ``delta_base``, ``new_param - float32(delta_base)``, or
        ``bfloat16(new_param) - delta_base`` when it is bfloat16; or None.
      update_param: whether to add ``u`` to ``param``.
      delta_base: the bfloat16 params the caller adds the update to, or None.
      param_bf16_out: the new params rounded to bfloat16, or None.
    """
    if update_param:
        param += u
    if update_out is not None:
        if delta_base is not None and update_out.dtype == BF16:
            new = param.astype(BF16).astype(F32)
            update_out[...] = (new - delta_base.astype(F32)).astype(BF16)
        elif delta_base is not None:
            np.subtract(param, delta_base.astype(F32), out=update_out)
        else:
            update_out[...] = u
    if param_bf16_out is not None:
        param_bf16_out[...] = param.astype(BF16)


def fma64(a: np.float32, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """float32 a * x + y with one rounding (via float64, where the product is exact)."""
    return (np.float64(a) * x.astype(np.float64) + y).astype(F32)
