"""Placement end to end: each opened tier measured, the subgroups split and interleaved."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine.placement.model import effective_bandwidth
from jax_mlpo.engine.placement.probe import tier_bandwidth
from jax_mlpo.engine.placement.replan import TierAssignment
from jax_mlpo.engine.placement.split import tier_split
from jax_mlpo.tiers.file import FileTierStore


def assign_tiers(
    config: OffloadConfig,
    stores: Sequence[FileTierStore],
    state_elems: Sequence[int],
    retained: int,
    buffers: Sequence[np.ndarray],
) -> TierAssignment:
    """Places every subgroup on a tier.

    Args:
      config: ``placement`` (``"measured"`` probes each tier; otherwise all tiers count
        alike), ``retain_policy`` and ``replan``.
      stores: the opened tiers (holding the probe's blobs when measured).
      state_elems: each subgroup's state elements (float32).
      retained: how many subgroups the host cache retains across steps.
      buffers: the host cache's buffers, which the probe moves its blobs through before the
        cache first uses them (no host memory beyond ``host_cache``).

    Returns:
      Each subgroup's tier, and the model that placed it.
    """
    measured = config.placement == "measured"
    blob_elems = max(state_elems, default=0)
    bandwidth = [
        tier_bandwidth(store, blob_elems, buffers) if measured else (1.0, 1.0) for store in stores
    ]
    effective = [effective_bandwidth(r, w) for r, w in bandwidth]
    split = tier_split(len(state_elems), effective, retained, config.retain_policy)
    return TierAssignment(
        [store.tier.path for store in stores], bandwidth, split, [4 * n for n in state_elems],
        adaptive=config.replan and measured,
    )  # fmt: skip
