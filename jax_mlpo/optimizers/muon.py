"""Muon on the host: its two passes, the engines' optimizers for ``jax_mlpo.muon``.

``optax.contrib.muon`` (Jordan et al. 2024) keeps one momentum per matrix and orthogonalizes it
by Newton-Schulz iterations: the orthogonalization needs whole matrices and runs on the device
(:mod:`jax_mlpo.transforms.muon`), so the host does what is elementwise, in two passes around it:

* the momentum pass (:class:`MuonMomentum`): ``m <- (1 - b) g + b m``, then the momentum the
  device orthogonalizes, ``m / bc``, or with nesterov ``b m / bc_next + (1 - b) g / bc``
  (``bc = 1 - b**t``), written in float32 over the gradients (or beside bfloat16 ones);
* the master pass (:class:`MuonMaster`, bfloat16 params only): ``-lr (d + wd p)`` from the
  orthogonalized direction ``d``, applied to the fp32 master, the update written as
  ``bfloat16(master_new) - params``. With float32 params this is a device expression.

The references below compute optax's float32 expressions in the form XLA:CPU compiles them
(fused multiply-adds emulated in float64; divisions by the bias corrections are multiplications
by their float32 reciprocals); the native kernels (:func:`jax_mlpo.native.momentum_step`,
:func:`jax_mlpo.native.apply_step`) match them bit for bit.
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
from jax_mlpo.types import F32, ApplyHyper, MomentumHyper

__all__ = [
    "MuonMaster",
    "MuonMomentum",
    "apply_step_reference",
    "momentum_step_reference",
]


def momentum_step_reference(
    m: np.ndarray, grad: np.ndarray, out: np.ndarray, hyper: MomentumHyper
) -> None:
    """Muon's momentum pass over a segment, in numpy (the native kernel's reference).

    Args:
      m: float32 or bfloat16 momentum, advanced in place (a bfloat16 one with its decay
        rounded to bfloat16, as optax's ``mu_dtype`` does:
        :func:`jax_mlpo.native.kernels.moment_decay`).
      grad: float32 or bfloat16 gradient.
      out: float32 output for the momentum the device orthogonalizes; may be ``grad``.
      hyper: the step's scalars.
    """
    f32 = np.float32
    g = grad.astype(F32)
    c = f32(1.0 - hyper.beta)
    mi = fma64(c, g, f32(moment_decay(hyper.beta, m.dtype)) * m.astype(F32))
    m[...] = mi
    inv_bc = f32(1.0) / f32(hyper.bc)
    if hyper.nesterov:
        inv_next = f32(1.0) / f32(hyper.bc_next)
        out[...] = fma64(f32(hyper.beta), mi * inv_next, c * (g * inv_bc))
    else:
        out[...] = mi * inv_bc


def apply_step_reference(
    direction: np.ndarray,
    param: np.ndarray,
    update_out: np.ndarray | None,
    hyper: ApplyHyper,
    *,
    update_param: bool = False,
    delta_base: np.ndarray | None = None,
    param_bf16_out: np.ndarray | None = None,
) -> None:
    """Muon's master pass over a segment, in numpy: ``-lr (d + wd p)`` (optax's
    ``add_decayed_weights`` as a fused multiply-add, then ``scale_by_learning_rate``), written
    as :func:`~jax_mlpo.optimizers.write_update` says."""
    f32 = np.float32
    u = np.asarray(direction, F32).copy()
    if hyper.weight_decay != 0.0:
        u = fma64(f32(hyper.weight_decay), param, u)
    write_update(u * f32(-hyper.lr), param, update_out, update_param, delta_base, param_bf16_out)


@dataclasses.dataclass(frozen=True)
class MuonMomentum:
    """The momentum pass of ``optax.contrib.scale_by_muon`` (:mod:`jax_mlpo.optimizers`).

    Its state keeps no fp32 master: a bfloat16 param's master is :class:`MuonMaster`'s.

    Attributes:
      nesterov: optax's ``nesterov``.
    """

    nesterov: bool
    name: ClassVar[str] = "muon_momentum"
    moment_names: ClassVar[tuple[str, ...]] = ("mu",)
    scalar_names: ClassVar[tuple[str, ...]] = ("bc", "bc_next")  # bias corrections, t and t+1

    def hyper(self, scalars: Mapping[str, float]) -> MomentumHyper:
        """The bias corrections and ``beta``."""
        return MomentumHyper(scalars["beta"], scalars["bc"], scalars["bc_next"], self.nesterov)

    def update(
        self, sg: Subgroup, blob: np.ndarray, leaves: Leaves, grad_blob: np.ndarray | None,
        hyper: MomentumHyper, *, count: int,
    ) -> None:  # fmt: skip
        """:meth:`HostOptimizer.update` with the native kernel."""
        for _, (m,), grad, _, out, _ in segment_calls(sg, blob, leaves, grad_blob,
                                                     init_master=False):  # fmt: skip
            native.momentum_step(m, grad, out, hyper)


@dataclasses.dataclass(frozen=True)
class MuonMaster:
    """The master pass of bfloat16 params: optax.contrib.muon's weight decay and learning rate
    on the orthogonalized direction, applied to the fp32 master (:mod:`jax_mlpo.optimizers`)."""

    name: ClassVar[str] = "muon_master"
    moment_names: ClassVar[tuple[str, ...]] = ()
    scalar_names: ClassVar[tuple[str, ...]] = ("lr",)

    def hyper(self, scalars: Mapping[str, float]) -> ApplyHyper:
        """The learning rate and ``weight_decay``."""
        return ApplyHyper(scalars["lr"], scalars["weight_decay"])

    def update(
        self, sg: Subgroup, blob: np.ndarray, leaves: Leaves, grad_blob: np.ndarray | None,
        hyper: ApplyHyper, *, count: int,
    ) -> None:  # fmt: skip
        """:meth:`HostOptimizer.update` with the native kernel: the leaves' gradients are the
        orthogonalized directions."""
        hypers = (hyper._replace(weight_decay=0.0), hyper)  # masked out, decayed
        calls = segment_calls(sg, blob, leaves, grad_blob, init_master=count == 0)
        for seg, _, direction, param, out, base in calls:
            master = {"update_param": True, "delta_base": base} if base is not None else {}
            native.apply_step(direction, param, out, hypers[seg.decay], **master)
