"""The step's scalars by name: what the device computes for an update and the host reads.

Each update evaluates a few float32 scalars on the device (the learning rate at the count,
bias corrections, the clipping scale: optax's own expressions, so they match optax bit for
bit) and hands them to the host update with the hyper-parameters that arrive as arrays
(``optax.inject_hyperparams``), in one ``float32[NUM_SCALARS]`` vector. :class:`ScalarNames`
is that vector's layout, fixed and checked when the transformation is made: the names the
optimizer computes, then the hyper-parameters it was given. The device builds the vector by
name (:meth:`ScalarNames.vector`) and the host reads it back by name (:meth:`ScalarNames.read`),
so no optimizer keeps a positional order of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlpo.native.host_update import NUM_SCALARS

__all__ = ["ScalarNames", "concrete"]


def concrete(value: Any) -> float:
    """``value`` as a Python float; NaN for a traced one (an update then always passes it)."""
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        return math.nan


@dataclasses.dataclass(frozen=True)
class ScalarNames:
    """The layout of an update's scalar vector.

    Attributes:
      computed: the scalars the device computes for every step, in the vector's order.
      given: the hyper-parameters, after them. Each is passed when it is an array (it may
        change from step to step) and NaN otherwise, when the host uses ``defaults``.
      defaults: each given hyper-parameter's value at construction, as a Python float (kept in
        double precision, as optax uses it); NaN where it was an array.
    """

    computed: tuple[str, ...]
    given: tuple[str, ...] = ()
    defaults: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        names = (*self.computed, *self.given)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"the scalars {repeated} are named twice: a hyper-parameter may not share a name "
                "with a scalar the device computes"
            )
        if len(names) > NUM_SCALARS:
            raise ValueError(
                f"{len(names)} scalars {list(names)}: the host update carries at most "
                f"{NUM_SCALARS} (computed ones and hyper-parameters together)"
            )
        if len(self.defaults) != len(self.given):
            raise ValueError(f"{len(self.given)} hyper-parameters with {len(self.defaults)} values")

    @classmethod
    def of(cls, computed: Sequence[str], hyperparams: Mapping[str, Any]) -> ScalarNames:
        """The layout for an optimizer's computed scalars and the hyper-parameters as given
        (floats or scalar arrays)."""
        return cls(tuple(computed), tuple(hyperparams), tuple(map(concrete, hyperparams.values())))

    def vector(self, computed: Mapping[str, Any], arrays: Mapping[str, Any]) -> jax.Array:
        """The vector, on the device (traced).

        Args:
          computed: a value for each of :attr:`computed`.
          arrays: the hyper-parameters given as arrays this step; the others are NaN.

        Raises:
          ValueError: ``computed`` does not name exactly :attr:`computed`.
        """
        if set(computed) != set(self.computed):
            raise ValueError(
                f"the device computed the scalars {sorted(computed)}, but the optimizer reads "
                f"{sorted(self.computed)}"
            )
        nan = jnp.float32(jnp.nan)
        values = [computed[n] for n in self.computed] + [arrays.get(n, nan) for n in self.given]
        values += [nan] * (NUM_SCALARS - len(values))
        return jnp.stack([jnp.asarray(x, jnp.float32) for x in values])

    def read(self, vector: np.ndarray) -> dict[str, float]:
        """The scalars by name, on the host: a given hyper-parameter's default where the vector
        holds NaN for it."""
        values = [float(x) for x in vector[: len(self.computed) + len(self.given)]]
        out = dict(zip(self.computed, values, strict=False))
        for name, value, own in zip(
            self.given, values[len(self.computed) :], self.defaults, strict=True
        ):
            out[name] = own if math.isnan(value) else value
        return out
