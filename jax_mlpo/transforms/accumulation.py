"""Gradient accumulation for offloaded optimizers: ``optax.MultiSteps`` with one host update per
applied step.

``optax.MultiSteps`` runs the inner update on every micro-step, on the gradients accumulated so
far, and keeps its result only on the last one (``jnp.where(emit, new, old)``). An offloaded
optimizer advances its host state on every update it runs, so it cannot sit inside that.
:class:`MultiSteps` has optax's signature, state (:class:`optax.MultiStepsState`) and results,
but calls the inner update under ``lax.cond`` on the emitting micro-step only (``lax.cond`` with
a scalar predicate runs one branch): the host update runs once per ``k`` micro-steps, and the
other micro-steps only add the gradients to the accumulator, on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__ = ["MultiSteps"]


class MultiSteps:
    """Accumulates gradients over micro-steps and applies the inner optimizer every ``k``.

    ``optax.MultiSteps``'s arguments and semantics (the mean, or the sum, of ``k`` micro-batch
    gradients; zero updates in between; ``gradient_step``, ``has_updated``), for any inner
    optimizer, offloaded or not: the inner update runs only on the micro-step whose update is
    applied.

    Args:
      opt: the inner optimizer (e.g. ``jax_mlpo.adamw(...)`` or a chain holding it).
      every_k_schedule: an int, or a function of the gradient step giving the number of
        micro-steps to accumulate.
      use_grad_mean: average the accumulated gradients (True) or sum them.
      should_skip_update_fn: as in ``optax.MultiSteps``: a micro-step for which it returns True
        leaves the state as it was.
      accumulator_dtype: the accumulator's dtype. None (the default): the params' dtype, so
        that a bfloat16 model's accumulator costs 2 bytes per param, as its gradients do;
        ``jnp.float32`` is ``optax.MultiSteps``'s default.

    Example::

      tx = jax_mlpo.MultiSteps(jax_mlpo.adamw(3e-4, offload=config), every_k_schedule=4)
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: int | Callable[[jax.Array], jax.Array],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable[..., tuple[jax.Array, Any]] | None = None,
        accumulator_dtype: Any = None,
    ) -> None:
        self._opt = optax.with_extra_args_support(opt)
        if isinstance(every_k_schedule, int):
            if every_k_schedule < 1:
                raise ValueError(f"every_k_schedule must be >= 1, got {every_k_schedule}")
            self._every_k_schedule = lambda step: every_k_schedule
        else:
            self._every_k_schedule = every_k_schedule
        self._use_grad_mean = use_grad_mean
        self._accumulator_dtype = accumulator_dtype
        if should_skip_update_fn is None:

            def should_skip_update_fn(*unused_args, **unused_kwargs):
                return jnp.array(False, dtype=jnp.bool_), ()

        self._should_skip_update_fn = should_skip_update_fn

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer."""
        return self._opt

    def _acc_update(self, grad: jax.Array, acc: jax.Array, n_acc: jax.Array) -> jax.Array:
        # optax.MultiSteps's expressions, so the accumulated gradients match it bit for bit
        return acc + (grad - acc) / (n_acc + 1) if self._use_grad_mean else grad + acc

    def init(self, params: Any) -> optax.MultiStepsState:
        """The initial state: zero accumulator, zero counters, the inner optimizer's state."""
        updates = optax.tree.zeros_like(params)
        acc_grads = optax.tree.zeros_like(params, dtype=self._accumulator_dtype)
        gradient_step = jnp.zeros([], dtype=jnp.int32)
        _, skip_state = self._should_skip_update_fn(updates, gradient_step, params)
        return optax.MultiStepsState(
            mini_step=jnp.zeros([], dtype=jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=acc_grads,
            skip_state=skip_state,
        )

    def update(
        self,
        updates: Any,
        state: optax.MultiStepsState,
        params: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, optax.MultiStepsState]:
        """Accumulates ``updates``; on the ``k``-th micro-step, applies the inner optimizer.

        Args:
          updates: the micro-batch's gradients.
          state: the state the previous call returned.
          params: the params (the inner optimizer's ``update`` receives them).
          **extra_args: passed to the inner optimizer.

        Returns:
          The inner optimizer's updates on the applying micro-step, zeros on the others, and
          the new state.
        """
        k_steps = self._every_k_schedule(state.gradient_step)
        should_skip, skip_state = self._should_skip_update_fn(updates, state.gradient_step, params)
        if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
            raise ValueError(
                "should_skip_update_fn must return a boolean scalar, got "
                f"{should_skip.dtype}{list(should_skip.shape)}"
            )
        inner_update = functools.partial(self._opt.update, **extra_args)
        shapes = jax.eval_shape(inner_update, updates, state.inner_opt_state, params)[0]

        def zero_updates(grads):  # made inside the skipping branch, not held outside it
            # zeros_like of the gradients, in the inner update's dtypes: with sharding in the
            # array types (an Explicit mesh) they carry the params' sharding, as the
            # accumulating branch's results do, and lax.cond needs both branches' types equal
            return jax.tree.map(lambda g, x: jnp.zeros_like(g, x.dtype), grads, shapes)

        def accumulate(updates, state, params):
            acc_grads = jax.tree.map(
                lambda g, acc: self._acc_update(g, acc, state.mini_step), updates, state.acc_grads
            )
            emit = state.mini_step == (k_steps - 1)

            # One result of the params' size either way: the inner update on the applying
            # micro-step (which may take the accumulated gradients' buffer), the accumulated
            # gradients themselves on the others. The updates and the next accumulator are
            # selections of it (zeros elsewhere) that XLA fuses into their consumers, so
            # params, gradients and accumulator are all the step holds of the params' size
            # (two results held two more buffers: docs/benchmarks.md, "Memory"). Its dtype per
            # leaf holds both exactly: float32 for a float32 accumulator of bfloat16 params,
            # whose sums are then not rounded to bfloat16 on the way through.
            dtypes = jax.tree.map(lambda u, a: jnp.promote_types(u.dtype, a.dtype), shapes,
                                  state.acc_grads)  # fmt: skip

            def apply(acc_grads, inner_state, params):
                result, inner_state = inner_update(
                    optax.tree.cast_like(acc_grads, updates), inner_state, params
                )
                return jax.tree.map(lambda r, dt: r.astype(dt), result, dtypes), inner_state

            def hold(acc_grads, inner_state, params):
                return jax.tree.map(lambda a, dt: a.astype(dt), acc_grads, dtypes), inner_state

            # the inner (host) update runs on the emitting micro-step only
            result, inner_state = lax.cond(
                emit, apply, hold, acc_grads, state.inner_opt_state, params
            )
            new_updates = jax.tree.map(
                lambda r, u: jnp.where(emit, r, jnp.zeros_like(r)).astype(u.dtype), result, shapes
            )
            next_acc = jax.tree.map(
                lambda r, old: jnp.where(emit, jnp.zeros_like(old), r.astype(old.dtype)),
                result, state.acc_grads,
            )  # fmt: skip
            new_state = optax.MultiStepsState(
                mini_step=optax.safe_increment(state.mini_step) % k_steps,
                gradient_step=emit * optax.safe_increment(state.gradient_step)
                + (1 - emit) * state.gradient_step,
                inner_opt_state=inner_state,
                acc_grads=next_acc,
                skip_state=skip_state,
            )
            return new_updates, new_state

        def skip(updates, state, params):
            return zero_updates(updates), state._replace(skip_state=skip_state)

        return lax.cond(should_skip, skip, accumulate, updates, state, params)

    def has_updated(self, state: optax.MultiStepsState) -> jax.Array:
        """Whether the last call applied an update."""
        return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """This wrapper as an ``optax.GradientTransformationExtraArgs`` (its update passes
        extra keyword arguments to the inner optimizer, as ``optax.MultiSteps``'s does)."""
        return optax.GradientTransformationExtraArgs(init=self.init, update=self.update)
