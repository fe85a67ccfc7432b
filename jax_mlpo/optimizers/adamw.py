"""AdamW on the host: the engine's optimizer, its numpy reference kernel.

:class:`AdamW` calls the kernel (:func:`jax_mlpo.native.adamw_step`, the compiled one) once per
contiguous segment of a subgroup (a segment is the
part of one parameter leaf that falls in one subgroup, so it has one weight-decay value). The
arithmetic follows ``optax.adamw`` operation by operation (``scale_by_adam`` →
``add_decayed_weights`` → ``scale_by_learning_rate``) in float32, with the fused multiply-adds
and reciprocals XLA:CPU uses, so the update equals a jitted ``optax.adamw`` update bit for bit
(except for the rare double rounding of the float64 emulation of fma in this reference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import ClassVar

import numpy as np

from jax_mlpo import native
from jax_mlpo.engine.layout import Subgroup
from jax_mlpo.engine.leaves import Leaves
from jax_mlpo.engine.quantize import Quantized, decode_reference, encode_reference, segment_seed
from jax_mlpo.native.kernels import moment_decay
from jax_mlpo.optimizers import fma64, segment_calls, write_update
from jax_mlpo.types import F32, AdamWHyper

__all__ = ["AdamW", "AdamWHyper", "adamw_step_reference", "adamw_subgroup"]


def adamw_step_reference(
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
    """One AdamW step over a segment, in numpy (the reference the native kernel must match).

    Args:
      m: float32 or bfloat16 first moment, or its q8 code (:mod:`jax_mlpo.engine.quantize`: decoded
        here, advanced in float32, encoded again), updated in place.
      v: the same for the second moment.
      grad: float32 or bfloat16 gradient; bfloat16 is converted to float32 here (delayed
        conversion), never stored.
      param: float32 parameters. Read for weight decay; when ``update_param`` the new value
        ``param + update`` is written back in place (fp32 master copy of bf16 params).
      update_out: float32 output for the update optax would return, or None. With
        ``delta_base`` it receives ``new_param - float32(delta_base)`` instead, or, when it is
        bfloat16, ``bfloat16(new_param) - delta_base`` in bfloat16 (the update in the params'
        dtype). It may be ``grad`` itself: the update then overwrites its gradient.
      hyper: the step's scalars.
      update_param: whether to apply the update to ``param`` in place.
      delta_base: bfloat16 params the caller will add the update to (see DESIGN "Precision").
      param_bf16_out: bfloat16 output for the new params rounded to nearest even, or None.
      seed: q8 moments are rounded stochastically with this seed, or to nearest when None.
    """
    f32 = np.float32
    q8 = isinstance(m, Quantized), isinstance(v, Quantized)
    m_stored, v_stored = m, v
    if q8[0]:
        m = decode_reference(m, signed=True)
    if q8[1]:
        v = decode_reference(v, signed=False)
    g = grad.astype(F32, copy=False)
    if hyper.grad_scale != 1.0:
        g = g * f32(hyper.grad_scale)
    # optax's expressions, in the form XLA:CPU compiles them (measured bit for bit against a
    # jitted optax.adamw update): (1 - b) * x + b * t contracts to fma((1 - b), x, b * t),
    # division by the scalar bias correction becomes multiplication by its float32
    # reciprocal, and u + wd * p contracts to fma(wd, p, u).
    # A bfloat16 moment is widened here and rounded (to nearest even) when stored; the update
    # uses the float32 values, as optax does with mu_dtype (native.kernels.moment_decay: the decay).
    # With both moments q8 the kernel uses the float32 fma itself (one rounding), not its
    # float64 emulation: the moments are rounded to 3 bits anyway, and it is 1.3x faster.
    fma = _fma_single if all(q8) else fma64
    m32 = fma(f32(1.0 - hyper.b1), g, f32(moment_decay(hyper.b1, m.dtype)) * m.astype(F32))
    v32 = fma(f32(1.0 - hyper.b2), g * g, f32(hyper.b2) * v.astype(F32))
    for stored, x, signed in ((m_stored, m32, True), (v_stored, v32, False)):
        if isinstance(stored, Quantized):
            stored.codes[...], stored.scales[...] = encode_reference(x, signed=signed, seed=seed)
        else:
            stored[...] = x
    inv_bc1 = f32(1.0) / f32(hyper.bc1)
    inv_bc2 = f32(1.0) / f32(hyper.bc2)
    # optax's nesterov: b1 * m / bc1_next + (1 - b1) * g / bc1, the first product fused (as in
    # a jitted optax.adamw update; other programs may fuse the second: docs/design.md, Muon)
    if hyper.nesterov:
        inv_next = f32(1.0) / f32(hyper.bc1_next)
        m_hat = fma64(f32(hyper.b1), m32 * inv_next, f32(1.0 - hyper.b1) * (g * inv_bc1))
    else:
        m_hat = m32 * inv_bc1
    u = m_hat / (np.sqrt(v32 * inv_bc2) + f32(hyper.eps))
    if hyper.weight_decay != 0.0:
        u = fma(f32(hyper.weight_decay), param, u)
    u = u * f32(-hyper.lr)
    write_update(u, param, update_out, update_param, delta_base, param_bf16_out)


def _fma_single(a: np.float32, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """float32 a * x + y with one rounding, as a hardware fma: the product is exact in
    float64, the sum is rounded to odd there (Boldo and Melquiond: rounding to odd with 2 or
    more extra bits, then to nearest, is one rounding to nearest)."""
    p = np.float64(a) * np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    s = p + y
    bb = s - p
    err = (p - (s - bb)) + (y - bb)  # TwoSum: s + err == p + y exactly
    even = (s.view(np.uint64) & np.uint64(1)) == 0
    inexact = (err != 0) & even & np.isfinite(s)
    s = np.where(inexact, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def adamw_subgroup(
    kernel: Callable[..., None],
    sg: Subgroup,
    blob: np.ndarray,
    leaves: Leaves,
    grad_blob: np.ndarray | None,
    hypers: tuple[AdamWHyper, AdamWHyper],
    init_master: bool,
    count: int = 0,
    stochastic: bool = False,
) -> None:
    """One AdamW step of a resident subgroup: ``kernel`` over each of its segments.

    Args:
      kernel: :func:`jax_mlpo.native.adamw_step` or :func:`adamw_step_reference`.
      sg: the subgroup.
      blob: its ``[p | m | v]`` (or ``[m | v]``) state, updated in place.
      leaves: the update's gradients, params and updates (fetched for this subgroup); the
        gradients are read where ``grad_blob`` is None, the updates written (float32, or
        bfloat16 for bfloat16 params; an update may be its gradient's own buffer).
      grad_blob: the subgroup's fp32 gradients (the baseline's tier path), or None.
      hypers: the step's scalars without and with weight decay (a segment's mask picks one).
      init_master: the first step: the fp32 master copy starts as the bf16 params' value.
      count: the optimizer's step count (0 for the first), which seeds stochastic rounding.
      stochastic: q8 moments are rounded stochastically (else to nearest).
    """
    q8 = any(isinstance(x, Quantized) for x in sg.split(blob)[1:])
    calls = segment_calls(sg, blob, leaves, grad_blob, init_master=init_master)
    for seg, moments, grad, param, out, base in calls:
        seed = segment_seed(count, sg.index, seg.start) if stochastic and q8 else None
        master = {"update_param": True, "delta_base": base} if base is not None else {}
        kernel(*moments, grad, param, out, hypers[seg.decay], seed=seed, **master)


@dataclasses.dataclass(frozen=True)
class AdamW:
    """``optax.adamw``'s per-subgroup math, the engine's optimizer (:mod:`jax_mlpo.optimizers`).

    Attributes:
      stochastic_rounding: q8 moments are rounded stochastically, else to nearest.
      nesterov: optax's ``nesterov=True`` (float32 and bfloat16 moments).
    """

    stochastic_rounding: bool = False
    nesterov: bool = False
    name: ClassVar[str] = "adamw"
    moment_names: ClassVar[tuple[str, ...]] = ("mu", "nu")
    # the learning rate, both bias corrections, the clipping scale, b1's at the next count
    scalar_names: ClassVar[tuple[str, ...]] = ("lr", "bc1", "bc2", "grad_scale", "bc1_next")

    def hyper(self, scalars: Mapping[str, float]) -> AdamWHyper:
        """The step's scalars and ``b1``, ``b2``, ``eps``, ``weight_decay``."""
        s = scalars
        return AdamWHyper(
            s["bc1"], s["bc2"], s["lr"], s["b1"], s["b2"], s["eps"], s["weight_decay"],
            grad_scale=s["grad_scale"], nesterov=self.nesterov,
            bc1_next=s["bc1_next"] if self.nesterov else 1.0,
        )  # fmt: skip

    def update(
        self, sg: Subgroup, blob: np.ndarray, leaves: Leaves, grad_blob: np.ndarray | None,
        hyper: AdamWHyper, *, count: int,
    ) -> None:  # fmt: skip
        """:meth:`HostOptimizer.update` with the native kernel."""
        hypers = (hyper._replace(weight_decay=0.0), hyper)  # masked out, decayed
        adamw_subgroup(
            native.adamw_step, sg, blob, leaves, grad_blob, hypers, init_master=count == 0,
            count=count, stochastic=self.stochastic_rounding,
        )  # fmt: skip
