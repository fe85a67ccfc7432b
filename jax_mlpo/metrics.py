"""Per-step measurements of the update pipeline."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepMetrics:
    """Where one update's time went and what it moved.

    Attributes:
      step: the optimizer step this update produced (1 for the first update).
      total_s: wall time of the host update.
      read_wait_s: time the update loop waited for subgroup reads (not hidden by compute).
      compute_s: time in the AdamW kernel.
      write_wait_s: time the loop waited for write-backs (buffer reuse and the final drain).
      grad_write_s: time spent writing fp32 gradients to the tiers before the update (only
        without delayed conversion, the baseline; ZeRO-Infinity does it during backward).
      cache_hits: subgroups that were resident in host memory (no read, no write).
      subgroups: subgroups updated.
      bytes_read: bytes read per tier path.
      bytes_written: bytes written per tier path.
      tier_busy_s: wall time each tier had at least one request in flight.
    """

    step: int
    total_s: float = 0.0
    read_wait_s: float = 0.0
    compute_s: float = 0.0
    write_wait_s: float = 0.0
    grad_write_s: float = 0.0
    cache_hits: int = 0
    subgroups: int = 0
    bytes_read: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_written: dict[str, int] = dataclasses.field(default_factory=dict)
    tier_busy_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
