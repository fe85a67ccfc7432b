"""Per-step measurements of the update pipeline: :class:`StepMetrics` of one engine's update
(with the tier I/O between updates that it takes in, counted by
:class:`~jax_mlpo.engine.idle_io.TierIOWindow`), the steps of several engines of one optimizer
combined (:func:`combine`).

In a data-parallel run (:mod:`jax_mlpo.sharding.processes`) every process has its own engine and its
own :class:`StepMetrics`, its tiers in ``proc<k>`` directories (:func:`shared_tier_path` gives
the tier as configured); :meth:`StepMetrics.as_flat` gives every process the same keys, for a
job to gather them across processes (the pre-training job's ``experiments/job/metrics.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass
class StepMetrics:
    """Where one update's time went and what it moved.

    Attributes:
      step: the optimizer step this update produced (1 for the first update).
      total_s: wall time of the host update.
      read_wait_s: time the update loop waited for subgroup reads (not hidden by compute).
      compute_s: time in the optimizer's kernel.
      write_wait_s: time the loop waited for write-backs (buffer reuse and the final drain).
      grad_write_s: time spent writing fp32 gradients to the tiers before the update (only
        without delayed conversion, the baseline; ZeRO-Infinity does it during backward).
      cache_hits: subgroups that were resident in host memory (no read, no write).
      reads_ahead: subgroups whose reads were issued before the update started, during the
        forward and backward pass (``OffloadConfig.read_ahead``).
      subgroups: subgroups updated.
      bytes_read: bytes read per tier path.
      bytes_written: bytes written per tier path.
      tier_busy_s: wall time each tier had at least one request in flight.
      beside_s: in an update beside the forward pass (:mod:`jax_mlpo.transforms.overlap`), its
        time after its first group of layers was handed back to the program: what the forward
        pass can run beside (0 for an update in one call). Timed on ``total_s``'s clock
        and inside its span: never above ``total_s``.
    """

    step: int
    total_s: float = 0.0
    read_wait_s: float = 0.0
    compute_s: float = 0.0
    write_wait_s: float = 0.0
    grad_write_s: float = 0.0
    cache_hits: int = 0
    reads_ahead: int = 0
    subgroups: int = 0
    bytes_read: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_written: dict[str, int] = dataclasses.field(default_factory=dict)
    tier_busy_s: dict[str, float] = dataclasses.field(default_factory=dict)
    beside_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def as_flat(self) -> dict[str, float]:
        """The figures as flat floats, to gather across processes: each scalar by its name, each
        per-tier figure as ``"<field>:<tier>"`` with the tier's path as configured (without a
        process's ``proc<k>`` directory, :func:`shared_tier_path`), so that every process of a
        data-parallel run has the same keys."""
        out = {name: float(getattr(self, name)) for name in SCALARS}
        for name in PER_TIER:
            for path, value in getattr(self, name).items():
                out[f"{name}:{shared_tier_path(path)}"] = float(value)
        return out

    @classmethod
    def from_flat(cls, step: int, values: Mapping[str, float]) -> StepMetrics:
        """The inverse of :meth:`as_flat`: keys that are not figures of a step are ignored.

        Args:
          step: the step's number.
          values: :meth:`as_flat`'s figures (of this process or another).
        """
        kwargs: dict[str, Any] = {name: {} for name in PER_TIER}
        for key, value in values.items():
            name, _, tier = key.partition(":")
            if name not in SCALARS and name not in PER_TIER:
                continue
            value = int(round(value)) if name in _INTS else float(value)
            if tier:
                kwargs[name][tier] = value
            else:
                kwargs[name] = value
        return cls(step=step, **kwargs)


# the figures of StepMetrics: scalars, and per-tier dicts keyed by the tier path
SCALARS = ("total_s", "read_wait_s", "compute_s", "write_wait_s", "grad_write_s",
           "cache_hits", "reads_ahead", "subgroups", "beside_s")  # fmt: skip
PER_TIER = ("bytes_read", "bytes_written", "tier_busy_s")
_INTS = ("cache_hits", "reads_ahead", "subgroups", "bytes_read", "bytes_written")
_PROC_DIR = re.compile(r"^proc\d+$")


def shared_tier_path(path: str) -> str:
    """A tier's path as configured: without the ``proc<k>`` directory of a multi-process run.

    :func:`jax_mlpo.sharding.processes.process_config` moves each process's share of a tier to
    ``<tier>/proc<k>``; figures of the same tier from different processes are compared and
    summed under ``<tier>``.
    """
    head, tail = os.path.split(path.rstrip(os.sep))
    if not _PROC_DIR.match(tail):
        return path
    # a prefix (``s3://bucket/run/proc0/``) keeps its trailing slash, as configured
    return head + os.sep if path.endswith(os.sep) else head


def combine(parts: Sequence[StepMetrics]) -> StepMetrics:
    """One step's figures of several engines that update one after another (``jax_mlpo.muon``'s):
    times, counts and bytes added, per tier path (each engine's tiers are its own)."""
    out = StepMetrics(step=parts[0].step)
    for m in parts:
        for name in SCALARS:
            setattr(out, name, getattr(out, name) + getattr(m, name))
        for name in PER_TIER:
            mine = getattr(out, name)
            for path, value in getattr(m, name).items():
                mine[path] = mine.get(path, 0) + value
    return out
