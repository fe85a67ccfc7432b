"""The dry run's plan is what the engine does: for every shipped config, ``pretrain.py
--dry-run``'s host memory, retained subgroups and tier split against what jax_mlpo's engine is
seen to allocate, hit and write for the same state.

Each config keeps its order, retention, placement, prefetch depth and tier count; its model
becomes the tiny preset (in the config's parameter dtype), its subgroup size is scaled so the
state has about as many subgroups as the config's model, and its host cache holds as many
buffers as the config's does. The tiers go to ``tmp_path`` with given bandwidths (unequal, so
measured placement splits unevenly), so no probe runs.
"""

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jax_mlpo
from experiments.job.dry_run import dry_run, memory_plan
from experiments.job.optimizer import build_optimizer, muon_update_bytes
from experiments.job.run_config import RunConfig, load_config, resolve_model
from experiments.job.steps import abstract_model
from models import get_preset, param_count

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "experiments" / "configs").glob("*.yaml"))


def _scaled(path: Path, tmp_path: Path) -> RunConfig:
    """``path``'s config on the tiny model, with the same plan shape as the config's own."""
    full = load_config(str(path), [f"run_dir={tmp_path / 'full'}"])
    shape = memory_plan(full, 1)
    n = param_count(get_preset("tiny"))
    subgroup = math.ceil(n / shape.num_subgroups)
    tiers = []
    for k, tier in enumerate(full.offload.tiers):
        t = dataclasses.asdict(tier)
        t["path"] = str(tmp_path / f"t{k}")
        t["bandwidth"] = {
            "read": tier.bandwidth.read or 2_000_000_000 // (k + 1),
            "write": tier.bandwidth.write or 1_000_000_000 // (k + 1),
        }
        tiers.append(t)
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        "model=tiny",
        "model_overrides=null",  # a mapping merges into the file's: drop the file's first
        f"model_overrides={{param_dtype: {shape.param_dtype}}}",
        f"offload.subgroup_size={subgroup}",
        f"offload.tiers={json.dumps(tiers)}",
    ]
    if not shape.engine.host_only:
        # as many buffers as the config's host cache holds, of the tiny state's size
        cfg = load_config(str(path), [*overrides, "offload.host_cache=0"])
        per_buffer = memory_plan(cfg, 1).engine.buffer_bytes
        overrides.append(f"offload.host_cache={shape.engine.buffers * per_buffer}")
    return load_config(str(path), overrides)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_dry_run_plan_is_what_the_engine_does(path, tmp_path):
    """The dry run's figures against what the engine is seen to do: the host memory its buffers
    take, the cache hits of its second update (the subgroups retained across the first), and
    the subgroup blobs each tier directory holds."""
    cfg = _scaled(path, tmp_path)
    full = memory_plan(load_config(str(path), [f"run_dir={tmp_path / 'full'}"]), 1)
    plan = memory_plan(cfg, 1)
    assert plan.engine.problem is None, plan.engine.problem
    same = ("buffers", "pipeline_buffers")
    assert [getattr(plan.engine, k) for k in same] == [getattr(full.engine, k) for k in same]
    report = dry_run(cfg, 1)
    assert report["problem"] is None
    if report["tiers"]:  # the pipeline: the subgroup updated, the one written back, and reads
        tiers = len(cfg.offload.tiers)
        assert report["pipeline_buffers"] == cfg.offload.prefetch_depth * tiers + 2
    dtype = jnp.bfloat16 if plan.param_dtype == "bfloat16" else jnp.float32
    params = {"w": jnp.zeros(plan.params_per_process, dtype)}  # the model's size, one leaf
    tx = jax_mlpo.adamw(1e-3, offload=cfg.offload)
    state = tx.init(params)
    try:
        engine = jax_mlpo.engine_of(state)
        assert engine.host_bytes == report["engine_host_bytes"]
        # init writes every subgroup's zero state to its tier once: the bytes each tier holds
        written = {t.tier.path: t.bytes_written for t in engine.tiers}
        assert written == {path: t["bytes"] for path, t in report["tiers"].items()}
        update = jax.jit(tx.update)
        for _ in range(2):
            _, state = update(jax.tree.map(jnp.ones_like, params), state, params)
        hits = [m.cache_hits for m in jax_mlpo.metrics(state)]
    finally:
        jax_mlpo.close(state)  # every subgroup's blob on its tier
    subgroups = report["subgroups_per_process"]
    if not report["tiers"]:  # all in host memory: every subgroup a hit, every step
        assert hits == [subgroups, subgroups]
        return
    assert hits == [0, report["retained_subgroups"]]
    assert list(report["tiers"]) == [t.path for t in cfg.offload.tiers]
    for path, shown in report["tiers"].items():
        blobs = list(Path(path).glob("state-*"))
        assert len(blobs) == shown["subgroups"], (path, sorted(b.name for b in blobs))
    assert sum(shown["subgroups"] for shown in report["tiers"].values()) == subgroups


def test_alternate_order_keeps_every_buffer():
    """The drift this plan fixes: with the alternating order every host buffer keeps its
    subgroup across the step boundary, not only those beyond the pipeline's."""
    cfg = load_config(str(ROOT / "experiments" / "configs" / "tiny.yaml"))
    report = dry_run(cfg, 1)
    assert cfg.offload.order == "alternate" and cfg.offload.retain
    # tiny.yaml: 1 MiB of 128 KiB buffers, 10 subgroups, a pipeline of 2 x 2 tiers + 2
    assert report["pipeline_buffers"] == 6 and report["retained_subgroups"] == 8
    ascending = dataclasses.replace(
        cfg, offload=dataclasses.replace(cfg.offload, order="ascending")
    )
    kept = dry_run(ascending, 1)["retained_subgroups"]
    assert kept == 2  # the buffers beyond the pipeline


def _muon_on_tiny(run_dir: Path, sets: list[str], fill: float = 0.0) -> tuple[RunConfig, Any]:
    """tiny.yaml with ``optimizer.name=muon`` and ``sets``, and the model's params (``fill``)."""
    cfg = load_config(str(ROOT / "experiments" / "configs" / "tiny.yaml"),
                      [f"run_dir={run_dir}", "optimizer.name=muon", *sets])  # fmt: skip
    _, shapes, _ = abstract_model(resolve_model(cfg))
    return cfg, jax.tree.map(lambda x: jnp.full(x.shape, fill, x.dtype), shapes)


def test_dry_run_plans_muons_engines_as_the_run_makes_them(tmp_path):
    """Muon's three engines (the matrices' momentum and fp32 master, AdamW on the other leaves)
    share the host cache: the dry run's per-engine figures and tier split against the engines
    the job's optimizer builds over the tiny model's own params."""
    tiers = [{"path": str(tmp_path / f"t{k}"), "read_bandwidth": 2_000_000_000 // (k + 1),
              "write_bandwidth": 1_000_000_000 // (k + 1)} for k in range(2)]  # fmt: skip
    cfg, params = _muon_on_tiny(tmp_path / "run", [
        "model_overrides={param_dtype: bfloat16}", "offload.subgroup_size=8192",
        f"offload.tiers={json.dumps(tiers)}",
    ], fill=0.5)  # fmt: skip
    report = dry_run(cfg, 1)
    assert report["problem"] is None
    assert list(report["engines"]) == ["momentum", "master", "adam"]
    tx = build_optimizer(cfg, use_optax=False)
    state = tx.init(params)
    parts = state[1]._asdict()  # the chain's clipping, then Muon's OffloadedMuonState
    engines = {name: jax_mlpo.engine_of(s) for name, s in parts.items()}
    try:
        assert report["engine_host_bytes"] == sum(e.host_bytes for e in engines.values())
        assert report["engine_host_bytes"] <= cfg.offload.host_cache
        for name, e in engines.items():
            planned = report["engines"][name]
            assert planned["subgroups"] == len(e.layout.subgroups), name
            assert planned["state_bytes_per_process"] == e.layout.state_bytes, name
            assert planned["host_bytes"] == e.host_bytes, name
        update = jax.jit(tx.update)
        for _ in range(2):
            _, state = update(jax.tree.map(jnp.ones_like, params), state, params)
        jax.effects_barrier()
        for name, e in engines.items():  # the second update finds the retained subgroups
            assert e.metrics[-1].cache_hits == report["engines"][name]["retained"], name
    finally:
        jax_mlpo.close(state)  # every subgroup's blob on its tier
    for tier in tiers:
        blobs = list(Path(tier["path"]).glob("*/state-*"))
        assert len(blobs) == report["tiers"][tier["path"]]["subgroups"], tier["path"]
    assert report["state_bytes_per_process"] == sum(e.layout.state_bytes for e in engines.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_muons_device_memory_in_the_plan_bounds_its_update_program(dtype, tmp_path):
    """The plan counts jax_mlpo.muon's device memory from Newton-Schulz compiled alone (its
    update's program exists only after init): at least, and close to, XLA's temporaries of the
    whole update program compiled after init."""
    cfg, params = _muon_on_tiny(tmp_path, [
        f"model_overrides={{param_dtype: {dtype}}}",
        "offload.subgroup_size=8192",  # three engines' pipelines in tiny.yaml's host cache
    ])  # fmt: skip
    tx = build_optimizer(cfg, use_optax=False)
    state = tx.init(params)
    try:
        whole = jax.jit(tx.update).lower(params, state, params).compile().memory_analysis()
    finally:
        jax_mlpo.close(state)
    planned = muon_update_bytes(cfg, use_optax=False)
    assert whole.temp_size_in_bytes <= planned <= 1.25 * whole.temp_size_in_bytes


def test_dry_run_names_the_host_cache_muons_engines_need(tmp_path):
    """Too small a host cache for Muon's three pipelines: the dry run reports the error the
    run's init raises, with the size to raise it to."""
    cfg, params = _muon_on_tiny(tmp_path, ["model_overrides={param_dtype: bfloat16}"])
    report = dry_run(cfg, 1)
    assert "raise host_cache to at least" in report["problem"]
    with pytest.raises(jax_mlpo.ConfigError) as raised:
        build_optimizer(cfg, use_optax=False).init(params)
    assert str(raised.value) == report["problem"]
