"""Lion on the host: the engine's optimizer for ``jax_mlpo.lion``, its numpy reference kernel.

``optax.lion`` (Chen et al. 2023) keeps one moment: each step moves every parameter by the
learning rate times the sign of an interpolation between the gradient and the moment, plus
decoupled weight decay, and then advances the moment with a second decay:

  u = -lr * (sign((1 - b1) g + b1 m) + wd p),    m <- (1 - b2) g + b2 m.

The reference below computes optax's float32 expressions in the form XLA:CPU compiles them
(``(1 - b) * x + b * t`` and ``sign + wd * p`` contract to fused multiply-adds, emulated in
float64 here); a bfloat16 ``mu_dtype`` rounds both decays to bfloat16 where they multiply the
stored moment, as optax's weak-typed products do (:func:`jax_mlpo.native.kernels.moment_decay`). The
native kernel (:func:`jax_mlpo.native.lion_step`) matches it bit for bit. The state is the fp32
master (bfloat16 params only) and m: 8 bytes per bfloat16 param, against AdamW's 12.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from jax_mlpo import native
from jax_mlpo.engine.layout import Subgroup
from jax_mlpo.engine.leaves import Leaves
from jax_mlpo.native.kernels import moment_decay
from jax_mlpo.optimizers import fma64, segment_calls, write_update
from jax_mlpo.types import F32, LionHyper

__all__ = ["Lion", "LionHyper", "lion_step_reference"]


def lion_step_reference(
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
    """One Lion step over a segment, in numpy (the reference the native kernel must match).

    Args:
      m: float32 or bfloat16 moment, updated in place.
      grad: float32 or bfloat16 gradient, converted to float32 here, never stored.
      param: float32 parameters, read for weight decay; ``param + update`` in place when
        ``update_param`` (the fp32 master copy of bfloat16 params).
      update_out: the update optax would return, or as
        :func:`~jax_mlpo.optimizers.write_update` says with ``delta_base``; None for none. It
        may be ``grad`` itself.
      hyper: the step's scalars.
      update_param: whether to apply the update to ``param`` in place.
      delta_base: bfloat16 params the caller adds the update to, or None.
      param_bf16_out: bfloat16 output for the new params, or None.
    """
    f32 = np.float32
    g = grad.astype(F32, copy=False)
    m32 = m.astype(F32)
    b1, b2 = f32(moment_decay(hyper.b1, m.dtype)), f32(moment_decay(hyper.b2, m.dtype))
    u = np.sign(fma64(f32(1.0 - hyper.b1), g, b1 * m32))
    m[...] = fma64(f32(1.0 - hyper.b2), g, b2 * m32)
    if hyper.weight_decay != 0.0:
        u = fma64(f32(hyper.weight_decay), param, u)
    write_update(u * f32(-hyper.lr), param, update_out, update_param, delta_base, param_bf16_out)


@dataclasses.dataclass(frozen=True)
class Lion:
    """``optax.lion``'s per-subgroup math, the engine's optimizer (:mod:`jax_mlpo.optimizers`)."""

    name: ClassVar[str] = "lion"
    moment_names: ClassVar[tuple[str, ...]] = ("mu",)
    scalar_names: ClassVar[tuple[str, ...]] = ("lr",)

    def hyper(self, scalars: Mapping[str, float]) -> LionHyper:
        """The learning rate and ``b1``, ``b2``, ``weight_decay``."""
        s = scalars
        return LionHyper(s["lr"], s["b1"], s["b2"], s["weight_decay"])

    def update(
        self, sg: Subgroup, blob: np.ndarray, leaves: Leaves, grad_blob: np.ndarray | None,
        hyper: LionHyper, *, count: int,
    ) -> None:  # fmt: skip
        """:meth:`HostOptimizer.update` with the native kernel."""
        hypers = (hyper._replace(weight_decay=0.0), hyper)  # masked out, decayed
        calls = segment_calls(sg, blob, leaves, grad_blob, init_master=count == 0)
        for seg, (m,), grad, param, out, base in calls:
            master = {"update_param": True, "delta_base": base} if base is not None else {}
            native.lion_step(m, grad, param, out, hypers[seg.decay], **master)
