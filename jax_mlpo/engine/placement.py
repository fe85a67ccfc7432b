"""Placement by a bandwidth model: subgroups spread over the tiers in proportion to each
tier's measured bandwidth, so that every path finishes its share of a step together.

Every step of the principle lives here, in the order it runs:

- **the bandwidths** (:func:`tier_bandwidth`): each tier's read and write bandwidth, given, or
  probed at start. The probe moves a few blobs with the tier's own permits and queue depth, all
  in flight at once as the pipeline issues them, from the host cache's own buffers (before the
  cache first uses them, so probing costs no host memory beyond ``host_cache``), and remembers
  the result in the tier directory for the same tier settings, so a restarted run does not probe
  again.
- **the model** (:func:`effective_bandwidth`, :func:`tier_counts`, :func:`interleave`): each
  tier k has an effective bandwidth ``BW_k = 1 / (1/read_k + 1/write_k)``: every uncached
  subgroup is read and written once per step. With ``C_k`` of tier k's subgroups retained in
  host memory across steps, the per-step I/O time of tier k is ``(n_k - C_k) * blob / BW_k``;
  it is minimised (the slowest tier finishes when the others do) by
  ``n_k - C_k = (N - sum C) * BW_k / sum BW``. Counts are rounded by largest remainder and the
  assignment is interleaved so consecutive subgroups hit different tiers.
- **the split** (:func:`retained_per_tier`, :func:`tier_split`): how many subgroups each tier
  holds, given how many of them the host cache retains.
- **where each subgroup lives** (:class:`TierAssignment`), re-planned online: tiers behave
  differently under load (a shared file system, a neighbour on the same disk), so each step's
  busy time per tier is compared with what the model predicted for the bytes it moved. When a
  tier stays more than 25% off for 3 steps, the bandwidths are rescaled by the mean ratio over
  those steps and the subgroups that should move get a new target tier: they migrate on their
  next write-back, which costs no extra I/O.
- **end to end** (:func:`assign_tiers`): the opened tiers measured, split and interleaved.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence

import numpy as np

from jax_mlpo.config import FileTier, OffloadConfig
from jax_mlpo.engine import retention
from jax_mlpo.engine.step_metrics import StepMetrics
from jax_mlpo.tiers.file import FileTierStore

logger = logging.getLogger(__name__)

PROBE_BLOBS = 4
_MAX_PROBE_ELEMS = 8 * 2**20  # 32 MiB per blob: long enough to amortise a request's latency
_OFF = 0.25  # a tier this far off the model in a step counts a strike
_STRIKES = 3  # consecutive strikes before the model is rescaled
_WORTH_MOVING = 0.9  # migrate only if the slowest tier's modelled time drops below this

# ---- the model ------------------------------------------------------------------------------


def effective_bandwidth(read: float, write: float) -> float:
    """Bytes/s of a read followed by a write, as each uncached subgroup needs per step."""
    return 1.0 / (1.0 / read + 1.0 / write)


def largest_remainder(targets: list[float], total: int) -> list[int]:
    """Integers summing to ``total`` nearest to ``targets`` (which sum to ``total``)."""
    floors = [int(np.floor(t)) for t in targets]
    order = np.argsort([-(t - f) for t, f in zip(targets, floors, strict=True)], kind="stable")
    for k in order[: total - sum(floors)]:
        floors[k] += 1
    return floors


def tier_counts(num_subgroups: int, bandwidths: list[float], retained: list[int]) -> list[int]:
    """Subgroups per tier: retained ones plus a bandwidth-proportional share of the rest."""
    rest = num_subgroups - sum(retained)
    total_bw = sum(bandwidths)
    targets = [c + rest * bw / total_bw for c, bw in zip(retained, bandwidths, strict=True)]
    return largest_remainder(targets, num_subgroups)


def interleave(counts: list[int]) -> list[int]:
    """A tier per position, spreading each tier's positions evenly (smooth weighted round robin)."""
    total = sum(counts)
    given = [0] * len(counts)
    out = []
    for i in range(total):
        # the tier furthest behind its proportional share of the first i + 1 positions
        k = max(range(len(counts)), key=lambda k: (counts[k] * (i + 1) / total - given[k], -k))
        given[k] += 1
        out.append(k)
    return out


# ---- the split ------------------------------------------------------------------------------


def retained_per_tier(bandwidths: list[float], retained: int, policy: str) -> list[int]:
    """How many of the ``retained`` subgroups each tier contributes.

    ``"slow_tiers"`` retains the slowest tiers' subgroups first (each retained subgroup saves
    the most I/O time there); ``"equal"`` spreads them evenly, as the MLP-Offload artifact did.
    """
    k = len(bandwidths)
    if policy == "equal":
        return largest_remainder([retained / k] * k, retained)
    counts = [0] * k
    counts[int(np.argmin(bandwidths))] = retained
    return counts


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
        (:func:`effective_bandwidth`).
      retained: the plan's retained count (:attr:`~jax_mlpo.engine.plan.HostPlan.retained`).
      policy: ``OffloadConfig.retain_policy``.
    """
    kept = retained_per_tier(bandwidths, retained, policy)
    return TierSplit(tuple(tier_counts(num_subgroups, bandwidths, kept)), tuple(kept))


# ---- the bandwidths --------------------------------------------------------------------------


def probe_kind(max_state_elems: int) -> dict[str, list[int]]:
    """The ``"probe"`` blobs a store must hold for :func:`tier_bandwidth`."""
    return {"probe": [min(max_state_elems, _MAX_PROBE_ELEMS)] * PROBE_BLOBS}


def probe(
    store: FileTierStore, blob_elems: int, buffers: Sequence[np.ndarray]
) -> tuple[float, float]:
    """Measures a tier's read and write bandwidth (bytes/s) with its own concurrency.

    Writes then reads up to :data:`PROBE_BLOBS` blobs of ``blob_elems`` float32 in the store's
    probe array, all requests in flight at once, as the pipeline issues them.

    Args:
      store: the tier.
      blob_elems: elements per blob.
      buffers: float32 host buffers of at least ``blob_elems`` each, one per blob moved
        (their contents are overwritten).

    Returns:
      ``(read, write)`` in bytes/s.
    """
    bufs = [b[:blob_elems] for b in buffers[:PROBE_BLOBS]]
    nbytes = blob_elems * 4 * len(bufs)
    t0 = time.perf_counter()
    for f in [store.write(i, b, kind="probe") for i, b in enumerate(bufs)]:
        f.result()
    write = nbytes / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for f in [store.read(i, b, kind="probe") for i, b in enumerate(bufs)]:
        f.result()
    read = nbytes / (time.perf_counter() - t0)
    return read, write


def cached_probe(
    store: FileTierStore, blob_elems: int, buffers: Sequence[np.ndarray]
) -> tuple[float, float]:
    """:func:`probe`, remembered in the tier directory for the same tier settings (an object
    tier, which has no directory, is probed every time)."""
    tier = store.tier
    if not isinstance(tier, FileTier):
        return probe(store, blob_elems, buffers)
    limits = tier.limits
    key = json.dumps(
        [
            limits.max_concurrency,
            tier.effective_io_mode,
            tier.sync,
            limits.bandwidth_cap,
            blob_elems,
            min(len(buffers), PROBE_BLOBS),
        ]
    )
    path = os.path.join(store.directory, ".jax_mlpo-probe.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("key") == key:
            return saved["read"], saved["write"]
    except (OSError, ValueError, KeyError):
        pass
    read, write = probe(store, blob_elems, buffers)
    with open(path, "w") as f:
        json.dump({"key": key, "read": read, "write": write}, f)
    logger.info(
        "tier %s: probed read %.0f MB/s, write %.0f MB/s", tier.path, read / 1e6, write / 1e6
    )
    return read, write


def tier_bandwidth(
    store: FileTierStore, max_state_elems: int, buffers: Sequence[np.ndarray]
) -> tuple[float, float]:
    """The tier's ``(read, write)`` bytes/s: its ``bandwidth.read``/``bandwidth.write`` where
    given, the (cached) probe for the rest, through ``buffers`` (see :func:`probe`)."""
    tier = store.tier
    given = tier.bandwidth
    if given.read and given.write:
        return float(given.read), float(given.write)
    (elems,) = set(probe_kind(max_state_elems)["probe"])
    read, write = cached_probe(store, elems, buffers)
    return float(given.read or read), float(given.write or write)


# ---- where each subgroup lives --------------------------------------------------------------


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
        self.tier_of = interleave(list(split.counts))  # where each blob is on disk
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
        return [effective_bandwidth(r, w) for r, w in self.bandwidth]

    def _plan(self) -> list[int]:
        counts = tier_counts(len(self.tier_of), self._effective(), self.retained)
        return interleave(counts)

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


# ---- end to end ------------------------------------------------------------------------------


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
