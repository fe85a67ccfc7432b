"""The fused AdamW kernel: one call per contiguous segment, on numpy arrays or inside jit.

Two ways in to the same loop (``jax_mlpo/ffi/kernels_isa.cc``):

* :func:`adamw_step` on numpy arrays (the engine's path): a ctypes call, the GIL released
  while it runs, multi-threaded over large segments.
* :func:`adamw_update`, an XLA FFI call usable inside ``jax.jit`` (CPU), in place through
  ``input_output_aliases`` when m, v and param are donated.

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

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlpo.engine.quantize import Quantized
from jax_mlpo.native.library import (
    I64,
    LIB,
    P,
    address,
    check_kernel_rc,
    checked_array,
    checked_outputs,
    declare,
)
from jax_mlpo.native.quantize import checked_quantized
from jax_mlpo.types import BF16, F32, AdamWHyper, moment_decay

__all__ = ["adamw_step", "adamw_update"]

# c1, b1, c2, b2, bc1, bc2, eps, weight_decay, -lr, grad_scale, bc1_next, f32(b1)
# (jax_mlpo_adamw_step's order).
_SCALARS = ctypes.c_float * 12

declare(
    LIB,
    [
        ("jax_mlpo_adamw_step", [P, P, ctypes.c_int, P, P, ctypes.c_uint32, P, ctypes.c_int, P,
                                 ctypes.c_int, P, ctypes.c_int, P, P, I64, _SCALARS,
                                 ctypes.c_int], ctypes.c_int),
    ],
)  # fmt: skip
jax.ffi.register_ffi_target("jax_mlpo_adamw", jax.ffi.pycapsule(LIB.JaxMlpoAdamW), platform="cpu")


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
    ptr = checked_outputs(n, update_out, delta_base, param_bf16_out)
    update_bf16 = update_out is not None and update_out.dtype == BF16
    # The scalars exactly as the reference computes them: the same Python expressions, rounded
    # once to float32 (ctypes' double -> float conversion rounds to nearest even, like numpy).
    scale = hyper.grad_scale != 1.0
    scalars = _SCALARS(
        float(1.0 - hyper.b1), moment_decay(hyper.b1, _dtype(m)), float(1.0 - hyper.b2),
        float(hyper.b2),
        float(hyper.bc1), float(hyper.bc2), float(hyper.eps), float(hyper.weight_decay),
        float(-hyper.lr), float(hyper.grad_scale) if scale else 1.0,
        float(hyper.bc1_next), float(hyper.b1),
    )  # fmt: skip
    q8 = isinstance(m, Quantized), isinstance(v, Quantized)
    flags = (int(_dtype(m) == BF16) | int(_dtype(v) == BF16) << 1 | int(q8[0]) << 2
             | int(q8[1]) << 3 | int(seed is not None) << 4 | int(hyper.nesterov) << 5)  # fmt: skip
    rc = LIB.jax_mlpo_adamw_step(
        address(m.codes) if q8[0] else address(m), address(v.codes) if q8[1] else address(v),
        flags, address(m.scales) if q8[0] else None, address(v.scales) if q8[1] else None,
        int(seed or 0), address(grad), int(grad.dtype == BF16), address(param),
        int(update_param), ptr["update_out"], int(update_bf16), ptr["delta_base"],
        ptr["param_bf16_out"], n,
        scalars, int(hyper.weight_decay != 0.0),
    )  # fmt: skip
    check_kernel_rc("adamw_step", rc, "m, v")


def _dtype(x: np.ndarray | Quantized) -> np.dtype:
    return x.codes.dtype if isinstance(x, Quantized) else x.dtype


def adamw_update(
    m: jax.Array,
    v: jax.Array,
    grad: jax.Array,
    param: jax.Array,
    hyper: AdamWHyper,
    *,
    update_param: bool = False,
    update_buffer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Fused AdamW as an XLA FFI call (CPU), in place when m, v (and param) are donated.

    ``hyper.lr``, ``bc1`` and ``bc2`` are runtime float32 scalars (a schedule does not
    recompile); ``b1``, ``b2``, ``eps``, ``weight_decay`` and ``grad_scale`` must be Python
    floats (compile-time attributes). Same bits as :func:`adamw_step`.

    Args:
      m, v, grad, param: as in :func:`adamw_step` (grad float32 or bfloat16), any equal shape.
      hyper: the step's scalars.
      update_param: whether the returned params include the update (then donate ``param``;
        otherwise it is only read and returned as is).
      update_buffer: a float32 buffer (e.g. last step's update, donated) to write the update
        into; saves XLA faulting in a fresh buffer every step. Its contents are ignored.

    Returns:
      ``(m, v, param, update)``: new moments, params (updated when ``update_param``, else the
      input) and the float32 update optax would return.
    """
    f32 = np.float32
    out = jax.ShapeDtypeStruct(jnp.shape(m), jnp.float32)
    scalars = [jnp.asarray(x, jnp.float32).reshape(()) for x in (hyper.lr, hyper.bc1, hyper.bc2)]
    # Inputs m, v, grad, param, lr, bc1, bc2 [, update buffer]; results m, v, update [, param].
    args = [m, v, grad, param, *scalars]
    aliases = {0: 0, 1: 1}
    if update_buffer is not None:
        args.append(update_buffer)
        aliases[7] = 2
    if update_param:
        aliases[3] = 3
    call = jax.ffi.ffi_call(
        "jax_mlpo_adamw", (out,) * (4 if update_param else 3), input_output_aliases=aliases
    )
    scale = hyper.grad_scale != 1.0
    results = call(
        *args,
        b1=f32(hyper.b1), c1=f32(1.0 - hyper.b1), b2=f32(hyper.b2), c2=f32(1.0 - hyper.b2),
        eps=f32(hyper.eps), weight_decay=f32(hyper.weight_decay),
        grad_scale=f32(hyper.grad_scale) if scale else f32(1.0),
        has_wd=bool(hyper.weight_decay != 0.0), update_param=bool(update_param),
    )  # fmt: skip
    m, v, update = results[:3]
    return m, v, results[3] if update_param else param, update
