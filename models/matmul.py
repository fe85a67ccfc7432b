"""The dense layers' contraction: bfloat16 matmuls accumulated in float32, forward and backward.

XLA's CPU backend runs a bfloat16 dot on its fast kernels (YNNPACK, with AMX or AVX512-BF16
where the CPU has them) only when the dot accumulates into float32 and contracts the last axis
of the left operand with the first of the right, or a transposed form it recognises. A plain
bfloat16 ``x @ w`` and the transposed dots that autodiff derives from it run on the generic
float32 path instead, 4-6x slower on this project's 2-core machines (measured with
``experiments/bench/mlpo/matmul.py``). :func:`dot_general` writes the forward pass and both
backward products in forms XLA puts on the fast path, each accumulated in float32 and rounded
once to bfloat16, which is what the plain dot computes too (up to the order of the sum). Other
dtypes and contractions go to ``lax.dot_general`` unchanged.

On GPU the same expressions are cuBLAS bfloat16 GEMMs with float32 accumulation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["dot_general"]


def _contract(a: jax.Array, b: jax.Array, a_axes: tuple, b_axes: tuple) -> jax.Array:
    """``a`` and ``b`` contracted over the given axes, summed in float32, rounded to a's dtype."""
    out = lax.dot_general(a, b, ((a_axes, b_axes), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(a.dtype)


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return _contract(x, w, (x.ndim - 1,), (0,))


def _matmul_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _matmul(x, w), (x, w)


def _matmul_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    dx = _contract(g, w, (g.ndim - 1,), (1,))  # g @ w.T, without materialising w.T
    # x.T @ g over every leading axis. As [1, tokens, features] both: XLA runs a contraction of
    # two leading axes on the fast path, and of a 2-D operand's first axis on the slow one.
    x3, g3 = x.reshape(1, -1, x.shape[-1]), g.reshape(1, -1, g.shape[-1])
    dw = _contract(x3, g3, (0, 1), (0, 1)).astype(w.dtype)
    return dx, dw


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """``lax.dot_general`` for ``flax.nnx.Linear(dot_general=...)``.

    A bfloat16 ``[..., K] x [K, N]`` contraction with a bfloat16 (or unspecified) result runs as
    a float32-accumulated matmul whose gradients are float32-accumulated too (module
    docstring); any other call is ``lax.dot_general``'s.

    Args:
      lhs: the inputs, ``[..., K]``.
      rhs: the kernel, ``[K, N]``.
      dimension_numbers: as ``lax.dot_general``.
      precision: as ``lax.dot_general`` (the bfloat16 path ignores it: it is exact in float32).
      preferred_element_type: as ``lax.dot_general``.
      **kwargs: passed to ``lax.dot_general`` (``out_sharding``).

    Returns:
      The contraction, ``[..., N]``.

    Examples:
      >>> import jax.numpy as jnp
      >>> x, w = jnp.ones((2, 3, 4), jnp.bfloat16), jnp.ones((4, 5), jnp.bfloat16)
      >>> dot_general(x, w, (((2,), (0,)), ((), ()))).shape
      (2, 3, 5)
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    fast = (
        lhs.dtype == rhs.dtype == jnp.bfloat16
        and rhs.ndim == 2
        and tuple(lhs_contract) == (lhs.ndim - 1,)
        and tuple(rhs_contract) == (0,)
        and not lhs_batch
        and not rhs_batch
        and preferred_element_type in (None, jnp.bfloat16)
        and kwargs.get("out_sharding") is None
    )
    if fast:
        return _matmul(lhs, rhs)
    if preferred_element_type is not None:
        kwargs["preferred_element_type"] = preferred_element_type
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)
