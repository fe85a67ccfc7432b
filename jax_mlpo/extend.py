"""Adding an offloaded optimizer.

An offloaded optimizer is, like an optax one, a little math and a state; jax_mlpo supplies the
state (the fp32 master of bfloat16 params and the moments, in subgroups on the tiers) and the
transport. An optimizer gives three things:

1. its host math, an object with ``name``, ``moment_names`` (the moments it keeps, each the
   params' size), ``scalar_names`` (what the device computes for each step, by name),
   ``hyper(scalars)`` and ``update(...)`` over one resident subgroup
   (:class:`~jax_mlpo.optimizers.HostOptimizer`). :class:`ElementwiseOptimizer` writes
   ``update`` for an elementwise rule given as a function of one segment: in ``jax.numpy``
   (:class:`JaxElementwiseOptimizer`, compiled into one pass over the state and run near
   memory speed) or in NumPy (:class:`ElementwiseOptimizer`, a prototype's speed);
2. the device's part of a step, ``device_scalars(count_inc, hyperparams, lr, grads)``: a dict of
   the scalars ``scalar_names`` names (optax's own expressions, evaluated under jit);
3. :func:`offloaded_transformation`, which makes the optax ``GradientTransformationExtraArgs``.

docs/extending.md adds Lion this way: in jax.numpy, in NumPy and with a native kernel.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine.layout import Subgroup, check_moment_dtypes
from jax_mlpo.engine.leaves import Leaves
from jax_mlpo.native import num_threads
from jax_mlpo.optimizers import HostOptimizer, segment_calls, write_update
from jax_mlpo.optimizers.jax_rule import RuleRunner, check_float
from jax_mlpo.transforms.elementwise import check_offload, check_scalars, check_update_dtype
from jax_mlpo.transforms.offloaded import DeviceScalars, offloaded
from jax_mlpo.transforms.opt_state import OffloadedState
from jax_mlpo.types import F32

__all__ = [
    "ElementwiseOptimizer",
    "JaxElementwiseOptimizer",
    "HostOptimizer",
    "OffloadedState",
    "offloaded_transformation",
    "segment_calls",
    "write_update",
]


class ElementwiseOptimizer:
    """An optimizer whose rule is elementwise, given by :meth:`step` in NumPy.

    Subclass it, set the three names and write :meth:`step`. The engine calls it once per
    segment of a resident subgroup (a part of one leaf), with float32 arrays; the update it
    returns goes where optax's would (for bfloat16 params the fp32 master is advanced and the
    update is ``bfloat16(master_new) - params``, as :func:`jax_mlpo.adamw` does). NumPy runs on
    one core with a temporary per expression: a prototype's speed, several times slower than a
    fused kernel. Override :meth:`update` to call a kernel of your own.

    Attributes:
      name: the optimizer's name, for messages and the profiler's trace.
      moment_names: the moments, each an array of the params' size (float32 unless
        ``offloaded_transformation``'s ``moment_dtypes`` says otherwise).
      scalar_names: the scalars ``device_scalars`` computes for each step.
    """

    name: ClassVar[str]
    moment_names: ClassVar[tuple[str, ...]]
    scalar_names: ClassVar[tuple[str, ...]] = ("lr",)

    def hyper(self, scalars: Mapping[str, float]) -> Any:
        """The step's scalars and hyper-parameters by name, as :meth:`step` takes them."""
        return dict(scalars)

    def step(
        self, moments: tuple[np.ndarray, ...], grad: np.ndarray, param: np.ndarray,
        hyper: Any, *, decay: bool,
    ) -> np.ndarray:  # fmt: skip
        """One step of one segment.

        Args:
          moments: the segment's moments, in ``moment_names``' order and their storage dtypes,
            advanced in place.
          grad: its gradient (float32; the gradients' dtype is converted here, never stored).
          param: its float32 params (the fp32 master of bfloat16 ones); read only.
          hyper: what :meth:`hyper` returned for the step.
          decay: whether weight decay applies to this segment (the ``mask``).

        Returns:
          The float32 update optax's optimizer would return for this segment.
        """
        raise NotImplementedError(f"{type(self).__name__} must define step()")

    def update(
        self, sg: Subgroup, blob: np.ndarray, leaves: Leaves, grad_blob: np.ndarray | None,
        hyper: Any, *, count: int,
    ) -> None:  # fmt: skip
        """:meth:`HostOptimizer.update` through :meth:`step`, segment by segment."""
        calls = segment_calls(sg, blob, leaves, grad_blob, init_master=count == 0)
        for seg, moments, grad, param, out, base in calls:
            # a copy: the update may be written over the gradient's memory
            u = self.step(moments, grad.astype(F32), param, hyper, decay=seg.decay)
            write_update(np.asarray(u, F32), param, out, base is not None, base, None)


class JaxElementwiseOptimizer(ElementwiseOptimizer):
    """An optimizer whose elementwise rule is written in ``jax.numpy``, run at memory speed.

    Subclass it, set the three names and write :meth:`step` with ``jax.numpy``: the arguments
    are :class:`ElementwiseOptimizer`'s, and it returns the new moments with the update
    instead of advancing the moments in place. The rule is traced once per variant and run
    as a tile program (:mod:`jax_mlpo.optimizers.rule_program`): one pass over each segment
    of a resident subgroup, on ``native.num_threads()`` threads. A rule with an operation a
    tile program lacks (a reduction, an integer, a function it does not know) is compiled by
    XLA instead and run in chunks, several times slower, with a warning naming the operation
    (:mod:`jax_mlpo.optimizers.jax_rule`). The hyper-parameters reach it as float32 scalars,
    so a schedule or ``inject_hyperparams`` compiles nothing new.

    Attributes:
      tile_program: False runs the rule through XLA always (its own approximations of exp,
        log and tanh, for one).
    """

    tile_program: ClassVar[bool] = True
    _runner: RuleRunner | None = None

    def step(
        self, moments: tuple[jax.Array, ...], grad: jax.Array, param: jax.Array,
        hyper: Any, *, decay: bool,
    ) -> tuple[tuple[jax.Array, ...], jax.Array]:  # fmt: skip
        """One step of one segment, in ``jax.numpy`` (traced once per chunk shape).

        Args:
          moments: the segment's moments, in ``moment_names``' order and storage dtypes.
          grad: its float32 gradient.
          param: its float32 params (the fp32 master of bfloat16 ones).
          hyper: what :meth:`hyper` returned for the step, each value a float32 scalar.
          decay: whether weight decay applies to this segment (the ``mask``).

        Returns:
          ``(moments, update)``: the new moments (stored in their dtypes) and the float32
          update optax's optimizer would return.
        """
        raise NotImplementedError(f"{type(self).__name__} must define step()")

    def update(
        self, sg: Subgroup, blob: np.ndarray, leaves: Leaves, grad_blob: np.ndarray | None,
        hyper: Any, *, count: int,
    ) -> None:  # fmt: skip
        """:meth:`HostOptimizer.update` through the compiled :meth:`step`."""
        if self._runner is None:
            self._runner = RuleRunner(self.step, self.name, num_threads(),
                                      tile=self.tile_program)  # fmt: skip
        calls = segment_calls(sg, blob, leaves, grad_blob, init_master=count == 0)
        self._runner.run(list(calls), hyper)


def offloaded_transformation(
    optimizer: HostOptimizer,
    *,
    learning_rate: optax.ScalarOrSchedule,
    offload: OffloadConfig,
    hyperparams: Mapping[str, float | jax.Array] | None = None,
    device_scalars: DeviceScalars | None = None,
    mask: Any = None,
    moment_dtypes: Sequence[Any] | None = None,
    update_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """An optax transformation whose state ``optimizer`` keeps off the accelerator.

    It works wherever :func:`jax_mlpo.adamw` does: under ``jax.jit``, in ``nnx.Optimizer`` or a
    linen ``TrainState``, in ``optax.chain`` and ``inject_hyperparams``, in checkpoints, with
    :class:`jax_mlpo.MultiSteps`, on meshes.

    Args:
      optimizer: the host math (:class:`~jax_mlpo.optimizers.HostOptimizer`), for example an
        :class:`ElementwiseOptimizer`.
      learning_rate: a float or an optax schedule (evaluated on the device at the count).
      offload: where the state lives.
      hyperparams: the other hyper-parameters by name: Python floats (kept in double
        precision) or scalar arrays (``inject_hyperparams`` passes them with every update).
        The host reads them by these names.
      device_scalars: ``(count_inc, hyperparams, lr, grads) -> {name: scalar}`` for each of
        ``optimizer.scalar_names``, evaluated on the device; None: ``{"lr": lr}``.
      mask: where weight decay applies (a pytree of bools or a callable), resolved at init.
      moment_dtypes: each moment's storage dtype (float32 or bfloat16); None: float32.
      update_dtype: None (the params' dtype) or ``jnp.float32``, for bfloat16 params.

    Returns:
      The ``GradientTransformationExtraArgs``; its ``update`` requires ``params``.

    Raises:
      ValueError: a scalar named twice, more scalars than the host update carries, a
        hyper-parameter that is not a scalar, a moment dtype or ``update_dtype`` not supported.
      ConfigError: a tier path that is missing or not writable.
    """
    check_offload(offload)
    hyperparams = dict(hyperparams or {})
    check_scalars(hyperparams)
    check_update_dtype(update_dtype)
    names = tuple(optimizer.moment_names)
    dtypes = [jnp.float32] * len(names) if moment_dtypes is None else list(moment_dtypes)
    moments = check_moment_dtypes(dtypes, names)
    if isinstance(optimizer, JaxElementwiseOptimizer):
        check_float(moments, optimizer.name)
    elif isinstance(optimizer, ElementwiseOptimizer) and (
        type(optimizer).update is ElementwiseOptimizer.update
    ):
        warnings.warn(
            f"jax_mlpo.extend: {optimizer.name}'s update runs in NumPy, a segment at a time, "
            "several times slower than a fused kernel; write the rule in jax.numpy "
            "(extend.JaxElementwiseOptimizer) for memory speed",
            stacklevel=2,
        )
    scalars: Callable[..., dict[str, Any]] = device_scalars or (lambda c, hp, lr, g: {"lr": lr})
    return offloaded(
        optimizer.name, optimizer, learning_rate=learning_rate, hyperparams=hyperparams,
        device_scalars=scalars, moment_dtypes=moments, mask=mask, offload=offload,
        update_dtype=update_dtype,
    )  # fmt: skip
