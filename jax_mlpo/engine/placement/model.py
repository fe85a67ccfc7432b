"""The bandwidth model that places subgroups on tiers.

Each tier k has an effective bandwidth ``BW_k = 1 / (1/read_k + 1/write_k)``: every uncached
subgroup is read and written once per step. With ``C_k`` of tier k's subgroups retained in host
memory across steps, the per-step I/O time of tier k is ``(n_k - C_k) * blob / BW_k``; it is
minimised (the slowest tier finishes when the others do) by
``n_k - C_k = (N - sum C) * BW_k / sum BW``. Counts are rounded by largest remainder and the
assignment is interleaved so consecutive subgroups hit different tiers. The bandwidths come
from :mod:`jax_mlpo.engine.placement.probe`.
"""

from __future__ import annotations

import numpy as np


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
