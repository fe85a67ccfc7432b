"""Update order and retention across steps (MLP-Offload principle d).

The order alternates ascending / descending every step. At the end of a step the last ``c_k``
subgroups of each tier k (in that step's order) are not written back but kept in host memory;
the next step, running the other way, starts with exactly those: no write and no read for them.
"""

from __future__ import annotations

from collections.abc import Sequence


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
