"""A training loop whose updates run beside the next forward pass, changed in a few lines.

:func:`~jax_mlpo.transforms.overlap.overlapped_step` leaves its caller the gradients each step
leaves pending, a first step that only computes gradients, and a plain update of what is
pending (the flush) before a save, an evaluation and the end. :class:`OverlappedLoop` owns
them, for a plain optax loop, an ``nnx.Optimizer`` and a linen ``TrainState``::

    loop = jax_mlpo.OverlappedLoop(loss_fn, tx, params, opt_state)  # optax
    loop = jax_mlpo.OverlappedLoop.train_state(loss_fn, state)      # linen

    with loop:                     # leaving it, by the end or by an error, flushes
        for batch in batches:
            loss = loop.step(batch)
            if saving:
                mngr.save(..., loop.params, loop.opt_state)  # flushed: the plain loop's

    @jax_mlpo.OverlappedLoop.nnx   # nnx: the plain train step, in place of @nnx.jit
    def train_step(model, optimizer, batch):
        ...                        # optimizer.update(model, grads) as in the plain step
    train_step.flush()             # before a save, an evaluation, the end

What is pending cannot be lost silently: ``params``, ``opt_state`` and ``state`` flush before
they return; an NNX model's params are donated to the step, so reading them while an update is
pending raises (flush first, :mod:`~jax_mlpo.transforms.overlapped_nnx`); leaving the ``with``
flushes; a loop dropped with an update pending reports a :class:`PendingUpdateError`. Every
step is the plain loop's, bit for bit.

With ``overlap="auto"`` (the default) the loop runs the overlapped step only where it wins:
where two groups of the update can each pay for their call
(:func:`~jax_mlpo.transforms.overlap_cost.auto_groups`), a few plain and overlapped steps are
timed once compiled and the faster is kept
(:class:`~jax_mlpo.transforms.overlap_cost.OverlapTrial`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from jax_mlpo.errors import PendingUpdateError
from jax_mlpo.transforms import overlap_cost
from jax_mlpo.transforms.overlap import overlapped_step, read_shardings, tree_sharded_as_read
from jax_mlpo.transforms.overlapped_nnx import FlushOnExit, OverlappedTrainStep, quiet

__all__ = ["OverlappedLoop", "PendingUpdateError"]


class OverlappedLoop(FlushOnExit):
    """A training loop's steps with each update beside the next forward pass (module doc).

    Made with the constructor for a plain optax loop (the loop holds ``params`` and
    ``opt_state``) or :meth:`train_state` for a linen ``TrainState``; :meth:`nnx` overlaps an
    NNX train step (the model and optimizer updated in place).

    Args:
      loss_fn: ``loss_fn(params, *args) -> loss`` (``(loss, aux)`` with ``has_aux``). Random
        keys (dropout) are arguments like the batch.
      tx: the optimizer.
      params: the params.
      opt_state: ``tx.init(params)`` (or a restored state).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; :meth:`step` then returns it too.
      overlap: ``"auto"`` (overlapped where it wins), True (always), False (the plain step).
      groups: how many calls the update is split into (``"auto"``: from its size and a call's
        measured cost, :func:`~jax_mlpo.transforms.overlap_cost.auto_groups`).
    """

    _dropped = (
        "an OverlappedLoop was dropped with an update pending: the params and optimizer state "
        "lack the last step's update. Call loop.flush() (or read loop.params / loop.state) "
        "before the end, or run the loop inside 'with loop:'"
    )

    def __init__(self, loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                 params: Any, opt_state: Any, *, has_aux: bool = False,
                 overlap: bool | str = "auto", groups: int | str = "auto") -> None:  # fmt: skip
        if overlap not in (True, False, "auto"):
            raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
        if groups != "auto" and (not isinstance(groups, int) or groups < 1):
            raise ValueError(f"groups must be a positive int or 'auto', got {groups!r}")
        self.tx, self.has_aux, self.groups = tx, has_aux, groups
        self._params, self._opt_state, self._rest = params, opt_state, None
        self._pending: Any = None
        self._failed: BaseException | None = None
        self._updates = 0  # updates applied, for a TrainState's step
        self._trial = overlap_cost.OverlapTrial()
        if overlap != "auto":
            self._trial.decide(bool(overlap))
        self._loss_fn = loss_fn
        self._programs: dict[str, Any] = {}
        self._shell: Any = None  # a TrainState without params and opt_state
        self._applied = False  # whether the last step applied an update
        self._screened = False  # whether overlap="auto" has asked if two groups can pay

    @staticmethod
    def nnx(step_fn: Callable[..., Any] | None = None, *, overlap: bool | str = "auto",
            groups: int | str = "auto") -> Any:  # fmt: skip
        """The plain NNX train step ``step_fn(model, optimizer, *args)`` (it calls
        ``optimizer.update(model, grads)`` once), overlapped: an
        :class:`~jax_mlpo.transforms.overlapped_nnx.OverlappedTrainStep`, called as the step
        was; its ``flush()`` brings the model and optimizer to the plain loop's state. A
        decorator in place of ``nnx.jit`` (``@jax_mlpo.OverlappedLoop.nnx``, or with
        ``overlap=``/``groups=``)."""
        if step_fn is None:
            return lambda fn: OverlappedTrainStep(fn, overlap=overlap, groups=groups)
        return OverlappedTrainStep(step_fn, overlap=overlap, groups=groups)

    @classmethod
    def train_state(cls, loss_fn: Callable[..., Any], state: Any, *, has_aux: bool = False,
                    overlap: bool | str = "auto",
                    groups: int | str = "auto") -> OverlappedLoop:  # fmt: skip
        """A loop for a linen ``TrainState`` (``state.tx``, ``state.params``,
        ``state.opt_state``, ``state.step``): :attr:`state` is the flushed state."""
        loop = cls(loss_fn, state.tx, state.params, state.opt_state, has_aux=has_aux,
                   overlap=overlap, groups=groups)  # fmt: skip
        loop._shell = state
        return loop

    # -- the state, flushed ---------------------------------------------------------------

    @property
    def params(self) -> Any:
        """The params, flushed: the plain loop's after as many steps."""
        self.flush()
        return self._params

    @property
    def opt_state(self) -> Any:
        """The optimizer state, flushed."""
        self.flush()
        return self._opt_state

    @property
    def state(self) -> Any:
        """The linen ``TrainState``, flushed (its ``step`` counts the updates applied)."""
        if self._shell is None:
            raise TypeError("OverlappedLoop.state is a TrainState loop's; use params and opt_state")
        self.flush()
        return self._shell.replace(step=self._shell.step + self._updates, params=self._params,
                                   opt_state=self._opt_state)  # fmt: skip

    # -- steps ----------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        """:meth:`step`."""
        return self.step(*args)

    def step(self, *args: Any) -> Any:
        """One training step on ``loss_fn(params, *args)``: its loss (``(loss, aux)`` with
        ``has_aux``), at the params of the plain loop's same step."""
        self._check_usable()
        if self._trial.overlap is None and not self._screened:
            # before the trial: an update too small for two groups to each pay for their call
            # cannot run beside anything (no overlapped program is compiled)
            self._screened = True
            sizes = [int(np.size(x)) for x in jax.tree.leaves(self._params)]
            if not overlap_cost.worth_trying(sizes, self._resolve_groups()):
                self._trial.decide(False)
        overlapped = self._trial.next_overlapped()
        if not overlapped and self._pending is not None:  # the trial ended on the plain step
            self.flush()
        timing = self._trial.overlap is None
        t0 = time.perf_counter()
        try:
            if not overlapped:
                value = self._plain(args)
            elif self._pending is None:  # the first step, or the first after a flush
                value, self._pending = self._gradients(args)
            else:
                value = self._overlapped(args)
        except BaseException as e:
            self._after_failure(e)
            raise
        if timing:
            jax.block_until_ready((value, self._params, self._pending))
            self._trial.record(overlapped, time.perf_counter() - t0,
                               applied_update=self._applied)  # fmt: skip
        return value

    def flush(self) -> None:
        """Applies the pending gradients with a plain update (nothing if none are pending):
        the params and state are then the plain loop's, and the next step only computes
        gradients."""
        if self._pending is None:
            return
        self._check_usable()
        try:
            self._apply(self._pending)
        except BaseException as e:
            self._after_failure(e)
            raise
        self._pending = None

    # -- the programs ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise PendingUpdateError(
                "an earlier step of this OverlappedLoop failed inside its program, which had "
                "taken the params and optimizer state: restore them from a checkpoint"
            ) from self._failed

    def _after_failure(self, error: BaseException) -> None:
        """After a step's or flush's error: the loop is unusable if its program had already
        consumed (donated) the params or the state; otherwise nothing was lost."""
        held = jax.tree.leaves((self._params, self._opt_state, self._pending))
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in held):
            self._failed = error

    def _loss(self) -> Callable[..., Any]:
        """``loss(params, rest, *args) -> (loss, (aux, rest))``: the user's loss (``rest``
        passes through: the programs' shape for state beside the params)."""
        loss_fn, has_aux = self._loss_fn, self.has_aux

        def loss(params: Any, rest: Any, *args: Any) -> Any:
            out = loss_fn(params, *args)
            value, aux = out if has_aux else (out, None)
            return value, (aux, rest)

        return loss

    def _program(self, name: str) -> Any:
        found = self._programs.get(name)
        if found is not None:
            return found
        tx, loss = self.tx, self._loss()
        if name == "gradients":
            shardings = read_shardings(self._params)

            def gradients(params, opt_state, rest, *args):
                (value, (aux, rest)), grads = jax.value_and_grad(loss, has_aux=True)(
                    params, rest, *args)  # fmt: skip
                grads = tree_sharded_as_read(grads, shardings)
                return params, opt_state, rest, value, aux, grads

            # the params and the state pass through, donated: an NNX model's and optimizer's
            # arrays then refuse to be read while an update is pending
            found = jax.jit(gradients, donate_argnums=(0, 1))
        elif name == "plain":  # the plain step: the user's, in one program

            def plain(params, opt_state, rest, *args):
                (value, (aux, rest)), grads = jax.value_and_grad(loss, has_aux=True)(
                    params, rest, *args)  # fmt: skip
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, rest, value, aux

            found = jax.jit(plain, donate_argnums=(0, 1))
        elif name == "update":

            def update(params, opt_state, grads):
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            found = jax.jit(update, donate_argnums=(0, 1, 2))
        else:
            groups = self._resolve_groups()

            def step(params, opt_state, pending, rest, *args):
                params, opt_state, grads, (value, (aux, rest)) = overlapped_step(
                    loss, tx, params, opt_state, pending, rest, *args, has_aux=True,
                    groups=groups)  # fmt: skip
                return params, opt_state, grads, rest, value, aux

            found = jax.jit(step, donate_argnums=(0, 1, 2))
        self._programs[name] = found = quiet(found)
        return found

    def _resolve_groups(self) -> int:
        if self.groups != "auto":
            return int(self.groups)
        return overlap_cost.auto_groups(sum(int(np.size(x)) for x in jax.tree.leaves(self._params)))

    def _value(self, value: Any, aux: Any) -> Any:
        return (value, aux) if self.has_aux else value

    def _gradients(self, args: tuple) -> tuple[Any, Any]:
        self._params, self._opt_state, self._rest, value, aux, grads = self._program(
            "gradients")(self._params, self._opt_state, self._rest, *args)  # fmt: skip
        self._applied = False
        return self._value(value, aux), grads

    def _apply(self, grads: Any) -> None:
        self._params, self._opt_state = self._program("update")(self._params, self._opt_state,
                                                                grads)  # fmt: skip
        self._updates += 1
        self._applied = True

    def _plain(self, args: tuple) -> Any:
        self._params, self._opt_state, self._rest, value, aux = self._program("plain")(
            self._params, self._opt_state, self._rest, *args)  # fmt: skip
        self._updates += 1
        self._applied = True
        return self._value(value, aux)

    def _overlapped(self, args: tuple) -> Any:
        step = self._program("overlapped")
        self._params, self._opt_state, self._pending, self._rest, value, aux = step(
            self._params, self._opt_state, self._pending, self._rest, *args)  # fmt: skip
        self._updates += 1
        self._applied = True
        return self._value(value, aux)
