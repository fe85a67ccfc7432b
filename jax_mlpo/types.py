"""The small types every layer shares: the two dtypes of params and state, the optimizers'
scalars, a q8 moment's codes and scales.

They live here, below both the numpy references (:mod:`jax_mlpo.optimizers`) and the native
library's wrappers, so that neither imports the other for them.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


class AdamWHyper(NamedTuple):
    """Scalars of one AdamW step, as the device computed them.

    ``bc1``/``bc2`` are optax's bias corrections ``1 - b**count`` and ``lr`` the (scheduled)
    learning rate, all evaluated by XLA in float32 so that they match optax bit for bit.
    """

    bc1: float
    bc2: float
    lr: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_scale: float = 1.0
    nesterov: bool = False
    bc1_next: float = 1.0  # with nesterov: 1 - b1**(count + 1), optax's next bias correction


class LionHyper(NamedTuple):
    """Scalars of one Lion step: ``lr`` the (scheduled) learning rate, evaluated by XLA in
    float32 as optax does; the others as given (Python floats, or float32 arrays from
    ``optax.inject_hyperparams``)."""

    lr: float
    b1: float
    b2: float
    weight_decay: float


class MomentumHyper(NamedTuple):
    """Scalars of Muon's momentum pass: ``bc``/``bc_next`` optax's bias corrections
    ``1 - beta**t`` and ``1 - beta**(t+1)``, evaluated by XLA in float32; ``beta`` as given."""

    beta: float
    bc: float
    bc_next: float
    nesterov: bool


class ApplyHyper(NamedTuple):
    """Scalars of Muon's master pass (bfloat16 params): the (scheduled) learning rate and the
    weight decay."""

    lr: float
    weight_decay: float


# elements per scale of a q8 moment (kernels.h's kQ8Block)
BLOCK = 256


class Quantized(NamedTuple):
    """A q8 moment (or a segment of one): codes and the scales of their blocks."""

    codes: np.ndarray  # uint8, one per element
    scales: np.ndarray  # float32, one per BLOCK elements, from codes[0]

    @property
    def size(self) -> int:
        return self.codes.size


def num_blocks(n: int) -> int:
    """Scales of a q8 run of ``n`` elements."""
    return -(-n // BLOCK)
