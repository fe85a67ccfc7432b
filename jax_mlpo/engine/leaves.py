"""An update's leaves: where its gradients, params and updates are while the engine runs, and
where each subgroup's fp32 gradient comes from (MLP-Offload's delayed gradient conversion).

On CPU XLA's buffers are host memory: :class:`HostLeaves` hands the kernel views of them, and
the update is written in place (usually over the gradient, which XLA aliased to it). On a GPU
they are device memory: :class:`StagedLeaves` copies each subgroup's gradients and params into
pinned host buffers before its kernel runs and its update back afterwards, so the host holds
one subgroup's staging (:class:`SubgroupStaging`), never a copy of the model. The engine asks
for a subgroup's segments and never tests which one it has; :func:`segment_calls` gives an
optimizer each segment's arrays for its kernel.

Delayed gradient conversion: MLP-Offload keeps the gradients in the dtype the backward pass
produced (bf16) in memory and converts each subgroup's share to fp32 inside the optimizer's
fused kernel, so no fp32 copy is ever written or read (:class:`InMemoryGradients`).
ZeRO-Infinity instead converts them to fp32 and swaps them out to the tier during the backward
pass, then reads each subgroup's back with its state (:class:`TierGradients`, the baseline). The
engine asks a source for one subgroup's gradient and never tests which one it has.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine.buffers import IOPipeline, touched_buffer
from jax_mlpo.engine.layout import Layout, Moment, Segment, Subgroup
from jax_mlpo.engine.placement import TierAssignment
from jax_mlpo.engine.step_metrics import StepMetrics
from jax_mlpo.native.host_update import DeviceBuffer
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.tiers.posix import aligned_empty
from jax_mlpo.types import F32

Future = concurrent.futures.Future

# ---- where the leaves are ---------------------------------------------------------------------


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


def segment_calls(
    sg: Subgroup, blob: np.ndarray, leaves: Leaves, grad_blob: np.ndarray | None,
    *, init_master: bool,
) -> Iterator[tuple[Segment, tuple[Moment, ...], np.ndarray, np.ndarray, Any, Any]]:  # fmt: skip
    """What each segment's kernel call takes, for any optimizer.

    Yields:
      ``(segment, moments, grad, param, out, delta_base)``: the segment's moment views, its
      gradients (``grad_blob``'s where given), the float32 params the kernel reads (the fp32
      master of a bfloat16 leaf, set from the params on the first step), where the update
      goes, and for a bfloat16 leaf the params the update is a difference to (the kernel then
      updates the master in place), else None.
    """
    p, *moments = sg.split(blob)
    for seg in sg.segments:
        grad, param, out = leaves.segment(seg)
        if grad_blob is not None:
            grad = grad_blob[seg.span]
        views = tuple(sg.segment(x, seg) for x in moments)
        if seg.master:
            if init_master:
                p[seg.span] = param.astype(F32)
            yield seg, views, grad, p[seg.span], out, param
        else:
            yield seg, views, grad, param, out, None


# ---- where the gradients come from: delayed conversion --------------------------------------


class GradientSource(Protocol):
    """The gradients of one update, per subgroup."""

    #: whether a written-back subgroup may be updated again from its clean buffer (its
    #: gradients then come from memory, not from the tier)
    reuse_clean: bool
    #: host memory of its own buffers
    host_bytes: int

    def tier_kinds(self) -> dict[str, list[int]]:
        """Blob kinds the tiers must hold for it (slot length per subgroup)."""

    def bind(self, pipeline: IOPipeline, stores: Sequence[FileTierStore],
             assignment: TierAssignment) -> None:  # fmt: skip
        """Connects it to the engine's I/O pipeline and tiers (tiered engines only)."""

    def before_update(self, order: Sequence[int], leaves: Leaves,
                      metrics: StepMetrics) -> None:  # fmt: skip
        """Runs before the first subgroup of an update."""

    def reads(self, index: int, slot: int) -> list[Future]:
        """Reads that go with subgroup ``index``'s state into ``slot``."""

    def subgroup(self, slot: int, size: int, hit: bool) -> np.ndarray | None:
        """The subgroup's fp32 gradient blob, or None: the kernel converts from the leaves."""


class InMemoryGradients:
    """Delayed conversion: the kernel reads the bf16 (or fp32) gradient leaves in place."""

    reuse_clean = True
    host_bytes = 0

    def tier_kinds(self) -> dict[str, list[int]]:
        return {}

    def bind(self, pipeline, stores, assignment) -> None:
        pass

    def before_update(self, order, leaves, metrics) -> None:
        pass

    def reads(self, index: int, slot: int) -> list[Future]:
        return []

    def subgroup(self, slot: int, size: int, hit: bool) -> np.ndarray | None:
        return None


class TierGradients:
    """The baseline: fp32 gradients written to the tier before the update and read back.

    Each cache slot has a gradient buffer beside it; the read of a subgroup's state brings its
    gradient blob into that buffer. A subgroup resident in host memory takes its gradient from
    the leaves (its gradient blob was never written: ZeRO-Infinity does not swap the gradients
    of resident subgroups either).

    Args:
      layout: the subgroups.
      slots: the cache's slot count.
    """

    reuse_clean = False

    def __init__(self, layout: Layout, slots: int) -> None:
        self._layout = layout
        self._max = max(sg.size for sg in layout.subgroups)
        self._buffers = [touched_buffer(self._max) for _ in range(slots)]
        self.host_bytes = sum(b.nbytes for b in self._buffers)

    def tier_kinds(self) -> dict[str, list[int]]:
        return {"grad": [sg.size for sg in self._layout.subgroups]}

    def bind(self, pipeline, stores, assignment) -> None:
        self._io, self._stores, self._assignment = pipeline, stores, assignment

    def before_update(self, order, leaves, metrics) -> None:
        """Writes each non-resident subgroup's fp32 gradients to its tier, a slot's buffer at a
        time, and waits for them all (DeepSpeed's swap-out, timed as ``grad_write_s``)."""
        t_start = time.monotonic()
        free = collections.deque(self._buffers)
        pending: collections.deque = collections.deque()
        for i in order:
            if i in self._io.cache.dirty:
                continue
            if not free:
                future, buf, j = pending.popleft()
                self._io.wait(future, j)
                free.append(buf)
            sg = self._layout.subgroups[i]
            full = free.popleft()
            buf = full[: sg.size]
            t0 = time.monotonic()
            leaves.fetch(sg)
            for seg in sg.segments:
                buf[seg.span] = leaves.segment(seg)[0]
            metrics.compute_s += time.monotonic() - t0
            store = self._stores[self._assignment.tier_of[i]]
            pending.append((store.write(i, buf, kind="grad"), full, i))
        t0 = time.monotonic()
        for future, _, j in pending:
            self._io.wait(future, j)
        metrics.write_wait_s += time.monotonic() - t0
        metrics.grad_write_s = time.monotonic() - t_start

    def reads(self, index: int, slot: int) -> list[Future]:
        store = self._stores[self._assignment.tier_of[index]]
        size = self._layout.subgroups[index].size
        return [store.read(index, self._buffers[slot][:size], kind="grad")]

    def subgroup(self, slot: int, size: int, hit: bool) -> np.ndarray | None:
        return None if hit else self._buffers[slot][:size]


def gradient_source(config: OffloadConfig, layout: Layout, slots: int) -> GradientSource:
    """The source ``config.delayed_conversion`` asks for, for a tiered engine of ``slots``.

    A state held wholly in host memory has no tier to write gradients to: use
    :class:`InMemoryGradients` there whatever the config says.
    """
    if config.delayed_conversion:
        return InMemoryGradients()
    return TierGradients(layout, slots)
