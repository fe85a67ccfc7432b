"""The host side of the transport between XLA and the engine: staging and output buffers.

Under ``jit`` XLA FFI handlers copy each gradient and param leaf into host buffers the engine
owns (their descriptors tell the handlers where), the engine updates from them, and the update
is copied back out of its output buffers (see :mod:`jax_mlpo.transform`). An eager update
hands the engine numpy views instead and uses only the output buffers.

Memory: the staging copies of params and gradients (4 B/param for bf16) and the fp32 output
(4 B/param) grow with the model. This is the cost the FFI transport that reads XLA's buffers in
place is meant to remove (docs/design.md, "Known costs").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_mlpo import native
from jax_mlpo.layout import Layout
from jax_mlpo.types import F32


def _descriptor(x: np.ndarray) -> np.ndarray:
    return native.host_descriptor(x) if x.size else np.zeros(4, np.uint32)


class HostStaging:
    """Per-leaf host buffers: the update's fp32 outputs and the staged gradients and params.

    Args:
      layout: the params' layout (leaf shapes and dtypes).
    """

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self.outs_shaped = [np.zeros(shape, F32) for shape in layout.shapes]
        self.outs = [out.reshape(-1) for out in self.outs_shaped]  # flat, as the kernel writes
        self.out_descriptors = np.stack(
            [_descriptor(x) for x in self.outs] or [np.zeros(4, np.uint32)]
        )
        self.params = [np.zeros(shape, dt).reshape(-1) for shape, dt in zip(
            layout.shapes, layout.dtypes, strict=True)]  # fmt: skip
        # gradient buffers follow the gradients' dtypes, known only at the first update
        self.grads: list[np.ndarray] = []
        self._descriptors = np.zeros((2 * len(layout.shapes), 4), np.uint32)

    def descriptors(self, grad_dtypes: Sequence[np.dtype]) -> np.ndarray:
        """Descriptors (``uint32[2 * leaves, 4]``) of the host buffers the next update's
        gradients (first) and params are copied into; zero rows for empty leaves."""
        if [g.dtype for g in self.grads] != [np.dtype(d) for d in grad_dtypes]:
            self.grads = [
                np.zeros(shape, dt).reshape(-1)
                for shape, dt in zip(self._layout.shapes, grad_dtypes, strict=True)
            ]
            for k, x in enumerate(self.grads + self.params):
                if x.size:
                    self._descriptors[k] = native.host_descriptor(x)
        return self._descriptors
