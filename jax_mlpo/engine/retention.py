"""Update order and retention across steps (MLP-Offload's cache-friendly ordering).

The order alternates ascending / descending every step. At the end of a step the last ``c_k``
subgroups of each tier k (in that step's order) are not written back but kept in host memory;
the next step, running the other way, starts with exactly those: no write and no read for them.
This module decides how many subgroups are retained (:func:`retained_count`), in which order a
step runs (:func:`step_order`) and which subgroups it keeps (:func:`retain_set`; how many of
each tier is the placement's, :func:`jax_mlpo.engine.placement.retained_per_tier`), and
:class:`UpdateOrder` holds the order an engine's updates run in: the configured one, or the
forward pass's once an update beside the forward pass (:mod:`jax_mlpo.transforms.overlap`) gave
it.

What each order moves per step, with ``S`` subgroups, ``B`` buffers and a pipeline of ``m``
(:func:`moved_per_step`): the alternating order reads and writes ``S - B`` subgroups (every
buffer is retained, and each retained subgroup sits in host memory only from near the end of one
step to near the start of the next). A fixed order cannot do as well: a subgroup it does not read
must stay in host memory for a whole cycle, from its update to its next one, so every subgroup
retained holds a buffer all the time, and those the pipeline streams need buffers of their own
while they are read, updated and written. The forward order therefore retains ``B - m`` and
moves ``S - B + m`` each way; at least ``S - B + 1`` whatever its pipeline. It reads the same
``S - B`` inside the update (the other ``m`` are read ahead and written behind between updates,
while the backward pass runs), so the extra bytes cost no time while they fit in that window;
where they do not (:func:`alternate_beside_forward`), :class:`UpdateOrder` runs every other
update in the reverse of the forward order: the alternating order's bytes, with the update
beside the forward pass on every other step.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_mlpo.config import OffloadConfig

logger = logging.getLogger(__name__)


def retained_count(config: OffloadConfig, *, buffers: int, minimum: int, subgroups: int) -> int:
    """How many subgroups stay in host memory across steps.

    Args:
      config: the offload configuration (``retain``, ``order``).
      buffers: the host cache's buffers.
      minimum: the buffers the pipeline needs.
      subgroups: subgroups of the state.
    """
    if not config.retain:
        return 0
    if config.order == "alternate":
        # Every buffer: the next step starts with the subgroups this one ends with, so each
        # buffer's subgroup is updated again before any read needs the buffer, and writing it
        # back at the end of this step would only write it twice (20% fewer bytes written per
        # step than keeping only the buffers beyond the pipeline, in the same time on one
        # disk: docs/design.md, "One buffer pool, used as a cache").
        return min(buffers, subgroups)
    # the next step starts elsewhere: the pipeline's buffers must be free then
    return max(0, min(buffers - minimum, subgroups))


def step_order(num_subgroups: int, step: int, policy: str) -> list[int]:
    """Subgroup indices in the order step ``step`` (0-based) updates them."""
    ascending = policy == "ascending" or step % 2 == 0
    return list(range(num_subgroups)) if ascending else list(range(num_subgroups - 1, -1, -1))


def retain_set(order: Sequence[int], tier_of: Sequence[int], per_tier: Sequence[int]) -> set[int]:
    """The subgroups to keep in host memory at the end of a step in ``order``.

    Args:
      order: this step's order.
      tier_of: the tier of each subgroup.
      per_tier: how many to keep per tier.
    """
    left = list(per_tier)
    keep: set[int] = set()
    for i in reversed(order):
        if left[tier_of[i]] > 0:
            left[tier_of[i]] -= 1
            keep.add(i)
    return keep


def moved_per_step(subgroups: int, buffers: int, retained: int) -> int:
    """Subgroups a step reads (and writes) from the tiers in the steady state, when it starts with
    ``retained`` subgroups kept from the last step and no clean copies: ``subgroups - retained``.

    The alternating order retains every buffer (``retained = buffers``), the forward order
    ``buffers - minimum`` (module doc); ``min(buffers, subgroups)`` at most.
    """
    return max(0, subgroups - min(retained, buffers, subgroups))


def alternate_beside_forward(window_s: float, extra_io_s: float, beside_s: float) -> bool:
    """Whether updates beside the forward pass should alternate their direction.

    The forward order moves the subgroups that it retains fewer of than the alternating order
    between updates (written behind, read ahead): ``extra_io_s`` of tier time. What does not fit
    in the ``window_s`` between two updates (the backward pass) delays the next update; the
    alternating order moves none of it but runs only every other update beside the forward pass,
    losing half of the forward time the overlap hides, at most ``beside_s``. Alternate where the
    delay is the larger.

    Args:
      window_s: the time from an update's end to the next one's start (measured).
      extra_io_s: the tier time of the forward order's extra reads and writes (measured rate).
      beside_s: the update's time after its first group was handed back: the forward pass ran
        beside it (at most all of it).
    """
    return extra_io_s - window_s > beside_s / 2


def at_most(per_tier: Sequence[int], total: int) -> list[int]:
    """``per_tier`` counts lowered, last tiers first, until they add up to at most ``total``."""
    counts = list(per_tier)
    excess = sum(counts) - max(0, total)
    for k in reversed(range(len(counts))):
        cut = min(counts[k], max(0, excess))
        counts[k] -= cut
        excess -= cut
    return counts


class UpdateOrder:
    """The order an engine's updates run in, and what each keeps in host memory for the next.

    The configured policy (:func:`step_order`, :func:`retain_set`) until an update beside the
    forward pass gives the order the forward pass needs the subgroups in: from then on every
    update, and the reads issued ahead of it, follow that order, and each keeps the *first*
    subgroups of it (the next update needs those first: Belady's choice across steps), as many
    as leave the pipeline's buffers free to stream the rest through. With ``alternating`` set
    (:func:`alternate_beside_forward`; only under the alternating policy) every odd update runs
    the reverse of that order instead, and each keeps what the alternating policy keeps.

    Args:
      subgroups: how many subgroups the engine has.
      policy: ``OffloadConfig.order``.
    """

    def __init__(self, subgroups: int, policy: str) -> None:
        self._subgroups, self._policy = subgroups, policy
        self.forward: list[int] | None = None
        self.alternating = False
        self.measured = True  # ``alternating`` follows :meth:`measure`
        self._end: tuple[float, bool] | None = None  # the last update's end, in forward order?
        # after each update in the forward order: the window until the next one, the tier time
        # of the forward order's extra I/O, the update's beside_s
        self._seen: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=5)

    def pin(self, alternating: bool) -> None:
        """Sets ``alternating`` for good, whatever the engine measures (tests, benchmarks)."""
        self.alternating, self.measured = alternating, False

    @property
    def may_alternate(self) -> bool:
        """Whether the configured policy alternates (then the forward order may too)."""
        return self._policy == "alternate"

    def runs_forward(self, step: int) -> bool:
        """Whether update ``step`` runs in the forward pass's order (beside the forward pass)."""
        return self.forward is not None and not (self.alternating and step % 2 == 1)

    def follow(self, forward: Sequence[int]) -> None:
        """Runs every update from now on in ``forward`` (a permutation of the subgroups)."""
        if sorted(forward) != list(range(self._subgroups)):
            raise ValueError(f"not an order of the {self._subgroups} subgroups: {list(forward)}")
        self.forward = list(forward)

    def ended(self, step: int, now: float) -> None:
        """Notes that update ``step`` ended at ``now`` (``time.monotonic()``): the window to the
        next update starts."""
        self._end = (now, self.runs_forward(step))

    def measure(self, now: float, last: Any, per_tier: Sequence[int], spare_buffers: int,
                blob_bytes: float) -> None:  # fmt: skip
        """Sets ``alternating`` (:func:`alternate_beside_forward`) from the windows after the
        last updates in the forward order, as the next update starts at ``now``.

        Args:
          last: the last update's :class:`~jax_mlpo.engine.step_metrics.StepMetrics`, its
            window closed (its tiers' bytes and busy time until now).
          per_tier: how many the alternating policy keeps of each tier.
          spare_buffers: the host buffers beyond those the pipeline needs.
          blob_bytes: the bytes of one subgroup's state.
        """
        moved = sum(last.bytes_read.values()) + sum(last.bytes_written.values())
        busy = max(last.tier_busy_s.values(), default=0.0)
        if not (self.measured and self.may_alternate and self._end and self._end[1]):
            return
        if moved <= 0 or busy <= 0:
            return
        extra = sum(per_tier) - sum(at_most(per_tier, spare_buffers))
        extra_s = 2 * extra * blob_bytes * busy / moved  # at the tiers' measured rate
        self._seen.append((now - self._end[0], extra_s, last.beside_s))
        window, extra_s, beside = (float(np.median(x)) for x in zip(*self._seen, strict=True))
        alternating = alternate_beside_forward(window, extra_s, beside)
        if alternating != self.alternating:
            logger.info(
                "jax_mlpo: updates beside the forward pass %s: the forward order's extra I/O "
                "takes %.3f s, the window between updates %.3f s, the update beside the forward "
                "pass %.3f s", "alternate their direction" if alternating
                else "run in the forward order", extra_s, window, beside,
            )  # fmt: skip
        self.alternating = alternating

    def of_step(self, step: int) -> list[int]:
        """The order update ``step`` (0-based) runs in."""
        if self.forward is None:
            return step_order(self._subgroups, step, self._policy)
        return list(self.forward) if self.runs_forward(step) else self.forward[::-1]

    def keep(self, order: Sequence[int], tier_of: Sequence[int], per_tier: Sequence[int],
             spare_buffers: int) -> set[int]:  # fmt: skip
        """The subgroups an update in ``order`` keeps in host memory.

        Args:
          order: the update's order.
          tier_of: each subgroup's tier.
          per_tier: how many the configured policy keeps of each tier.
          spare_buffers: the host buffers beyond those the pipeline needs.
        """
        if self.forward is None or self.alternating:
            return retain_set(order, tier_of, per_tier)
        return retain_set(order[::-1], tier_of, at_most(per_tier, spare_buffers))
