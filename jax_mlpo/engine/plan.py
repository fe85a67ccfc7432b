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
import warnings
from collections.abc import Sequence

from jax_mlpo.config import FileTier, ObjectTier, OffloadConfig
from jax_mlpo.engine import retention
from jax_mlpo.engine.layout import Layout
from jax_mlpo.errors import ConfigError, UnusedTiersWarning


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
            f"({state_bytes} bytes) and no tiers are configured: add a FileTier (the state "
            f"then streams through it), or raise host_cache to at least {state_bytes} (the "
            "whole state, held in host memory)"
        )
    elif buffers < minimum:
        pipeline = minimum * per_buffer
        problem = (
            f"host_cache={config.host_cache} bytes is smaller than the pipeline's buffers: "
            f"(prefetch_depth {config.prefetch_depth} x {len(tiers)} tier(s) + 2) x "
            f"{per_buffer} bytes per subgroup = {pipeline} bytes: the pipeline needs "
            f"{minimum}. {_sizes_to_raise(pipeline, state_bytes)}"
        )
    retained = retention.retained_count(
        config, buffers=buffers, minimum=minimum, subgroups=num_subgroups
    )
    return HostPlan(
        False, state_bytes, tuple(tiers), per_buffer, buffers, minimum, retained, problem
    )


def _sizes_to_raise(pipeline: int, state_bytes: int) -> str:
    """What each host cache size that would fix a too small one means: the pipeline's buffers
    keep the tiers in use; the whole state turns them off."""
    if state_bytes <= pipeline:  # no host cache runs this state through the tiers
        return (
            f"Raise host_cache to at least {state_bytes} (the whole state: it then stays in "
            "host memory and the tiers go unused), or lower subgroup_size or prefetch_depth "
            f"until the pipeline's buffers are smaller than the state ({state_bytes} bytes) "
            "to keep the tiers in use."
        )
    return (
        f"Raise host_cache to at least {pipeline} (the pipeline's buffers: the state streams "
        f"through the tiers; {state_bytes} or more holds the whole state in host memory and "
        "leaves the tiers unused), or lower subgroup_size or prefetch_depth."
    )


def pipeline_bytes(config: OffloadConfig, shape: StateShape) -> int:
    """The smallest ``host_cache`` that runs a state of ``shape`` through ``config``'s tiers."""
    plan = host_plan(dataclasses.replace(config, host_cache=0), shape)
    return plan.minimum * plan.buffer_bytes


def warn_unused_tiers(name: str, config: OffloadConfig, shapes: Sequence[StateShape],
                      plans: Sequence[HostPlan], *, stacklevel: int = 2) -> None:  # fmt: skip
    """Warns (:class:`UnusedTiersWarning`) when ``config`` names tiers and every one of an
    optimizer's engines (``plans``, of states ``shapes``) keeps its state in host memory.

    Args:
      name: the optimizer's name, for the message.
      config: the optimizer's configuration (the one the user gave).
      shapes: its engines' states.
      plans: their plans.
      stacklevel: the warning's stack level, counted from the caller.
    """
    if not config.tiers or not all(p.host_only for p in plans):
        return
    state_bytes = sum(s.state_bytes for s in shapes)
    if state_bytes == 0:
        return
    pipeline = sum(pipeline_bytes(config, s) for s in shapes if s.state_bytes)
    paths = ", ".join(repr(t.path) for t in config.tiers)
    if pipeline < state_bytes:
        fix = (
            f"To put it on the tiers, lower host_cache below {state_bytes} bytes (at least "
            f"{pipeline}: the pipeline's buffers)"
        )
    else:
        fix = (
            f"No host_cache puts it on the tiers: the pipeline's buffers ({pipeline} bytes) are "
            f"larger than the state; lower subgroup_size (now {config.subgroup_size}) or "
            "prefetch_depth for that"
        )
    warnings.warn(
        f"jax_mlpo.{name}: the optimizer state ({state_bytes} bytes) fits in host_cache="
        f"{config.host_cache} bytes, so it stays all in host memory and the "
        f"{len(config.tiers)} configured tier(s) ({paths}) are not used. {fix}. To keep it in "
        "host memory, drop the tiers (tiers=()) or say so with warnings.filterwarnings("
        '"ignore", category=jax_mlpo.UnusedTiersWarning).',
        UnusedTiersWarning,
        stacklevel=stacklevel + 1,
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
            f"{sum(need)} (each state's pipeline buffers, or the whole state where that is "
            "smaller, which then stays in host memory), or lower subgroup_size or prefetch_depth"
        )
    rest = [p.state_bytes - n for p, n in zip(plans, need, strict=True)]
    spare = config.host_cache - sum(need)
    total = sum(rest)
    if total <= spare:
        return [p.state_bytes for p in plans]
    return [n + spare * r // total for n, r in zip(need, rest, strict=True)]
