"""What the engine needs of an optimizer: its per-subgroup math behind one interface.

The engine declares it; :mod:`jax_mlpo.optimizers` holds the built-in ones and
:mod:`jax_mlpo.extend` adds one from outside.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from jax_mlpo.engine.layout import Subgroup
from jax_mlpo.engine.leaves import Leaves

__all__ = ["HostOptimizer"]


class HostOptimizer(Protocol):
    """What the engine needs of an optimizer."""

    name: str  # "adamw", "lion": the profiler's name of its kernel pass (jax_mlpo.<name>)
    moment_names: tuple[str, ...]  # the moments in the blob's order: ("mu", "nu"), ("mu",)
    scalar_names: tuple[str, ...]  # what the device computes for each step: ("lr", ...)

    def hyper(self, scalars: Mapping[str, float]) -> Any:
        """The step's scalars as the update takes them, from the computed ones and the
        hyper-parameters, by name (:meth:`jax_mlpo.engine.scalars.ScalarNames.read`)."""

    def update(
        self, sg: Subgroup, blob: np.ndarray, leaves: Leaves, grad_blob: np.ndarray | None,
        hyper: Any, *, count: int,
    ) -> None:  # fmt: skip
        """One step of a resident subgroup: its moments (and fp32 master) in ``blob`` advanced
        in place, its update written to ``leaves`` (fetched for this subgroup).

        Args:
          sg: the subgroup.
          blob: its state, ``[p | moments...]``.
          leaves: the update's gradients, params and updates.
          grad_blob: the subgroup's fp32 gradients (the baseline's tier path), or None: the
            gradients are then read from ``leaves`` and converted inside the kernel.
          hyper: the step's scalars (:meth:`hyper`); weight decay applies where the layout's
            mask is set.
          count: the optimizer's step count (0 for the first: the fp32 master starts as the
            bfloat16 params' value).
        """
