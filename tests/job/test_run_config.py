"""Tests for experiments/job/run_config.py: how the YAML file and ``--set`` overrides are read.

The errors for bad values and keys are in tests/job/test_pretrain.py (through the command line).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import jax_mlpo
from experiments.job import run_config
from jax_mlpo import FileTier, OffloadConfig, parse_size

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "experiments" / "configs").glob("*.yaml"))
BEYOND_RAM = str(ROOT / "experiments" / "configs" / "beyond-ram.yaml")
TINY = str(ROOT / "experiments" / "configs" / "tiny.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_reads_back_from_its_yaml(path, tmp_path):
    cfg = run_config.load_config(str(path), [f"run_dir={tmp_path}"])
    resolved = tmp_path / "config.yaml"
    resolved.write_text(run_config.to_yaml(cfg))
    assert run_config.load_config(str(resolved)) == cfg


def test_overrides_merge_into_sections_in_order():
    cfg = run_config.load_config(
        BEYOND_RAM, ["model_overrides={layers: 2}", "model_overrides.ffn=64"]
    )
    assert cfg.model_overrides == {
        "layers": 2, "hidden": 2560, "heads": 20, "kv_heads": 4, "ffn": 64, "remat": True
    }  # fmt: skip
    cfg = run_config.load_config(
        BEYOND_RAM, ["model_overrides=null", "model_overrides={layers: 2}"]
    )
    assert cfg.model_overrides == {"layers": 2}
    cfg = run_config.load_config(TINY, ["steps=5", "steps=7", "offload.tiers=[/a, {path: /b}]"])
    assert cfg.steps == 7 and [t.path for t in cfg.offload.tiers] == ["/a", "/b"]


def test_a_field_offload_config_gains_is_read_and_typed(monkeypatch, tmp_path):
    @dataclasses.dataclass(frozen=True)
    class Offload(jax_mlpo.OffloadConfig):
        read_ahead: bool = True

    monkeypatch.setattr(jax_mlpo, "OffloadConfig", Offload)
    cfg = run_config.load_config(TINY, ["offload.read_ahead=false", f"run_dir={tmp_path}"])
    assert isinstance(cfg.offload, Offload) and cfg.offload.read_ahead is False
    assert cfg.offload.host_cache == 2**20 and len(cfg.offload.tiers) == 2
    resolved = tmp_path / "config.yaml"
    resolved.write_text(run_config.to_yaml(cfg))
    assert run_config.load_config(str(resolved)) == cfg
    with pytest.raises(run_config.ConfigError, match="'offload.read_ahead': Couldn't parse 'x'"):
        run_config.load_config(TINY, ["offload.read_ahead=x"])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_experiment_configs_offload_sections_load(path):
    section = yaml.safe_load(path.read_text())["offload"]
    config = OffloadConfig.from_dict(section)
    assert config.host_cache == parse_size(section["host_cache"], "host_cache")
    assert len(config.tiers) == len(section.get("tiers", ()))
    for tier, given in zip(config.tiers, section.get("tiers", ()), strict=True):
        assert isinstance(tier, FileTier) and tier.path == given["path"]
