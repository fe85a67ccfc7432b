"""How many subgroups each tier holds: the bandwidth model's counts around what is retained."""

from __future__ import annotations

import dataclasses

from jax_mlpo.engine import retention
from jax_mlpo.engine.placement.model import tier_counts


@dataclasses.dataclass(frozen=True)
class TierSplit:
    """How many subgroups each tier holds and how many of those it retains in host memory."""

    counts: tuple[int, ...]
    retained: tuple[int, ...]


def tier_split(
    num_subgroups: int, bandwidths: list[float], retained: int, policy: str
) -> TierSplit:
    """Subgroups per tier for effective ``bandwidths`` (bytes/s, or any common unit).

    Args:
      num_subgroups: subgroups to place.
      bandwidths: each tier's effective bandwidth
        (:func:`~jax_mlpo.engine.placement.model.effective_bandwidth`).
      retained: the plan's retained count (:attr:`~jax_mlpo.engine.plan.HostPlan.retained`).
      policy: ``OffloadConfig.retain_policy``.
    """
    kept = retention.retained_per_tier(bandwidths, retained, policy)
    return TierSplit(tuple(tier_counts(num_subgroups, bandwidths, kept)), tuple(kept))
