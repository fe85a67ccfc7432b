"""The small types every layer shares: the two dtypes of params and state, AdamW's scalars.

They live here, below both the numpy reference (:mod:`jax_mlpo.kernels`) and the native
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
