"""An engine's storage, made from its plan: tiers, placement, the host cache and its I/O.

:func:`open_storage` opens the plan's tiers, measures them where placement is ``"measured"``,
places the subgroups on them (:mod:`jax_mlpo.engine.placement`), allocates the host cache's
buffers and writes the zero state; :func:`host_storage` holds a state that fits in host memory,
a buffer per subgroup and no tier.
"""

from __future__ import annotations

import dataclasses

from jax_mlpo.config import ConfigError, OffloadConfig
from jax_mlpo.engine.buffers import IOPipeline, SlotCache, touched_buffer
from jax_mlpo.engine.layout import Layout
from jax_mlpo.engine.leaves import GradientSource, InMemoryGradients, gradient_source
from jax_mlpo.engine.placement import TierAssignment, assign_tiers, probe_kind
from jax_mlpo.engine.plan import HostPlan
from jax_mlpo.engine.snapshot import STATE, STATE_ALT, CopyOnWrite
from jax_mlpo.tiers.file import FileTierStore, open_store


@dataclasses.dataclass(frozen=True)
class Storage:
    """Where an engine's state lives and how it moves.

    Attributes:
      cache: the host cache (all the host memory the state takes: ``host_cache``).
      pipeline: the reads and write-backs between the cache and the tiers.
      kinds: the blob kind of each subgroup's state (copy-on-write during checkpoints).
      gradients: where an update's gradients come from.
      assignment: each subgroup's tier (None without tiers).
    """

    cache: SlotCache
    pipeline: IOPipeline
    kinds: CopyOnWrite
    gradients: GradientSource
    assignment: TierAssignment | None = None


def host_storage(config: OffloadConfig, layout: Layout) -> Storage:
    """A state all in host memory: a buffer per subgroup, every subgroup resident (dirty)."""
    elems = [sg.state_elems for sg in layout.subgroups]
    cache = SlotCache(
        [touched_buffer(n) for n in elems], elems, reuse_clean=False,
        resident={i: i for i in range(len(elems))},
    )  # fmt: skip
    kinds = CopyOnWrite(len(elems))
    pipeline = IOPipeline(
        cache, [], None, kinds, prefetch_depth=0, fallback_on_full=False,
        io_timeout_s=config.io_timeout_s,
    )  # fmt: skip
    return Storage(cache, pipeline, kinds, InMemoryGradients())


def open_storage(
    config: OffloadConfig, layout: Layout, plan: HostPlan, stores: list[FileTierStore]
) -> Storage:
    """Opens the plan's tiers into ``stores`` and lays the zero state out over them.

    Args:
      config: the offload configuration.
      layout: the subgroups.
      plan: the host budget's plan (buffers, retained count, tiers).
      stores: filled with the opened tiers as they open, so that the caller closes them if a
        later step fails.

    Returns:
      The storage, every subgroup's state zero on its tier (the master is set at step 1).

    Raises:
      ConfigError: the plan's problem (the host cache cannot hold the pipeline's buffers, or
        the state does not fit in it and no tier is configured).
    """
    if plan.problem:
        raise ConfigError(plan.problem)
    elems = [sg.state_elems for sg in layout.subgroups]
    gradients = gradient_source(config, layout, plan.buffers)
    kinds = {STATE: elems, STATE_ALT: elems, **gradients.tier_kinds()}
    if config.placement == "measured":
        kinds.update(probe_kind(layout.max_state_elems))
    for tier in plan.tiers:
        stores.append(open_store(tier, kinds, config.node_permits_dir))
    # the cache's buffers: all the host memory the engine's state ever takes (host_cache)
    buffers = [touched_buffer(layout.max_state_elems) for _ in range(plan.buffers)]
    assignment = assign_tiers(config, stores, elems, plan.retained, buffers)
    cache = SlotCache(buffers, elems, reuse_clean=gradients.reuse_clean and config.retain)
    copy_on_write = CopyOnWrite(len(elems))
    pipeline = IOPipeline(
        cache, stores, assignment, copy_on_write, prefetch_depth=config.prefetch_depth,
        fallback_on_full=config.fallback_on_full, io_timeout_s=config.io_timeout_s,
        companion_reads=gradients.reads,
    )  # fmt: skip
    gradients.bind(pipeline, stores, assignment)
    buffers[0].fill(0.0)  # the probe may have used it
    pipeline.write_all(buffers[0])
    return Storage(cache, pipeline, copy_on_write, gradients, assignment)
