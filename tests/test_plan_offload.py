"""jax_mlpo.plan_offload against the engines an optimizer's init builds for the same params and
config: the subgroups, the state's bytes, the host memory of the buffers, the subgroups the
second update finds in host memory (the retained ones), the subgroups and bytes each tier
holds, and the error init raises where the plan names a problem."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jax_mlpo

# a bfloat16 matrix (its fp32 master in the state), float32 leaves, one not a whole subgroup
PARAMS = {
    "w": jax.ShapeDtypeStruct((300, 70), jnp.bfloat16),
    "b": jax.ShapeDtypeStruct((1000,), jnp.float32),
    "v": jax.ShapeDtypeStruct((77,), jnp.float32),
}


def _tiers(root: Path, given: bool = True) -> list[jax_mlpo.FileTier]:
    """Two tiers, the first twice as fast (when ``given``: measured placement splits unevenly
    and no probe runs)."""
    speeds = [("2GB", "1GB"), ("1GB", "500MB")] if given else [(None, None)] * 2
    return [jax_mlpo.FileTier(str(root / f"t{k}"), bandwidth=jax_mlpo.Bandwidth(r, w))
            for k, (r, w) in enumerate(speeds)]  # fmt: skip


def _zeros(params):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params)


def _engines(state) -> list:
    return [jax_mlpo.engine_of(s) for s in jax_mlpo.transforms.opt_state.find_offloaded(state)]


def _blobs(tier: Path, name: str = "") -> int:
    return len(list((tier / name).glob("state-*")))


def _check_against_engines(plan: jax_mlpo.OffloadPlan, tx, params, root: Path) -> None:
    """``plan`` against the engines ``tx.init`` builds and two of their updates: their layout
    and host memory, each tier's bytes as init writes the zero state, the second update's cache
    hits, each tier's blob files after close."""
    params = _zeros(params)
    state = tx.init(params)
    try:
        engines = [e for e in _engines(state) if e.layout.subgroups]
        assert [len(e.layout.subgroups) for e in engines] == [e.subgroups for e in plan.engines]
        assert [e.layout.state_bytes for e in engines] == [e.state_bytes for e in plan.engines]
        assert [e.host_bytes for e in engines] == [e.host_bytes for e in plan.engines]
        assert [e.host_only for e in engines] == [e.host_only for e in plan.engines]
        for engine, planned in zip(engines, plan.engines, strict=True):
            # init lays the zero state out over the tiers: every subgroup written once
            written = [t.bytes_written for t in engine.tiers]
            assert written == [t.bytes for t in planned.tiers], planned.name
        update = jax.jit(tx.update)
        for _ in range(2):
            _, state = update(jax.tree.map(jnp.ones_like, params), state, params)
        jax.effects_barrier()
        hits = [e.metrics[-1].cache_hits for e in engines]
        assert hits == [e.subgroups if e.host_only else e.retained for e in plan.engines]
    finally:
        jax_mlpo.close(state)  # every subgroup's blob on its tier
    several = len(plan.engines) > 1
    for k, tier in enumerate(plan.tiers):
        assert tier.path == str(root / f"t{k}")
        names = [e.name for e in plan.engines] if several else [""]
        assert sum(_blobs(Path(tier.path), n) for n in names) == tier.subgroups


@pytest.mark.parametrize("given", [True, False], ids=["given-bandwidths", "equal-split"])
def test_adamw_plan_is_what_init_builds(given, tmp_path):
    """The host cache holds 9 buffers (a pipeline of 6): 9 subgroups retained, the rest split
    by the given bandwidths (2:1), or evenly with ``placement="even"``."""
    config = jax_mlpo.OffloadConfig(host_cache=9 * 12 * 1024, tiers=_tiers(tmp_path, given),
                                    subgroup_size=1024,
                                    placement="measured" if given else "even")  # fmt: skip
    plan = jax_mlpo.plan_offload(PARAMS, config)
    assert plan.problem is None and plan.split_exact
    (engine,) = plan.engines
    assert (engine.name, engine.buffers, engine.pipeline_buffers) == ("adamw", 9, 6)
    assert sum(t.subgroups for t in plan.tiers) == plan.subgroups
    assert plan.host_bytes <= config.host_cache < plan.state_bytes
    counts = [t.subgroups - t.retained for t in plan.tiers]
    assert counts[0] > counts[1] if given else abs(counts[0] - counts[1]) <= 1
    _check_against_engines(plan, jax_mlpo.adamw(1e-3, offload=config), PARAMS, tmp_path)


def test_lion_and_bf16_moments_in_host_memory(tmp_path):
    """A state the host cache holds whole: no tiers in the plan (init warns they go unused),
    every subgroup a cache hit; one moment, in bfloat16."""
    config = jax_mlpo.OffloadConfig(host_cache="1MiB", subgroup_size=1024)
    plan = jax_mlpo.plan_offload(PARAMS, config, optimizer="lion", mu_dtype=jnp.bfloat16)
    (engine,) = plan.engines
    assert engine.host_only and not plan.tiers and engine.host_bytes == engine.state_bytes
    tx = jax_mlpo.lion(1e-3, mu_dtype=jnp.bfloat16, offload=config)
    _check_against_engines(plan, tx, PARAMS, tmp_path)


def test_muons_three_engines_share_the_host_cache(tmp_path):
    """jax_mlpo.muon: the bfloat16 matrix's momentum and fp32 master, AdamW on the vectors,
    each engine with its share of the host cache and its subdirectory of every tier."""
    config = jax_mlpo.OffloadConfig(host_cache=100_000, tiers=_tiers(tmp_path),
                                    subgroup_size=1024)  # fmt: skip
    plan = jax_mlpo.plan_offload(PARAMS, config, optimizer="muon")
    assert plan.problem is None and plan.state_bytes > config.host_cache
    assert plan.engines[0].tiers and plan.engines[-1].host_only  # AdamW's 8616 B fit whole
    assert [e.name for e in plan.engines] == ["momentum", "master", "adam"]
    assert [e.params for e in plan.engines] == [21_000, 21_000, 1077]
    assert sum(e.host_cache for e in plan.engines) <= config.host_cache
    _check_against_engines(plan, jax_mlpo.muon(0.02, offload=config), PARAMS, tmp_path)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_plans_problem_is_the_error_init_raises(optimizer, tmp_path):
    """Too small a host cache: the plan's problem is init's ConfigError, word for word."""
    config = jax_mlpo.OffloadConfig(host_cache="64KiB", tiers=_tiers(tmp_path),
                                    subgroup_size=4096)  # fmt: skip
    plan = jax_mlpo.plan_offload(PARAMS, config, optimizer=optimizer)
    assert "raise host_cache to at least" in plan.problem.lower()
    tx = getattr(jax_mlpo, optimizer)(1e-3, offload=config)
    with pytest.raises(jax_mlpo.ConfigError) as raised:
        jax_mlpo.close(tx.init(_zeros(PARAMS)))
    assert str(raised.value) == plan.problem
    with pytest.raises(ValueError, match="has no second moment"):
        jax_mlpo.plan_offload(PARAMS, config, optimizer="lion", nu_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="plans one of"):
        jax_mlpo.plan_offload(PARAMS, config, optimizer="sgd")
