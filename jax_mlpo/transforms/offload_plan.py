"""What an offloaded optimizer's ``init`` would build for a params tree, without building it.

:func:`plan_offload` lays the params out into subgroups, plans each engine's host buffers
and splits its subgroups over the tiers with the functions the engine builds itself from
(:func:`jax_mlpo.engine.layout.build_layout`, :func:`jax_mlpo.engine.plan.host_plan`,
:func:`jax_mlpo.engine.placement.tier_split`), so the figures are the run's: the host
memory the buffers take, how many subgroups stay in host memory across steps, and the subgroups
and bytes each tier holds. Nothing is allocated, no tier is opened or probed::

    params = jax.eval_shape(model.init, key, batch)        # shapes and dtypes are enough
    plan = jax_mlpo.plan_offload(params, config)
    print(plan.host_bytes, {t.path: t.bytes for t in plan.tiers}, plan.problem)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from jax_mlpo.config import OffloadConfig
from jax_mlpo.engine.layout import Layout, build_layout, check_moment_dtypes
from jax_mlpo.engine.placement import effective_bandwidth, interleave, tier_split
from jax_mlpo.engine.plan import StateShape, layout_plan, split_host_cache
from jax_mlpo.errors import ConfigError
from jax_mlpo.transforms.muon import leaf_groups
from jax_mlpo.types import F32

OPTIMIZERS = ("adamw", "lion", "muon")


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """One tier's share of an offloaded state.

    Attributes:
      path: the tier's path as configured (``jax_mlpo.muon``'s engines keep their files in
        its subdirectories ``momentum``, ``master`` and ``adam``).
      subgroups: subgroups whose blob the tier holds.
      retained: of those, how many stay in host memory across steps (read and written only
        when the state is saved or closed).
      bytes: the bytes of their blobs.
    """

    path: str
    subgroups: int
    retained: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """The state of one engine (a host optimizer over some of the leaves) and its buffers.

    Attributes:
      name: ``"adamw"`` or ``"lion"``; for ``jax_mlpo.muon`` its engines' ``"momentum"`` (the
        matrices' momentum), ``"master"`` (their fp32 master, bfloat16 matrices only) and
        ``"adam"`` (AdamW's state of the other leaves).
      params: parameters whose state the engine holds.
      subgroups: subgroups of that state.
      subgroup_params: parameters of the largest subgroup.
      subgroup_bytes: state bytes of the largest subgroup's blob.
      state_bytes: bytes of the whole state.
      host_cache: the engine's share of ``OffloadConfig.host_cache``.
      host_only: the state fits the share: it stays in host memory, the tiers go unused.
      buffer_bytes: bytes of one pipeline buffer (0 when ``host_only``).
      buffers: pipeline buffers the share holds (0 when ``host_only``).
      pipeline_buffers: buffers the pipeline needs (``prefetch_depth`` x tiers + 2).
      retained: subgroups kept in host memory across steps.
      host_bytes: host memory of the engine's buffers (the whole state when ``host_only``).
      tiers: each tier's subgroups and bytes, in the config's order; empty when ``host_only``.
      problem: why the engine cannot be built (init raises it as a ``ConfigError``), or None.
    """

    name: str
    params: int
    subgroups: int
    subgroup_params: int
    subgroup_bytes: int
    state_bytes: int
    host_cache: int
    host_only: bool
    buffer_bytes: int
    buffers: int
    pipeline_buffers: int
    retained: int
    host_bytes: int
    tiers: tuple[TierPlan, ...]
    problem: str | None


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """What an offloaded optimizer's ``init`` builds for a params tree (:func:`plan_offload`).

    Attributes:
      engines: one plan per engine, in the order the update runs them (one for AdamW and
        Lion, up to three for Muon).
      split_exact: the tier split is the one the engine makes: ``placement`` is not
        ``"measured"``, or every tier gives its read and write bandwidth. Otherwise the engine
        probes the tiers at start and splits by what it measures; the plan assumes equal
        bandwidths.
      problem: why ``init`` would fail (the host cache cannot hold the engines' pipelines, or
        the state does not fit it and no tier is configured), or None.
    """

    engines: tuple[EnginePlan, ...]
    split_exact: bool
    problem: str | None

    @property
    def params(self) -> int:
        """Parameters the engines hold state for (Muon's master engine counted again)."""
        return sum(e.params for e in self.engines)

    @property
    def subgroups(self) -> int:
        return sum(e.subgroups for e in self.engines)

    @property
    def state_bytes(self) -> int:
        return sum(e.state_bytes for e in self.engines)

    @property
    def host_bytes(self) -> int:
        """Host memory of the engines' buffers: at most ``host_cache`` for a plan that runs."""
        return sum(e.host_bytes for e in self.engines)

    @property
    def retained(self) -> int:
        return sum(e.retained for e in self.engines)

    @property
    def tiers(self) -> tuple[TierPlan, ...]:
        """Each configured tier's subgroups and bytes over all engines (empty when every engine
        keeps its state in host memory)."""
        total: dict[str, list[int]] = {}
        for e in self.engines:
            for t in e.tiers:
                sums = total.setdefault(t.path, [0, 0, 0])
                for k, value in enumerate((t.subgroups, t.retained, t.bytes)):
                    sums[k] += value
        return tuple(TierPlan(path, *sums) for path, sums in total.items())


def plan_offload(
    params: Any,
    offload: OffloadConfig,
    *,
    optimizer: str = "adamw",
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    muon_weight_dimension_numbers: Any = None,
) -> OffloadPlan:
    """The state, host buffers and tier split that ``jax_mlpo.<optimizer>``'s ``init`` would
    build for ``params``, without allocating anything or touching the tiers.

    Args:
      params: the params the optimizer's ``init`` gets, as arrays or ``jax.ShapeDtypeStruct``
        (only shapes and dtypes are read). With several processes, each process's engine holds
        its shards: pass ``jax_mlpo.sharding.processes.local_params(params, n)``.
      offload: where the state lives (its tier paths are not checked).
      optimizer: ``"adamw"``, ``"lion"`` or ``"muon"``.
      mu_dtype: the optimizer's ``mu_dtype`` (None: float32).
      nu_dtype: AdamW's ``nu_dtype`` (None: float32).
      muon_weight_dimension_numbers: Muon's (None: every 2-D leaf is a matrix).

    Returns:
      The plan: each engine's state, buffers and tier split, and the ``problem`` that keeps
      ``init`` from running (None if it runs).

    Raises:
      ValueError: for an unknown ``optimizer``, a ``nu_dtype`` for Lion or Muon, a moment
        dtype the optimizer does not store, or a param dtype other than float32 and bfloat16.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: plan_offload plans one of {OPTIMIZERS}")
    if nu_dtype is not None and optimizer != "adamw":
        raise ValueError(f"nu_dtype={nu_dtype!r}: jax_mlpo.{optimizer} has no second moment")
    mu = check_moment_dtypes([F32 if mu_dtype is None else mu_dtype], ["mu"])
    size = offload.subgroup_size
    if optimizer == "adamw":
        moments = check_moment_dtypes([F32 if d is None else d for d in (mu_dtype, nu_dtype)])
        layouts = {"adamw": build_layout(params, size, None, moments)}
    elif optimizer == "lion":
        layouts = {"lion": build_layout(params, size, None, mu, ("mu",))}
    else:
        layouts = _muon_layouts(params, size, mu, muon_weight_dimension_numbers)
    return _plan(layouts, offload)


def _muon_layouts(params: Any, size: int, mu: tuple, dims: Any) -> dict[str, Layout]:
    """``jax_mlpo.muon``'s engines that hold a state, as its ``init`` lays them out."""
    leaves = jax.tree.leaves(params)
    groups = leaf_groups(params, dims)
    matrices = [leaves[i] for i in groups.muon]
    bf16 = [matrices[k] for k in groups.master]
    others = [leaves[i] for i in groups.adam]
    layouts = {
        "momentum": matrices and build_layout(matrices, size, None, mu, ("mu",),
                                              keeps_master=False),
        "master": bf16 and build_layout(bf16, size, None, (), ()),
        "adam": others and build_layout(others, size, None, (*mu, F32)),
    }  # fmt: skip
    return {name: layout for name, layout in layouts.items() if layout}


def _plan(layouts: dict[str, Layout], offload: OffloadConfig) -> OffloadPlan:
    """The engines over ``layouts`` sharing ``offload``'s host cache, as the run shares it."""
    shapes = [StateShape.of(x) for x in layouts.values()]
    problem, shares = None, [offload.host_cache]
    if len(layouts) > 1:
        try:
            shares = split_host_cache(offload, shapes)
        except ConfigError as e:  # init raises it
            problem, shares = str(e), [0] * len(layouts)
    given = [(t.bandwidth.read, t.bandwidth.write) for t in offload.tiers]
    known = all(r and w for r, w in given)
    measured = offload.placement == "measured"
    engines = []
    for (name, layout), share in zip(layouts.items(), shares, strict=True):
        config = dataclasses.replace(offload, host_cache=share)
        if len(layouts) > 1:  # each of Muon's engines in a subdirectory of every tier
            config = dataclasses.replace(config, tiers=tuple(t.for_part(name) for t in
                                                             offload.tiers))  # fmt: skip
        paths = [t.path for t in offload.tiers]
        engine = _engine(name, layout, config, paths, given if measured and known else None)
        engines.append(engine)
        problem = problem or engine.problem
    return OffloadPlan(tuple(engines), split_exact=known or not measured, problem=problem)


def _engine(
    name: str, layout: Layout, config: OffloadConfig, paths: Sequence[str],
    bandwidths: Sequence[tuple[float, float]] | None,
) -> EnginePlan:  # fmt: skip
    """One engine's plan; ``paths``: the tiers as configured; ``bandwidths``: their given
    ``(read, write)``, or None (split as if equal)."""
    host = layout_plan(config, layout)
    tiers: tuple[TierPlan, ...] = ()
    if host.tiers:
        # the engine's rule (jax_mlpo.engine.placement.assign_tiers): measured placement splits by
        # the tiers' bandwidths, any other placement as if they were equal
        pairs = bandwidths[: len(host.tiers)] if bandwidths else [(1.0, 1.0)] * len(host.tiers)
        effective = [effective_bandwidth(r, w) for r, w in pairs]
        sgs = layout.subgroups
        split = tier_split(len(sgs), effective, host.retained, config.retain_policy)
        nbytes = [0] * len(host.tiers)
        for sg, k in zip(sgs, interleave(list(split.counts)), strict=True):
            nbytes[k] += sg.state_bytes
        tiers = tuple(
            TierPlan(path, n, kept, b)
            for path, n, kept, b in zip(
                paths[: len(host.tiers)], split.counts, split.retained, nbytes, strict=True
            )  # fmt: skip
        )
    return EnginePlan(
        name=name,
        params=layout.num_params,
        subgroups=len(layout.subgroups),
        subgroup_params=layout.max_subgroup_elems,
        subgroup_bytes=4 * layout.max_state_elems,
        state_bytes=layout.state_bytes,
        host_cache=config.host_cache,
        host_only=host.host_only,
        buffer_bytes=host.buffer_bytes,
        buffers=host.buffers,
        pipeline_buffers=host.minimum,
        retained=host.retained,
        host_bytes=host.host_bytes,
        tiers=tiers,
        problem=host.problem,
    )
