"""Where each subgroup lives, and online re-planning when the tiers stray from the model.

The bandwidth model (:mod:`jax_mlpo.engine.placement`) places subgroups once, from probed or given
bandwidths. Tiers then behave differently under load (a shared file system, a neighbour on the
same disk), so each step's busy time per tier is compared with what the model predicted for the
bytes it moved. When a tier stays more than 25% off for 3 steps, the bandwidths are rescaled by
the mean ratio over those steps and the subgroups that should move get a new target tier: they
migrate on their next write-back, which costs no extra I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jax_mlpo.engine import placement, retention
from jax_mlpo.engine.placement.split import TierSplit
from jax_mlpo.engine.step_metrics import StepMetrics

logger = logging.getLogger(__name__)

_OFF = 0.25  # a tier this far off the model in a step counts a strike
_STRIKES = 3  # consecutive strikes before the model is rescaled
_WORTH_MOVING = 0.9  # migrate only if the slowest tier's modelled time drops below this


class TierAssignment:
    """The tier of every subgroup, the tier it moves to next, and the bandwidths behind both.

    Args:
      paths: each tier's path (the keys of a step's per-tier metrics).
      bandwidth: each tier's ``(read, write)`` bytes/s.
      split: the tier split of the plan (its retained counts stay fixed), kept as ``split``.
      blob_bytes: each subgroup's state bytes.
      adaptive: whether :meth:`observe` re-plans (``replan`` with measured placement).
    """

    def __init__(
        self,
        paths: Sequence[str],
        bandwidth: Sequence[tuple[float, float]],
        split: TierSplit,
        blob_bytes: Sequence[int],
        *,
        adaptive: bool,
    ) -> None:
        self._paths = list(paths)
        self.bandwidth = list(bandwidth)
        self.split = split
        self.retained = list(split.retained)
        self._blob_bytes = list(blob_bytes)
        self._adaptive = adaptive
        self.tier_of = placement.interleave(list(split.counts))  # where each blob is on disk
        self.target = list(self.tier_of)  # where it goes on its next write-back
        self._strikes = [0] * len(paths)
        self._ratio_sum = [0.0] * len(paths)

    def write_tier(self, index: int) -> int:
        """The tier a write-back of subgroup ``index`` goes to; it lives there from now on."""
        self.tier_of[index] = self.target[index]
        return self.tier_of[index]

    def moved(self, index: int, tier: int) -> None:
        """Records that subgroup ``index`` was written to ``tier`` instead (a full tier)."""
        self.tier_of[index] = self.target[index] = tier

    def _effective(self) -> list[float]:
        return [placement.effective_bandwidth(r, w) for r, w in self.bandwidth]

    def _plan(self) -> list[int]:
        counts = placement.tier_counts(len(self.tier_of), self._effective(), self.retained)
        return placement.interleave(counts)

    def observe(self, metrics: StepMetrics) -> None:
        """Counts a step against the model; re-plans after 3 steps more than 25% off.

        Subgroups move only if the new plan cuts the slowest tier's modelled time by more than
        10%: moving costs I/O, and latency-bound tiers (small blobs) would otherwise make the
        plan swing back and forth.
        """
        if not self._adaptive:
            return
        for k, path in enumerate(self._paths):
            read_bw, write_bw = self.bandwidth[k]
            model = metrics.bytes_read[path] / read_bw + metrics.bytes_written[path] / write_bw
            ratio = metrics.tier_busy_s[path] / model if model > 0 else 1.0
            off = abs(ratio - 1.0) > _OFF
            self._strikes[k] = self._strikes[k] + 1 if off else 0
            self._ratio_sum[k] = self._ratio_sum[k] + ratio if off else 0.0
        if max(self._strikes, default=0) < _STRIKES:
            return
        scale = [total / n if n else 1.0 for total, n in zip(self._ratio_sum, self._strikes,
                                                              strict=True)]  # fmt: skip
        self.bandwidth = [(r / q, w / q) for (r, w), q in zip(self.bandwidth, scale, strict=True)]
        self._strikes = [0] * len(self._paths)
        self._ratio_sum = [0.0] * len(self._paths)
        plan = self._plan()
        before, after = self._slowest_tier_time(self.target), self._slowest_tier_time(plan)
        moves = sum(a != b for a, b in zip(plan, self.target, strict=True))
        if moves and after < _WORTH_MOVING * before:
            self.target = plan
        else:
            moves = 0
        logger.log(
            logging.INFO if moves else logging.DEBUG,
            "jax_mlpo: tier I/O time %s the model; bandwidths rescaled, %d subgroup(s) migrate",
            ", ".join(f"{q:.2f}x" for q in scale),
            moves,
        )

    def _slowest_tier_time(self, tier_of: Sequence[int]) -> float:
        """Modelled per-step I/O time of the busiest tier if subgroups lived at ``tier_of``."""
        time_of = [0.0] * len(self._paths)
        retained = retention.retain_set(
            range(len(tier_of)), tier_of, self.retained
        )  # same count either way the order runs
        for i, k in enumerate(tier_of):
            if i not in retained:
                read_bw, write_bw = self.bandwidth[k]
                nbytes = self._blob_bytes[i]
                time_of[k] += nbytes / read_bw + nbytes / write_bw
        return max(time_of, default=0.0)
