"""Where the update's gradients come from: MLP-Offload's delayed gradient conversion.

MLP-Offload keeps the gradients in the dtype the backward pass produced (bf16) in memory and
converts each subgroup's share to fp32 inside the optimizer's fused kernel, so no fp32 copy is
ever written or read (:class:`InMemoryGradients`). ZeRO-Infinity instead converts them to fp32 and
swaps them out to the tier during the backward pass, then reads each subgroup's back with its
state (:class:`TierGradients`, the baseline). The engine asks a source for one subgroup's
gradient and never tests which one it has.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine.buffers import IOPipeline, touched_buffer
from jax_mlpo.engine.layout import Layout
from jax_mlpo.engine.leaves import Leaves
from jax_mlpo.engine.placement import TierAssignment
from jax_mlpo.engine.step_metrics import StepMetrics
from jax_mlpo.tiers.file import FileTierStore

Future = concurrent.futures.Future


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
