"""Where an update's gradients, params and updates are while the engine runs.

On CPU XLA's buffers are host memory: :class:`HostLeaves` hands the kernel views of them, and
the update is written in place (usually over the gradient, which XLA aliased to it). On a GPU
they are device memory: :class:`StagedLeaves` copies each subgroup's gradients and params into
pinned host buffers before its kernel runs and its update back afterwards, so the host holds
one subgroup's staging (:class:`SubgroupStaging`), never a copy of the model. The engine asks
for a subgroup's segments and never tests which one it has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from jax_mlpo.engine.layout import Layout, Segment, Subgroup
from jax_mlpo.native.host_update import DeviceBuffer
from jax_mlpo.tiers.posix import aligned_empty


class Leaves(Protocol):
    """One update's flat gradient, param and update leaves."""

    def check(self, layout: Layout) -> None:
        """Raises ValueError when a leaf's count, size or dtype differs from the layout's."""

    def fetch(self, sg: Subgroup) -> None:
        """Makes the subgroup's gradients and params readable through :meth:`segment`."""

    def segment(self, seg: Segment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The segment's gradient and param (read) and update (written) as host arrays."""

    def store(self, sg: Subgroup) -> None:
        """Sends the subgroup's update (written through :meth:`segment`) to where XLA reads it."""

    def finish(self) -> None:
        """Waits until every update stored has arrived."""


class HostLeaves:
    """XLA's buffers in host memory (CPU), used in place.

    Args:
      grads, params, updates: the flat leaves; ``updates[k]`` may be ``grads[k]``'s memory.
    """

    def __init__(self, grads: Sequence[np.ndarray], params: Sequence[np.ndarray],
                 updates: Sequence[np.ndarray]) -> None:  # fmt: skip
        self.grads, self.params, self.updates = grads, params, updates

    def check(self, layout: Layout) -> None:
        layout.check_leaves(self.grads, self.params, self.updates)

    def fetch(self, sg: Subgroup) -> None:
        pass

    def segment(self, seg: Segment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        span = seg.leaf_span
        return self.grads[seg.leaf][span], self.params[seg.leaf][span], self.updates[seg.leaf][span]

    def store(self, sg: Subgroup) -> None:
        pass

    def finish(self) -> None:
        pass


class Copier(Protocol):
    """Asynchronous copies between host arrays and device addresses, in one stream's order."""

    def to_host(self, dst: np.ndarray, src: int) -> None:
        """Starts copying ``dst.nbytes`` bytes from device address ``src`` into ``dst``."""

    def to_device(self, dst: int, src: np.ndarray) -> None:
        """Starts copying ``src`` to device address ``dst``."""

    def synchronize(self) -> None:
        """Waits for every copy started."""


class SubgroupStaging:
    """Pinned host buffers for one subgroup's gradients, params and update (4 B/element each).

    Args:
      elems: the largest subgroup's element count.
      pin: called on each buffer once (``cuda_host_register``), or None.
      unpin: called on each pinned buffer by :meth:`release` (``cuda_host_unregister``).
    """

    def __init__(self, elems: int, pin: Callable[[np.ndarray], None] | None = None,
                 unpin: Callable[[np.ndarray], None] | None = None) -> None:  # fmt: skip
        self.elems = elems
        self.buffers = [aligned_empty(4 * elems, np.uint8) for _ in range(3)]
        self._unpin = unpin if pin is not None else None
        if pin is not None:
            for buf in self.buffers:
                pin(buf)

    def release(self) -> None:
        """Unpins the buffers (before they are freed). Idempotent."""
        if self._unpin is not None:
            for buf in self.buffers:
                self._unpin(buf)
            self._unpin = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


class StagedLeaves:
    """Leaves in device memory, staged through :class:`SubgroupStaging` a subgroup at a time.

    :meth:`fetch` copies the subgroup's gradient and param segments in (and waits: the stream
    runs the previous subgroup's update copies first, so the staging is free once it returns);
    :meth:`store` starts the update's copies back; :meth:`finish` waits for the last ones.

    Args:
      grads, params, updates: the flat leaves.
      copier: the copies, on XLA's stream.
      staging: the host buffers (at least the largest subgroup).
    """

    def __init__(self, grads: Sequence[DeviceBuffer], params: Sequence[DeviceBuffer],
                 updates: Sequence[DeviceBuffer], copier: Copier,
                 staging: SubgroupStaging) -> None:  # fmt: skip
        self.grads, self.params, self.updates = grads, params, updates
        self._copier, self._staging = copier, staging

    def check(self, layout: Layout) -> None:
        layout.check_leaves(self.grads, self.params, self.updates)
        if layout.max_subgroup_elems > self._staging.elems:
            raise ValueError("the staging buffers are smaller than the largest subgroup")

    def _view(self, which: int, leaves: Sequence[DeviceBuffer], seg: Segment) -> np.ndarray:
        # 4 bytes per element of the subgroup whatever the leaf's dtype, so that segments of
        # leaves of different dtypes never overlap in the buffer
        dtype = leaves[seg.leaf].dtype
        start = 4 * seg.span.start
        stop = start + (seg.span.stop - seg.span.start) * dtype.itemsize
        return self._staging.buffers[which][start:stop].view(dtype)

    def fetch(self, sg: Subgroup) -> None:
        for seg in sg.segments:
            for which, leaves in ((0, self.grads), (1, self.params)):
                leaf = leaves[seg.leaf]
                offset = seg.leaf_span.start * leaf.dtype.itemsize
                self._copier.to_host(self._view(which, leaves, seg), leaf.address + offset)
        self._copier.synchronize()

    def segment(self, seg: Segment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (self._view(0, self.grads, seg), self._view(1, self.params, seg),
                self._view(2, self.updates, seg))  # fmt: skip

    def store(self, sg: Subgroup) -> None:
        for seg in sg.segments:
            leaf = self.updates[seg.leaf]
            offset = seg.leaf_span.start * leaf.dtype.itemsize
            self._copier.to_device(leaf.address + offset, self._view(2, self.updates, seg))

    def finish(self) -> None:
        self._copier.synchronize()
