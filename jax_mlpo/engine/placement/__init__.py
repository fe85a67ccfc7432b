"""Placement by a bandwidth model: subgroups spread over the tiers in proportion to each
tier's measured bandwidth, so that every path finishes its share of a step together.

Every step of the principle lives here, in the order it runs:

- :mod:`.probe`: each tier's read and write bandwidth, given or measured at start;
- :mod:`.model`: the bandwidth model (effective bandwidth, proportional counts, interleaving);
- :mod:`.split`: how many subgroups each tier holds, given what the host cache retains;
- :mod:`.replan`: where each subgroup lives now and next, re-planned online when the tiers
  stray from the model.
"""

from jax_mlpo.engine.placement.model import (
    effective_bandwidth,
    interleave,
    largest_remainder,
    tier_counts,
)

__all__ = ["effective_bandwidth", "interleave", "largest_remainder", "tier_counts"]
