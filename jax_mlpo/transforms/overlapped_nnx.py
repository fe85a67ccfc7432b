"""An NNX train step, as written for ``nnx.jit``, with each update beside the next forward pass.

:func:`jax_mlpo.OverlappedLoop.nnx` takes the plain step (``step(model, optimizer, *args)``,
which calls ``optimizer.update(model, grads)`` once) and returns an :class:`OverlappedTrainStep`
called as the step was. The plain step is the program: its forward and backward pass, its
``nnx.Rngs``, its metrics. Overlapped, the step runs with an optimizer stand-in that takes the
gradients (and ``update``'s keyword arguments) instead of applying them; the next call applies
them with ``optimizer.tx`` in groups of layers, each group's update added where the step's
program first combines those params with an activation
(:func:`~jax_mlpo.transforms.overlap.loss_at_first_use`), so the forward pass of the first
layers runs while the host still updates the last ones. The update and ``apply_updates`` are
``nnx.Optimizer.update``'s, so every step is the plain loop's, bit for bit.

While an update is pending, the model's params and the optimizer's state hold the arrays the
step consumed (donated): reading them raises; :meth:`OverlappedTrainStep.flush` applies the
pending update and gives them back.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.extend import core as jex_core

from jax_mlpo.errors import PendingUpdateError
from jax_mlpo.transforms import overlap_cost
from jax_mlpo.transforms.overlap import (
    Grouping,
    _apply_update,
    default_split,
    leaf_groups,
    loss_at_first_use,
    negative_zero,
    read_shardings,
    tree_sharded_as_read,
    update_in_groups,
)

__all__ = ["OverlappedTrainStep", "activation_ranks"]


def activation_ranks(jaxpr: jex_core.Jaxpr, n: int) -> list[int]:
    """The equation at which each of the first ``n`` inputs (the params) first meets a value
    not computed from params alone (an activation, the batch): the order the forward pass needs
    them in. Work on params alone (a cast, a transpose) does not count: the program does it
    when an activation needs the result (as :func:`loss_at_first_use` applies the updates)."""
    derived: dict[Any, frozenset[int]] = {v: frozenset([k]) for k, v in enumerate(jaxpr.invars[:n])}
    first = [len(jaxpr.eqns)] * n
    for e, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        from_params = [derived[v] for v in ins if v in derived]
        if not from_params:
            continue
        touched = frozenset().union(*from_params)
        if len(from_params) < len(ins):  # met an activation here
            for k in touched:
                first[k] = min(first[k], e)
        else:
            for v in eqn.outvars:
                derived[v] = touched
    return first


class _UpdateTaker:
    """The optimizer the overlapped step's program sees: ``update(model, grads, **kwargs)``
    keeps the gradients (as ``nnx.Optimizer.update`` reads them) instead of applying them."""

    def __init__(self, optimizer: Any) -> None:
        self.wrt, self.tx = optimizer.wrt, optimizer.tx
        self._graph = getattr(optimizer, "graph", None)
        self.taken: list[tuple[Any, Any]] = []

    def update(self, model: Any, grads: Any, **kwargs: Any) -> None:
        from flax import nnx

        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self._graph))
        self.taken.append((grad_arrays, nnx.as_pure(kwargs)))

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"an overlapped NNX train step may use only optimizer.update(model, grads) (it read "
            f"optimizer.{name}); read the optimizer outside the step"
        )


def quiet(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without JAX's warning that donated buffers were not usable: jax_mlpo's update
    writes into the donated gradients in place, which XLA does not see as a use."""

    def call(*args: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return fn(*args)

    return call


class FlushOnExit:
    """What owns a pending update: ``with`` flushes it at the block's end (an error in the
    body included: what the caller keeps is then the plain loop's state at the last step that
    ran), and dropping the owner with it still pending reports :class:`PendingUpdateError`."""

    _pending: Any = None
    _failed: BaseException | None = None
    _dropped = "was dropped with an update pending"  # the report's subject and fix

    _trial: Any = None  # overlap_cost's trial of the plain and the overlapped step

    def flush(self) -> None:
        raise NotImplementedError

    @property
    def pending(self) -> bool:
        """Whether gradients wait to be applied (a flush would run an update)."""
        return self._pending is not None

    @property
    def overlapped(self) -> bool | None:
        """Whether the steps run overlapped (None: still timing both)."""
        return self._trial.overlap

    def __enter__(self) -> Any:
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if self._failed is None:
            self.flush()

    def __del__(self) -> None:
        if getattr(self, "_pending", None) is not None and self._failed is None:
            raise PendingUpdateError(self._dropped)


class OverlappedTrainStep(FlushOnExit):
    """``step(model, optimizer, *args)``, the plain NNX step, with each update beside the next
    forward pass (module doc); made by :meth:`jax_mlpo.OverlappedLoop.nnx`.

    Args:
      step_fn: the plain train step: ``step_fn(model, optimizer, *args)`` calls
        ``optimizer.update(model, grads)`` once (keyword arguments are passed on to ``tx``)
        and returns anything (the loss, metrics).
      overlap: ``"auto"`` (overlapped where it wins), True, False (``nnx.jit(step_fn)``).
      groups: how many calls the update is split into (``"auto"``: from its size).
    """

    _dropped = (
        "an overlapped NNX train step was dropped with an update pending: the model and "
        "optimizer lack the last step's update. Call train_step.flush() before the end, or run "
        "the loop inside 'with train_step:'"
    )

    def __init__(self, step_fn: Callable[..., Any], *, overlap: bool | str = "auto",
                 groups: int | str = "auto") -> None:  # fmt: skip
        if overlap not in (True, False, "auto"):
            raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
        if groups != "auto" and (not isinstance(groups, int) or groups < 1):
            raise ValueError(f"groups must be a positive int or 'auto', got {groups!r}")
        self._fn, self._groups = step_fn, groups
        self._plain = nnx_jit(step_fn)
        self._trial = overlap_cost.OverlapTrial()
        if overlap != "auto":
            self._trial.decide(bool(overlap))
        self._screened = False
        self._bound: tuple[Any, Any] | None = None  # (model, optimizer) of the first call
        self._graphdef: Any = None
        self._read_shardings: list[Any] = []  # the params' (overlap.read_shardings)
        self._programs: dict[str, Any] = {}
        # while an update is pending: the params, state and other model state the next
        # program takes, the pending (gradients, kwargs), the updates applied since the split
        self._held: tuple[Any, Any, Any] | None = None
        self._pending: Any = None
        self._updates = 0
        self._failed: BaseException | None = None

    def __call__(self, model: Any, optimizer: Any, *args: Any) -> Any:
        self._bind(model, optimizer)
        if self._failed is not None:
            raise _failed_error(self._failed)
        if self._trial.overlap is None and not self._screened:
            self._screened = True
            sizes = [int(np.size(x)) for x in jax.tree.leaves(nnx_state(model, optimizer.wrt))]
            if not overlap_cost.worth_trying(sizes, self._resolve_groups(sizes)):
                self._trial.decide(False)  # too small for two groups to pay: never compiled
        overlapped = self._trial.next_overlapped()
        timing = self._trial.overlap is None
        if not overlapped:
            self.flush()
            t0 = time.perf_counter()
            out = self._plain(model, optimizer, *args)
            if timing:
                jax.block_until_ready(out)
                self._trial.record(False, time.perf_counter() - t0)
            return out
        t0 = time.perf_counter()
        applied = self._pending is not None
        try:
            out = self._run_overlapped(model, optimizer, args)
        except BaseException as e:
            held = jax.tree.leaves((self._held, self._pending))
            if any(isinstance(x, jax.Array) and x.is_deleted() for x in held):
                self._failed = e
            raise
        if timing:
            jax.block_until_ready((out, self._held, self._pending))
            self._trial.record(True, time.perf_counter() - t0, applied_update=applied)
        return out

    def flush(self) -> None:
        """Applies the pending update (``nnx.Optimizer.update``'s), and gives the model and
        the optimizer their arrays back: the plain loop's state at this step."""
        if self._pending is None:
            return
        if self._failed is not None:
            raise _failed_error(self._failed)
        model, optimizer = self._bound
        params, opt_state, rest = self._held
        grads, kwargs = self._pending
        params, opt_state = self._program("update", optimizer)(params, opt_state, grads, kwargs)
        self._pending, self._held = None, None
        self._updates += 1
        self._give_back(model, optimizer, params, opt_state, rest)

    # -- internals -------------------------------------------------------------------------

    def _bind(self, model: Any, optimizer: Any) -> None:
        if self._bound is None:
            self._bound = (model, optimizer)
        elif model is not self._bound[0] or optimizer is not self._bound[1]:
            raise PendingUpdateError(
                "an overlapped NNX train step was called with another model or optimizer than "
                "its first call's; make one per model (jax_mlpo.OverlappedLoop.nnx(step))"
            )

    def _resolve_groups(self, sizes: list[int]) -> int:
        if self._groups != "auto":
            return int(self._groups)
        return overlap_cost.auto_groups(sum(sizes))

    def _run_overlapped(self, model: Any, optimizer: Any, args: tuple) -> Any:
        from flax import nnx

        if self._pending is None:  # the first step, or the first after a flush: gradients only
            graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)
            self._graphdef = graphdef
            params = nnx.as_pure(params)
            opt_state = nnx.as_pure(optimizer.opt_state)
            self._updates = 0
            self._read_shardings = read_shardings(params)
            out, params, opt_state, rest, pending = self._program("gradients", optimizer)(
                params, opt_state, rest, *args)  # fmt: skip
        else:
            params, opt_state, rest = self._held
            out, params, opt_state, rest, pending = self._program("overlapped", optimizer)(
                params, opt_state, self._pending, rest, *args)  # fmt: skip
            self._updates += 1
        self._held, self._pending = (params, opt_state, rest), pending
        nnx.update(model, rest)  # its Rngs advance; its params wait for the flush
        return out

    def _give_back(self, model: Any, optimizer: Any, params: Any, opt_state: Any,
                   rest: Any) -> None:  # fmt: skip
        from flax import nnx

        nnx.update(model, params, rest)
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
        optimizer.step[...] += self._updates
        self._updates = 0

    def _traced(self, optimizer: Any) -> Callable[..., Any]:
        """``traced(params, rest, *args) -> (out, (grads, kwargs), rest)``: the user's step on
        the model merged from ``params`` and ``rest``, its update taken, not applied."""
        from flax import nnx

        step_fn, graphdef = self._fn, self._graphdef

        def traced(params: Any, rest: Any, *args: Any) -> Any:
            # a copy: the Variables of the trace that made them would refuse the Rngs' update
            model = nnx.merge(graphdef, params, rest, copy=True)
            taker = _UpdateTaker(optimizer)
            out = step_fn(model, taker, *args)
            if len(taker.taken) != 1:
                raise ValueError(
                    f"an overlapped NNX train step must call optimizer.update(model, grads) "
                    f"once; it called it {len(taker.taken)} times"
                )
            return out, taker.taken[0], nnx.state(model, nnx.Not(taker.wrt))

        return traced

    def _program(self, name: str, optimizer: Any) -> Any:
        found = self._programs.get(name)
        if found is not None:
            return found
        tx = optimizer.tx
        if name == "update":  # nnx.Optimizer.update's update, on the held arrays

            def update(params, opt_state, grads, kwargs):
                updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
                return optax.apply_updates(params, updates), opt_state

            found = jax.jit(update, donate_argnums=(0, 1, 2))
        elif name == "gradients":
            traced = self._traced(optimizer)

            def gradients(params, opt_state, rest, *args):
                out, (grads, kwargs), rest = traced(params, rest, *args)
                grads = tree_sharded_as_read(grads, self._read_shardings)
                return out, params, opt_state, rest, (grads, kwargs)

            # the params and the state pass through, donated: the model's and the
            # optimizer's arrays refuse a read until the flush gives them back
            found = jax.jit(gradients, donate_argnums=(0, 1))
        else:
            traced = self._traced(optimizer)

            def overlapped(params, opt_state, pending, rest, *args):
                leaves, treedef = jax.tree.flatten(params)
                sizes = [int(np.size(x)) for x in leaves]
                closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(params, rest, *args)
                ranks = activation_ranks(closed.jaxpr, len(leaves))
                group = leaf_groups(ranks, sizes, self._resolve_groups(sizes))
                grouping = Grouping.of(leaves, group, default_split())
                grads, kwargs = pending
                updates, opt_state = update_in_groups(tx, grouping, grads, opt_state, params,
                                                      **kwargs)  # fmt: skip
                others = jax.tree.leaves((rest, args))  # the jaxpr's inputs after the params
                outs, new = loss_at_first_use(closed, leaves, treedef.flatten_up_to(updates),
                                              others, _apply_update)  # fmt: skip
                out, (grads, kwargs), rest = jax.tree.unflatten(jax.tree.structure(out_shape),
                                                                outs)  # fmt: skip
                # the values the grouped calls read and wrote besides their leaves live until
                # the gradients (-0.0 changes no bit)
                zero = negative_zero(*grouping.held)
                grads = jax.tree.map(lambda g: g + zero.astype(g.dtype), grads)
                grads = tree_sharded_as_read(grads, [grouping.read_as.get(id(p)) for p in leaves])
                return out, jax.tree.unflatten(treedef, new), opt_state, rest, (grads, kwargs)

            found = jax.jit(overlapped, donate_argnums=(0, 1, 2))
        self._programs[name] = found = quiet(found)
        return found


def _failed_error(cause: BaseException) -> BaseException:

    error = PendingUpdateError(
        "an earlier step failed inside its program, which had taken the model's params and the "
        "optimizer's state: restore them from a checkpoint"
    )
    error.__cause__ = cause
    return error


def nnx_jit(fn: Callable[..., Any]) -> Any:
    from flax import nnx

    return nnx.jit(fn)


def nnx_state(model: Any, wrt: Any) -> Any:
    from flax import nnx

    return nnx.state(model, wrt)
