"""The training step, plain or overlapped, and what XLA says its forward and backward pass needs.

:func:`grad_step` is the forward and backward pass, one jitted function per model graph.
:class:`PlainSteps` runs it, then the update (:func:`make_steps`); :class:`OverlappedSteps`
runs each update beside the next step's forward pass (``jax_mlpo.overlapped_step``), carrying
the gradients from one step to the next: the same params, bit for bit.
:func:`grad_step_temp_bytes` compiles it for the config's shapes without allocating anything
(``jax.ShapeDtypeStruct`` params from ``nnx.eval_shape``) and returns XLA's own figure for its
temporaries (activations kept for the backward pass, the backward pass's intermediates, the
fp32 logits and their gradient). The memory plan counts that figure, not an estimate. Because
both go through the same function object, the training loop's first call finds the program
already compiled.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_mlpo
from experiments.job.run_config import RunConfig, resolve_model
from jax_mlpo.transforms import overlap_cost
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


class PlainSteps:
    """Forward and backward, then the update: two jitted programs, timed apart."""

    overlapped = False

    def __init__(self, graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> None:
        self._grad_step, self._update_step = make_steps(graphdef, tx)

    def run(self, params: nnx.State, rest: nnx.State, opt_state: Any,
            tokens: jax.Array) -> tuple[Any, Any, jax.Array, dict[str, float], int]:  # fmt: skip
        """One training step.

        Returns:
          ``(params, opt_state, loss, timings, updates)``: ``updates`` is how many optimizer
          updates ran in this step (always 1 here).
        """
        t0 = time.perf_counter()
        loss, grads = jax.block_until_ready(self._grad_step(params, rest, tokens))
        t1 = time.perf_counter()
        params, opt_state = jax.block_until_ready(self._update_step(grads, opt_state, params))
        t2 = time.perf_counter()
        return params, opt_state, loss, {"step_s": t2 - t0, "fwd_bwd_s": t1 - t0,
                                         "update_s": t2 - t1}, 1  # fmt: skip

    def flush(self, params: nnx.State, opt_state: Any) -> tuple[Any, Any, float]:
        """Nothing is pending after a plain step: ``(params, opt_state, 0.0)``."""
        return params, opt_state, 0.0


class OverlappedSteps:
    """Each update beside the next step's forward pass, in one jitted program.

    A step applies the gradients the last step left pending, then runs its own forward and
    backward pass on the updated params, whose gradients it leaves pending. The first step (and
    the first after a :meth:`flush`) has nothing to apply: it is the forward and backward pass
    alone. :meth:`flush` applies what is pending (before a checkpoint and at the end), so that
    the params and the optimizer state are the plain loop's at that step.

    One program hides how long its forward and backward pass alone would take: the run's first
    step, before it computes its own gradients, times the forward and backward pass alone, a
    median of ``REFERENCE_ROUNDS`` after one that compiles it (their results discarded), and
    every overlapped step from the second (the first compiles the program) reports it as
    ``fwd_bwd_s`` and the rest of its time as ``update_exposed_s``, the part of the update the
    forward pass did not hide. Timed there, no gradients are carried: beside the carried
    gradients the reference would hold a second copy of them (the whole run's peak of
    memory, docs/beyond-ram.md).

    Args:
      graphdef: the model's graph (``nnx.split``).
      tx: the optimizer.
      groups: how many host calls an offloaded update is split into.
    """

    REFERENCE_ROUNDS = 3
    overlapped = True

    def __init__(self, graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                 groups: int | str) -> None:  # fmt: skip
        self._grad_step, self._update_step = make_steps(graphdef, tx)
        self._pending: Any = None
        self._overlapped = 0  # steps that applied an update
        self._fwd_bwd_s: float | None = None

        def loss_of(params: nnx.State, rest: nnx.State, tokens: jax.Array) -> jax.Array:
            return loss_fn(nnx.merge(graphdef, params, rest), tokens)

        def step(params, rest, opt_state, pending, tokens):
            return jax_mlpo.overlapped_step(
                loss_of, tx, params, opt_state, pending, rest, tokens, groups=groups
            )

        # the params, the state and the pending gradients are donated: the update is written
        # over the pending gradients, and the next ones take their buffers
        self._step = jax.jit(step, donate_argnums=(0, 2, 3))

    def run(self, params: nnx.State, rest: nnx.State, opt_state: Any,
            tokens: jax.Array) -> tuple[Any, Any, jax.Array, dict[str, float], int]:  # fmt: skip
        """One training step (:meth:`PlainSteps.run`'s results); no update runs in a step with
        nothing pending."""
        if self._pending is None:
            if self._fwd_bwd_s is None:
                self._fwd_bwd_s = self._time_fwd_bwd(params, rest, tokens)
            t0 = time.perf_counter()
            loss, self._pending = jax.block_until_ready(self._grad_step(params, rest, tokens))
            t = time.perf_counter() - t0
            return params, opt_state, loss, {"step_s": t, "fwd_bwd_s": t}, 0
        self._overlapped += 1
        t0 = time.perf_counter()
        params, opt_state, self._pending, loss = jax.block_until_ready(
            self._step(params, rest, opt_state, self._pending, tokens)
        )
        timings = {"step_s": time.perf_counter() - t0}
        if self._overlapped >= 2:
            timings["fwd_bwd_s"] = self._fwd_bwd_s
            timings["update_exposed_s"] = max(0.0, timings["step_s"] - self._fwd_bwd_s)
        return params, opt_state, loss, timings, 1

    @property
    def pending(self) -> bool:
        """Whether a step's gradients wait for the next step (or a flush)."""
        return self._pending is not None

    def _time_fwd_bwd(self, params: nnx.State, rest: nnx.State, tokens: jax.Array) -> float:
        jax.block_until_ready(self._grad_step(params, rest, tokens))  # compiles it
        times = []
        for _ in range(self.REFERENCE_ROUNDS):
            t0 = time.perf_counter()
            jax.block_until_ready(self._grad_step(params, rest, tokens))
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def flush(self, params: nnx.State, opt_state: Any) -> tuple[Any, Any, float]:
        """Applies the pending gradients, if any.

        Returns:
          ``(params, opt_state, seconds)``.
        """
        if self._pending is None:
            return params, opt_state, 0.0
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        params, opt_state = jax.block_until_ready(self._update_step(pending, opt_state, params))
        return params, opt_state, time.perf_counter() - t0


# The overlapped program compiles the forward and backward pass and the update together, with
# the grouping: 2.5 s on the tiny config where the forward and backward pass alone compile in
# 1.6 s ("Intel(R) Xeon(R) Processor", 2026-12-07). Its compile time is taken as this many times
# the forward and backward pass's, plus the update's first step.
OVERLAP_COMPILE_FACTOR = 2.0


def trial_repays(steps_left: int, update_s: list[float], compile_s: float) -> tuple[bool, str]:
    """Whether the update time an overlapped step could hide over a run's steps left exceeds
    what compiling it costs.

    Args:
      steps_left: the run's steps from its first (``update_s`` counts those taken).
      update_s: the plain steps' update times so far, the first (which compiled) included.
      compile_s: the forward and backward pass's compile time.

    Returns:
      ``(repays, reason)``: the reason says why not ("" where it repays).
    """
    if len(update_s) < 2:
        return True, ""
    left = steps_left - len(update_s)
    timed = sorted(update_s[1:])
    hideable = left * timed[len(timed) // 2]
    cost = OVERLAP_COMPILE_FACTOR * compile_s + update_s[0]
    if hideable >= cost:
        return True, ""
    return False, (f"the update it could hide over the {left} steps left, {hideable:.2f} s, "
                   f"does not repay compiling the overlapped step, ~{cost:.2f} s")  # fmt: skip


class AutoSteps:
    """``overlap: auto``: the overlapped step only where it wins, the same params either way.

    An update too small for two groups to each pay for their host call
    (:func:`jax_mlpo.transforms.overlap_cost.auto_groups`) cannot run beside anything: the plain
    step, without compiling the overlapped one. Otherwise the run's first steps time both once
    compiled (:class:`jax_mlpo.transforms.overlap_cost.OverlapTrial`: two plain steps after the
    first, then two overlapped ones after the one that compiles) and keep the faster, unless
    the run is too short to repay the trial: the overlapped step can at best hide the update,
    so when the plain steps' update time over the steps left is less than what compiling the
    overlapped program costs (:data:`OVERLAP_COMPILE_FACTOR` times the forward and backward
    pass's compile time, plus the update's first step), the plain step is kept untried.

    Args:
      graphdef: the model's graph (``nnx.split``).
      tx: the optimizer.
      groups: how many host calls an overlapped update is split into (or ``"auto"``).
      params: the model's params (their sizes).
      steps_left: the steps this run will take (None: unknown, always try).
      compile_s: the forward and backward pass's compile time (:func:`grad_step_compile_s`).
    """

    def __init__(self, graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                 groups: int | str, params: nnx.State, *, steps_left: int | None = None,
                 compile_s: float = 0.0) -> None:  # fmt: skip
        sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
        if groups == "auto":
            groups = overlap_cost.auto_groups(sum(sizes))
        self.groups = groups
        self._plain = PlainSteps(graphdef, tx)
        self._trial = overlap_cost.OverlapTrial()
        self._over: OverlappedSteps | None = None
        self._steps_left, self._compile_s = steps_left, compile_s
        self._update_s: list[float] = []  # the plain steps' update times, the first included
        self.reason = ""
        if overlap_cost.worth_trying(sizes, groups):
            self._over = OverlappedSteps(graphdef, tx, groups)
        else:
            self._trial.decide(False)
            self.reason = f"an update of {sum(sizes)} elements is one host call"

    @property
    def overlapped(self) -> bool | None:
        """Whether the run keeps the overlapped step (None: still timing both)."""
        return self._trial.overlap

    def _repays(self) -> bool:
        """Whether trying the overlapped step can repay its compile (:func:`trial_repays`)."""
        if self._steps_left is None:
            return True
        ok, self.reason = trial_repays(self._steps_left, self._update_s, self._compile_s)
        return ok

    def run(self, params: nnx.State, rest: nnx.State, opt_state: Any,
            tokens: jax.Array) -> tuple[Any, Any, jax.Array, dict[str, float], int]:  # fmt: skip
        """One training step (:meth:`PlainSteps.run`'s results)."""
        over = self._trial.next_overlapped()
        first = over and self._trial.overlap is None and not self._trial.times[True]
        if first and not self._repays():  # before its first run compiles the overlapped step
            self._trial.decide(False)
            over = False
        flush_s = 0.0
        if not over and self._over is not None and self._over.pending:  # the plain step won
            params, opt_state, flush_s = self._over.flush(params, opt_state)
        steps = self._over if over else self._plain
        params, opt_state, loss, timings, updated = steps.run(params, rest, opt_state, tokens)
        self._trial.record(over, timings["step_s"], applied_update=updated > 0)
        if not over and self._trial.overlap is None:
            self._update_s.append(timings["update_s"])
        if flush_s:
            timings["step_s"] += flush_s
            timings["flush_s"] = flush_s
            updated += 1
        return params, opt_state, loss, timings, updated

    def flush(self, params: nnx.State, opt_state: Any) -> tuple[Any, Any, float]:
        """:meth:`OverlappedSteps.flush` (nothing pending after a plain step)."""
        if self._over is None:
            return params, opt_state, 0.0
        return self._over.flush(params, opt_state)


def make_step_runner(cfg: RunConfig, graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                     params: nnx.State, steps_left: int | None = None,
                     ) -> PlainSteps | OverlappedSteps | AutoSteps:  # fmt: skip
    """The steps the config's ``overlap`` asks for (``steps_left``: the run's, for ``auto``)."""
    if cfg.overlap == "auto":
        compile_s = grad_step_compile_s(cfg) if steps_left is not None else 0.0
        return AutoSteps(graphdef, tx, cfg.overlap_groups, params, steps_left=steps_left,
                         compile_s=compile_s)  # fmt: skip
    if cfg.overlap:
        return OverlappedSteps(graphdef, tx, cfg.overlap_groups)
    return PlainSteps(graphdef, tx)


def abstract_model(model: LlamaConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, params, rest)`` of the model as ``jax.ShapeDtypeStruct`` leaves: nothing is
    allocated (``nnx.eval_shape``)."""
    return nnx.split(nnx.eval_shape(lambda: Llama(model, rngs=nnx.Rngs(0))), nnx.Param, ...)


def grad_step_temp_bytes(cfg: RunConfig) -> int:
    """XLA's temporaries of one forward and backward pass of ``cfg`` (one process's batch).

    Compiles the step for abstract inputs (``memory_analysis().temp_size_in_bytes``): seconds
    for a large model, and no buffer of the model's size is allocated.
    """
    return _compiled(resolve_model(cfg), cfg.batch_size, cfg.seq_len)[0]


def grad_step_compile_s(cfg: RunConfig) -> float:
    """Seconds to trace and compile one forward and backward pass of ``cfg`` (the same compile
    as :func:`grad_step_temp_bytes`, done once)."""
    return _compiled(resolve_model(cfg), cfg.batch_size, cfg.seq_len)[1]


@functools.cache  # the dry run and the checks of one process ask for the same shapes
def _compiled(model: LlamaConfig, batch: int, seq_len: int) -> tuple[int, float]:
    graphdef, params, rest = abstract_model(model)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    t0 = time.perf_counter()
    compiled = grad_step(graphdef).lower(params, rest, tokens).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes), time.perf_counter() - t0
