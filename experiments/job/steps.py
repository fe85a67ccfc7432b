"""The training step's two jitted halves, and what XLA says the first one needs.

:func:`grad_step` is the forward and backward pass, one jitted function per model graph.
:func:`grad_step_temp_bytes` compiles it for the config's shapes without allocating anything
(``jax.ShapeDtypeStruct`` params from ``nnx.eval_shape``) and returns XLA's own figure for its
temporaries (activations kept for the backward pass, the backward pass's intermediates, the
fp32 logits and their gradient). The memory plan counts that figure, not an estimate. Because
both go through the same function object, the training loop's first call finds the program
already compiled.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.job.run_config import RunConfig, resolve_model
from models import Llama, LlamaConfig, loss_fn


@functools.cache
def grad_step(graphdef: nnx.GraphDef) -> Any:
    """``grad_step(params, rest, tokens) -> (loss, grads)``: the jitted forward and backward
    pass of the model ``graphdef`` describes (one per graph, so that compiling it once for
    the memory plan serves the training loop too)."""

    @jax.jit
    def step(params: nnx.State, rest: nnx.State, tokens: jax.Array):
        def loss_of(p: nnx.State) -> jax.Array:
            return loss_fn(nnx.merge(graphdef, p, rest), tokens)

        return jax.value_and_grad(loss_of)(params)

    return step


def make_steps(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> tuple[Any, Any]:
    """The two jitted halves of a training step, timed apart.

    ``grad_step(params, rest, tokens) -> (loss, grads)`` is the forward and backward pass;
    ``update_step(grads, opt_state, params) -> (params, opt_state)`` is the optimizer update.
    With jax_mlpo the update's AdamW runs on the host inside one XLA FFI call, so the
    wall time of ``update_step`` is the update phase. The update donates its inputs: jax_mlpo
    then writes the update over the gradients' buffer and ``apply_updates`` the params' (XLA's
    CPU backend honours donation too).

    Args:
      graphdef: the model's graph (``nnx.split``).
      tx: the optimizer.

    Returns:
      ``(grad_step, update_step)``.
    """

    def update(grads: nnx.State, opt_state: Any, params: nnx.State):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(update, donate_argnums=(0, 1, 2))

    def update_step(grads: nnx.State, opt_state: Any, params: nnx.State):
        # JAX warns that the donated gradients are "not usable" because no output of the jit
        # takes their buffers, but jax_mlpo's update call writes into them in place: without
        # the donation XLA copies them first (compiled.memory_analysis(): temp bytes 0 with
        # it, the gradients' size without). Nothing for a user to act on.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return jitted(grads, opt_state, params)

    return grad_step(graphdef), update_step


def abstract_model(model: LlamaConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, params, rest)`` of the model as ``jax.ShapeDtypeStruct`` leaves: nothing is
    allocated (``nnx.eval_shape``)."""
    return nnx.split(nnx.eval_shape(lambda: Llama(model, rngs=nnx.Rngs(0))), nnx.Param, ...)


def grad_step_temp_bytes(cfg: RunConfig) -> int:
    """XLA's temporaries of one forward and backward pass of ``cfg`` (one process's batch).

    Compiles the step for abstract inputs (``memory_analysis().temp_size_in_bytes``): seconds
    for a large model, and no buffer of the model's size is allocated.
    """
    return _temp_bytes(resolve_model(cfg), cfg.batch_size, cfg.seq_len)


@functools.cache  # the dry run and the checks of one process ask for the same shapes
def _temp_bytes(model: LlamaConfig, batch: int, seq_len: int) -> int:
    graphdef, params, rest = abstract_model(model)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    compiled = grad_step(graphdef).lower(params, rest, tokens).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)
