"""How the host budget becomes buffers: how big, how many, how many the pipeline needs.

One owner for these figures: the engine builds itself from them, and ``pretrain.py --dry-run``
prints them without allocating anything, so the two cannot drift apart.

The host cache is cut into buffers of the largest subgroup blob (plus its fp32 gradient when
conversion is not delayed). The pipeline needs ``prefetch_depth`` reads in flight per tier, the
subgroup being updated and the one being written back: ``prefetch_depth x tiers + 2`` buffers.
With retention the remaining buffers keep subgroups across the step boundary (MLP-Offload's
cache reuse; :mod:`jax_mlpo.engine.retention` decides how many and which), and placement splits the
rest of the subgroups over the tiers by bandwidth (:mod:`jax_mlpo.engine.placement`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax_mlpo.config import FileTier, ObjectTier, OffloadConfig
from jax_mlpo.engine import retention
from jax_mlpo.engine.layout import Layout
from jax_mlpo.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """The host buffers of one engine.

    Attributes:
      host_only: the whole state fits ``host_cache``: no tiers, no pipeline, one buffer per
        subgroup.
      state_bytes: bytes of the whole (per-process) state.
      tiers: the tiers in use (only the first with ``placement="first"``).
      buffer_bytes: bytes of one pipeline buffer (state blob, plus its fp32 gradient blob for
        the baseline's gradient path).
      buffers: how many buffers the host cache holds (0 when ``host_only``).
      minimum: how many the pipeline needs.
      retained: how many subgroups stay in host memory across steps.
      problem: why the config cannot run (the engine raises it as a ``ConfigError``), or None.
    """

    host_only: bool
    state_bytes: int
    tiers: tuple[FileTier | ObjectTier, ...]
    buffer_bytes: int
    buffers: int
    minimum: int
    retained: int
    problem: str | None = None

    @property
    def host_bytes(self) -> int:
        """Host memory of the engine's buffers (the whole state when ``host_only``)."""
        if self.host_only:
            return self.state_bytes
        return max(self.buffers, self.minimum) * self.buffer_bytes


@dataclasses.dataclass(frozen=True)
class StateShape:
    """The sizes an engine's host plan is made from: those of its (per-process) state.

    Attributes:
      num_subgroups: subgroups of the state.
      state_bytes: bytes of the whole state.
      max_state_elems: float32 elements of the largest subgroup's state blob.
      max_subgroup_elems: parameters of the largest subgroup (its gradient blob's length).
    """

    num_subgroups: int
    state_bytes: int
    max_state_elems: int
    max_subgroup_elems: int

    @classmethod
    def of(cls, layout: Layout) -> StateShape:
        """The shape of the state ``layout`` describes (what the engine builds)."""
        sgs = layout.subgroups
        return cls(
            num_subgroups=len(sgs),
            state_bytes=layout.state_bytes,
            max_state_elems=layout.max_state_elems,
            max_subgroup_elems=max((sg.size for sg in sgs), default=0),
        )


def host_plan(config: OffloadConfig, shape: StateShape) -> HostPlan:
    """The buffer plan of an engine over a state of the given shape.

    Args:
      config: the offload configuration.
      shape: the sizes of the engine's (per-process) state.
    """
    num_subgroups, state_bytes = shape.num_subgroups, shape.state_bytes
    if state_bytes <= config.host_cache:
        return HostPlan(True, state_bytes, (), 0, 0, 0, num_subgroups)
    tiers = config.tiers[:1] if config.placement == "first" else config.tiers
    grad_elems = 0 if config.delayed_conversion else shape.max_subgroup_elems
    per_buffer = 4 * (shape.max_state_elems + grad_elems)
    minimum = config.prefetch_depth * len(tiers) + 2
    buffers = config.host_cache // per_buffer
    problem = None
    if not tiers:
        problem = (
            f"host_cache={config.host_cache} bytes cannot hold the optimizer state "
            f"({state_bytes} bytes) and no tiers are configured: add a FileTier, or "
            f"raise host_cache to at least {state_bytes}"
        )
    elif buffers < minimum:
        # the whole state in host memory needs no pipeline, and may be the smaller fix
        needed = min(minimum * per_buffer, state_bytes)
        problem = (
            f"host_cache={config.host_cache} bytes is smaller than the pipeline's buffers: "
            f"(prefetch_depth {config.prefetch_depth} x {len(tiers)} tier(s) + 2) x "
            f"{per_buffer} bytes per subgroup = {minimum * per_buffer} bytes: the pipeline "
            f"needs {minimum}. Raise host_cache to at least {needed}, or lower subgroup_size "
            "or prefetch_depth."
        )
    retained = retention.retained_count(
        config, buffers=buffers, minimum=minimum, subgroups=num_subgroups
    )
    return HostPlan(
        False, state_bytes, tuple(tiers), per_buffer, buffers, minimum, retained, problem
    )


def layout_plan(config: OffloadConfig, layout: Layout) -> HostPlan:
    """:func:`host_plan` for the subgroups of ``layout`` (what the engine builds)."""
    return host_plan(config, StateShape.of(layout))


def split_host_cache(config: OffloadConfig, shapes: Sequence[StateShape]) -> list[int]:
    """Shares of ``config.host_cache`` for several engines of one optimizer (``jax_mlpo.muon``'s).

    Each engine first gets what it cannot run without: its pipeline's buffers, or its whole
    state where that is smaller; the rest is shared in proportion to the state each still has
    on the tiers, and no engine gets more than its state.

    Args:
      config: the offload configuration the engines share.
      shapes: each engine's state (:meth:`StateShape.of` its layout).

    Raises:
      ConfigError: when the host cache cannot hold every engine's minimum; it names the size.
    """
    plans = [host_plan(dataclasses.replace(config, host_cache=0), x) for x in shapes]
    # without tiers an engine holds its whole state in the host cache
    need = [min(p.state_bytes, p.minimum * p.buffer_bytes) if p.tiers else p.state_bytes
            for p in plans]  # fmt: skip
    if sum(need) > config.host_cache:
        raise ConfigError(
            f"host_cache={config.host_cache} bytes cannot hold the pipelines of this optimizer's "
            f"{len(shapes)} states ({sum(need)} bytes); raise host_cache to at least "
            f"{sum(need)}, or lower subgroup_size or prefetch_depth"
        )
    rest = [p.state_bytes - n for p, n in zip(plans, need, strict=True)]
    spare = config.host_cache - sum(need)
    total = sum(rest)
    if total <= spare:
        return [p.state_bytes for p in plans]
    return [n + spare * r // total for n, r in zip(need, rest, strict=True)]
