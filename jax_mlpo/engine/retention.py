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

With ``S`` subgroups and ``B`` buffers the alternating order reads and writes ``S - B``
subgroups per step (:func:`moved_per_step`): every buffer is retained. An update beside the
forward pass cannot reverse (the forward pass needs its first subgroups first), and a fixed
cyclic order evicts each subgroup before its next use, keeping only ``B - m`` for good (``m``
the pipeline's buffers) and moving ``S - B + m``. :func:`cached_first` moves the same ``S - B``
as the alternating order in the forward direction: it keeps the forward order's first ``B - m``
for good and the last ``m`` each update ran, and updates what it kept first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from jax_mlpo.config import OffloadConfig


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

    The alternating order and :func:`cached_first` retain every buffer (``retained =
    buffers``); ``min(buffers, subgroups)`` at most.
    """
    return max(0, subgroups - min(retained, buffers, subgroups))


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
    forward pass gives the order the forward pass needs the subgroups in (:meth:`follow`). From
    then on each update runs :func:`cached_first` of that order and keeps the first subgroups of
    the forward order for good (as many as leave the pipeline's buffers free) and, in the
    pipeline's buffers, the last subgroups it updated: every buffer, as the alternating policy
    keeps. With ``alternating`` (``OffloadConfig.overlap_order="alternate"``) every odd
    update runs the reverse of the forward order instead, and each keeps what the alternating
    policy keeps.

    Args:
      subgroups: how many subgroups the engine has.
      policy: ``OffloadConfig.order``.
      alternating: ``OffloadConfig.overlap_order == "alternate"``.
    """

    def __init__(self, subgroups: int, policy: str, alternating: bool = False) -> None:
        self._subgroups, self._policy = subgroups, policy
        self.forward: list[int] | None = None
        self.alternating = alternating
        # what the last update kept in host memory: the next one starts with them. Only an
        # order: a flush or a restore that dropped them costs their reads, never a wrong result
        self._kept: set[int] = set()

    @property
    def kept(self) -> frozenset[int]:
        """The subgroups the last update kept in host memory (the next one reads the others)."""
        return frozenset(self._kept)

    def follow(self, forward: Sequence[int]) -> None:
        """Runs every update from now on in ``forward`` (a permutation of the subgroups)."""
        if sorted(forward) != list(range(self._subgroups)):
            raise ValueError(f"not an order of the {self._subgroups} subgroups: {list(forward)}")
        self.forward = list(forward)

    def of_step(self, step: int) -> list[int]:
        """The order update ``step`` (0-based) runs in."""
        if self.forward is None:
            return step_order(self._subgroups, step, self._policy)
        if self.alternating:
            return list(self.forward) if step % 2 == 0 else self.forward[::-1]
        return cached_first(self.forward, self._kept)

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
            kept = retain_set(order, tier_of, per_tier)
        else:
            # the forward order's first subgroups for good, then the last ones this update
            # ran in the pipeline's buffers (of each tier, within the policy's count)
            resident = retain_set(self.forward[::-1], tier_of, at_most(per_tier, spare_buffers))
            left = list(per_tier)
            for i in resident:
                left[tier_of[i]] -= 1
            kept = resident | retain_set([i for i in order if i not in resident], tier_of, left)
        self._kept = kept
        return kept


def cached_first(forward: Sequence[int], cached: Collection[int]) -> list[int]:
    """``forward`` with the subgroups in ``cached`` moved to its front (each part in its order).

    Where the alternating order reuses the cache by reversing, an update beside the forward
    pass must follow the forward order, and a fixed cyclic order would evict each subgroup
    before its next use. Updating what the last update kept first, then the rest in the
    forward order, reads and writes what the alternating order does: ``S - B`` subgroups per
    step, none between updates. The first subgroups of the forward order are among those kept,
    so the forward pass's first groups are not delayed; the later ones wait for the kept ones'
    compute (no I/O).
    """
    return [i for i in forward if i in cached] + [i for i in forward if i not in cached]
