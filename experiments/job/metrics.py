"""The pre-training job's step figures, aggregated across its processes.

In a data-parallel run (:mod:`jax_mlpo.sharding.processes`) every process has its own engine and its
own :class:`jax_mlpo.StepMetrics`. The job advances at the pace of its slowest
process (the next step's gradient reduction waits for it), so :func:`aggregate` reports the
slowest process's time as the step time, with that process's breakdown, and keeps every
process's figures beside it::

    timings = {"step_s": t1 - t0}
    step = metrics.aggregate(engine.metrics[-1], timings, time_key="step_s")
    if jax.process_index() == 0:
        log(step.step_time_s, step.slowest, step.per_process["step_s"])
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping

import numpy as np

from jax_mlpo import StepMetrics


@dataclasses.dataclass(frozen=True)
class ProcessValues:
    """Figures of one step from every process: ``values[key][k]`` is process ``k``'s.

    Attributes:
      values: for each key, a float64 array with one entry per process, in process order.
    """

    values: dict[str, np.ndarray]

    @property
    def processes(self) -> int:
        return len(next(iter(self.values.values()))) if self.values else 0

    def __getitem__(self, key: str) -> np.ndarray:
        return self.values[key]

    def of(self, process: int) -> dict[str, float]:
        """Every figure of one process."""
        return {k: float(v[process]) for k, v in self.values.items()}

    def per_process(self) -> dict[str, list[float]]:
        """Every figure as a list over processes (JSON-friendly)."""
        return {k: [float(x) for x in v] for k, v in self.values.items()}


def gather(values: Mapping[str, float]) -> ProcessValues:
    """Every process's ``values``, exactly, on every process.

    A collective (``jax.experimental.multihost_utils.process_allgather``): every process of
    the job must call it at the same point, with the same keys in the same order. With one
    process it communicates nothing.

    Args:
      values: this process's figures (numbers).

    Returns:
      The figures of all processes.

    Raises:
      ValueError: if the processes passed different keys.
    """
    import jax

    keys = list(values)
    local = np.asarray([float(values[k]) for k in keys], np.float64)
    if jax.process_count() == 1:
        return ProcessValues({k: local[i : i + 1] for i, k in enumerate(keys)})
    from jax.experimental import multihost_utils

    # Arrays cross processes as jax arrays, 32-bit unless jax_enable_x64: float32 would round
    # byte counts above 2**24, so the float64 bits travel as pairs of uint32.
    # The keys are not sent: check that every process means the same ones (count and names).
    names = np.array([len(keys), zlib.crc32("\n".join(keys).encode())], np.uint32)
    seen = np.asarray(multihost_utils.process_allgather(names)).reshape(-1, 2)
    if (seen != names).any():
        raise ValueError(
            "metrics.gather: the processes passed different figures (counts "
            f"{seen[:, 0].tolist()}); pass the same keys, in the same order, on every process"
        )
    bits = multihost_utils.process_allgather(local.view(np.uint32))
    rows = np.ascontiguousarray(np.asarray(bits, np.uint32)).view(np.float64)
    return ProcessValues({k: rows[:, i].copy() for i, k in enumerate(keys)})


@dataclasses.dataclass(frozen=True)
class JobStep:
    """One step of a (possibly multi-process) job, aggregated.

    Attributes:
      slowest: the process with the longest ``time_key``: it sets the step time.
      step_time_s: that process's ``time_key`` (the maximum over processes).
      timings: the slowest process's timings (as passed to :func:`aggregate`).
      metrics: the slowest process's engine metrics (tier paths as configured), or None.
      values: every figure of every process (timings, then ``StepMetrics.as_flat``'s keys).
    """

    slowest: int
    step_time_s: float
    timings: dict[str, float]
    metrics: StepMetrics | None
    values: ProcessValues

    @property
    def processes(self) -> int:
        return self.values.processes

    @property
    def per_process(self) -> dict[str, list[float]]:
        """Every figure as a list over processes."""
        return self.values.per_process()

    def total(self, key: str) -> float:
        """The sum over processes of a figure (e.g. ``"bytes_read:/nvme/run"``)."""
        return float(self.values[key].sum())


def aggregate(
    metrics: StepMetrics | None = None,
    timings: Mapping[str, float] | None = None,
    *,
    time_key: str = "total_s",
) -> JobStep:
    """This step across the job's processes: the slowest process sets the step time.

    A collective (see :func:`gather`): every process calls it once per step.

    Args:
      metrics: this process's engine metrics of the step (``engine.metrics[-1]``), or None
        (an in-memory optimizer).
      timings: this process's other figures of the step, e.g. ``{"step_s": ..., "fwd_bwd_s":
        ...}``; names must not contain ``":"``.
      time_key: the figure that defines "slowest": a key of ``timings`` or ``"total_s"`` (the
        host update).

    Returns:
      The aggregated step (identical on every process).
    """
    timings = dict(timings or {})
    flat = dict(timings)
    if metrics is not None:
        for key, value in metrics.as_flat().items():
            flat.setdefault(key, value)
    if time_key not in flat:
        raise KeyError(f"aggregate: time_key={time_key!r} is neither in timings nor in metrics")
    values = gather(flat)
    slowest = int(np.argmax(values[time_key]))
    mine = values.of(slowest)
    return JobStep(
        slowest=slowest,
        step_time_s=mine[time_key],
        timings={k: mine[k] for k in timings},
        metrics=None if metrics is None else StepMetrics.from_flat(metrics.step, mine),
        values=values,
    )
