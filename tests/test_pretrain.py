"""Tests for experiments/pretrain.py and experiments/report.py: the main job end to end, offload
against optax step by step, two processes against one, config errors, the dry run and every
shipped config."""

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments import pretrain, report
from models import get_preset, param_count

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "experiments" / "configs" / "tiny.yaml")
NODE = str(ROOT / "experiments" / "configs" / "7b-node.yaml")
CONFIGS = sorted((ROOT / "experiments" / "configs").glob("*.yaml"))
STEPS = 10


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


def _main(run_dir: Path, cache: Path, *extra: str) -> dict:
    return pretrain.main(
        [
            "--config",
            TINY,
            "--set",
            f"run_dir={run_dir}",
            "--set",
            f"data.cache_dir={cache}",
            "--set",
            f"steps={STEPS}",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict[str, dict]:
    """The tiny config for STEPS steps, with jax_mlpo (and its plot) and with optax.adamw."""
    run_dir = tmp_path_factory.mktemp("tiny")
    return {
        "offload": _main(run_dir, data_cache),
        "optax": _main(run_dir, data_cache, "--optimizer", "optax", "--set", "report.plot=false"),
    }


def test_tiny_config_runs_end_to_end(runs):
    result = runs["offload"]
    run_dir = result["metrics"].parent
    records = report.load_metrics(result["metrics"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert np.mean(result["losses"][-3:]) < result["losses"][0] - 0.2  # it learns
    for r in records:
        assert r["step_s"] >= r["fwd_bwd_s"] > 0 and r["update_s"] > 0 and r["tokens_per_s"] > 0
        assert r["subgroups"] == 10 and 0 <= r["cache_hit_rate"] <= 1
        assert len(r["tiers"]) == 2
        assert r["read_wait_s"] >= 0 and r["compute_s"] > 0 and r["write_wait_s"] >= 0
    # From step 2 on, subgroups not retained in host memory are read from and written to tiers.
    moved = sum(t["read_bytes"] + t["write_bytes"] for t in records[-1]["tiers"].values())
    assert moved > 0 and records[-1]["cache_hits"] < 10
    summary = json.loads((run_dir / "summary-offload.json").read_text())
    assert summary["median_s"]["step"] > 0 and set(summary["tiers"]) == set(records[0]["tiers"])
    assert "| forward + backward |" in (run_dir / "summary-offload.md").read_text()
    assert (run_dir / "pretrain-offload.png").stat().st_size > 10_000
    resolved = pretrain.load_config(str(run_dir / "config.yaml"))
    assert resolved.steps == STEPS and resolved.offload["tiers"][0]["path"].startswith(str(run_dir))


def test_offload_equals_optax_per_step(runs):
    offload, optax = runs["offload"]["losses"], runs["optax"]["losses"]
    assert len(offload) == len(optax) == STEPS
    # fp32 params: jax_mlpo follows optax.adamw operation by operation.
    np.testing.assert_allclose(offload, optax, rtol=0, atol=1e-5)
    records = report.load_metrics(runs["optax"]["metrics"])
    assert "tiers" not in records[0] and records[0]["update_s"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(runs, data_cache, tmp_path):
    """experiments/launch/single_node.sh with NPROCS=2 on CPU: two pretrain.py processes with
    batch_size 4 each train on the global batch of 8 rows of the single-process run: the same
    losses (fp32: only the order of the reductions differs); process 0 writes the metrics with
    the slowest process's step time."""
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    nvme.mkdir()
    pfs.mkdir()
    env = dict(
        os.environ,
        NPROCS="2",
        COORDINATOR_PORT=str(_free_port()),
        RUN_NAME="dp2",
        CONFIG=TINY,
        NVME_DIR=str(nvme),
        PFS_DIR=str(pfs),
        PYTHON=sys.executable,
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES="1",
    )
    argv = [str(ROOT / "experiments" / "launch" / "single_node.sh"), "--set", f"steps={STEPS}",
            "--set", "batch_size=4", "--set", f"data.cache_dir={data_cache}",
            "--set", "report.plot=false",
            # each process holds half of the state: a smaller cache and subgroups than the
            # single-process run (the numerics do not depend on them) keep the tiers in use
            "--set", "offload.host_cache=512KiB",
            "--set", "offload.subgroup_size=8192"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    run_dir = pfs / "jax_mlpo" / "dp2"
    other = (run_dir / "rank1.log").read_text() if (run_dir / "rank1.log").exists() else ""
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}\n{other[-3000:]}"

    records = report.load_metrics(run_dir / "metrics-offload.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    diff = np.abs(np.subtract([r["loss"] for r in records], runs["offload"]["losses"]))
    print(f"2 processes vs 1: max |loss difference| {diff.max():.2e} over {STEPS} steps")
    np.testing.assert_allclose(
        [r["loss"] for r in records], runs["offload"]["losses"], rtol=1e-5, atol=1e-6
    )
    for r in records:
        assert r["processes"] == 2 and len(r["per_process"]["step_s"]) == 2
        assert r["step_s"] == max(r["per_process"]["step_s"])  # the slowest process's
        assert r["step_s"] == r["per_process"]["step_s"][r["slowest_process"]]
        assert r["tokens_per_s"] == pytest.approx(8 * 128 / r["step_s"])  # the global batch
        assert set(r["tiers"]) == {str(nvme / "jax_mlpo" / "dp2" / "tier"),
                                   str(run_dir / "tier")}  # fmt: skip
    moved = sum(t["read_bytes"] + t["write_bytes"] for t in records[-1]["tiers"].values())
    assert moved > 0 and records[-1]["cache_hits"] < records[-1]["subgroups"]
    # Process 0 wrote the outputs; each process used its own directory of every tier.
    assert {p.name for p in run_dir.iterdir()} >= {
        "config.yaml", "metrics-offload.jsonl", "summary-offload.md", "summary-offload.json",
        "tier", "rank1.log",
    }  # fmt: skip
    assert sorted(p.name for p in (run_dir / "tier").iterdir()) == ["proc0", "proc1"]
    assert not (nvme / "jax_mlpo" / "dp2").exists()  # the NVMe tier is removed at the end
    assert "| parameters per process" in done.stderr and "| 2 |" in done.stderr  # dry run


def test_report_compares_runs_and_plots(runs, tmp_path):
    out = tmp_path / "report.png"
    summary = report.main(
        [str(runs["offload"]["metrics"]), str(runs["optax"]["metrics"]), "--out", str(out)]
    )
    assert summary["compare"]["steps"] == STEPS
    assert summary["compare"]["max_abs_loss_diff"] < 1e-5
    assert out.stat().st_size > 10_000


_BAD = (
    ("steps_word", ["steps=ten"], r"'steps' must be an integer, got 'ten'"),
    ("batch_float", ["batch_size=1.5"], r"'batch_size' must be an integer, got 1.5"),
    ("steps_mapping", ["steps={a: 1}"], r"'steps' must be an integer, got .*a mapping"),
    ("lr_word", ["optimizer.peak_lr=fast"], r"'optimizer.peak_lr' must be a number"),
    ("plot_number", ["report.plot=3"], r"'report.plot' must be true or false"),
    ("unknown_key", ["stepz=3"], r"unknown config key 'stepz'; did you mean 'steps'"),
    ("unknown_nested", ["optimizer.lr=1"], r"unknown config key 'optimizer.lr'"),
    ("section_as_value", ["data=default"], r"config key 'data' is a section"),
    ("value_as_section", ["steps.x=1"], r"config key 'steps' is 300 \(an int\), not a section"),
    ("no_equals", ["steps"], r"expected key=value"),
    ("unknown_preset", ["model=13X"], r"config key 'model': unknown model preset '13X'"),
    ("unknown_override", ["model_overrides.layerz=2"], r"'model_overrides.layerz'"),
    ("bad_override", ["model_overrides.heads=3"], r"'model_overrides'.*heads"),
    (
        "missing_text",
        ["data.source=text", "data.paths=[/no/such/file.txt]"],
        r"'data.paths\[0\]': data file '/no/such/file.txt' not found",
    ),
    (
        "missing_tokens",
        ["data.source=tokens", "data.paths=[/no/tokens.bin]"],
        r"'data.paths\[0\]'.*not found",
    ),
    ("paths_not_list", ["data.source=text", "data.paths=3"], r"'data.paths' must be a list"),
    ("text_without_paths", ["data.source=text"], r"set config key 'data.paths'"),
    ("bad_source", ["data.source=web"], r"'data.source' must be"),
    ("negative", ["steps=-1"], r"'steps' must be positive"),
    ("offload_size", ["offload.host_cache=lots"], r"config section 'offload': host_cache='lots'"),
    ("tiers_string", ["offload.tiers=/x"], r"'offload.tiers' must be a list"),
    ("offload_key", ["offload.cache=1"], r"config section 'offload': unknown key\(s\) \['cache'\]"),
)


@pytest.mark.parametrize("overrides,message", [b[1:] for b in _BAD], ids=[b[0] for b in _BAD])
def test_config_errors_name_the_key(overrides, message, tmp_path):
    argv = ["--config", TINY, "--set", f"run_dir={tmp_path}/run", "--dry-run"]
    for item in overrides:
        argv += ["--set", item]
    with pytest.raises(SystemExit, match=message):
        pretrain.main(argv)
    assert not (tmp_path / "run").exists()


def test_config_file_errors(tmp_path):
    with pytest.raises(SystemExit, match=r"config file '/no/such.yaml' not found"):
        pretrain.main(["--config", "/no/such.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text('steps: "ten"\nbatch_size: 4\n')
    with pytest.raises(pretrain.ConfigError, match=r"'steps' must be an integer, got 'ten'"):
        pretrain.load_config(str(bad))
    bad.write_text("- a list\n")
    with pytest.raises(pretrain.ConfigError, match=r"must hold a mapping"):
        pretrain.load_config(str(bad))


def test_overrides_and_yaml_values(tmp_path):
    cfg = pretrain.load_config(
        TINY,
        [
            f"run_dir={tmp_path}",
            "optimizer.peak_lr=3e-4",
            "offload.prefetch_depth=1",
            "model_overrides.layers=1",
            "data.source=text",
            f"data.paths=[{TINY}]",
        ],
    )
    assert cfg.optimizer.peak_lr == 3e-4  # YAML 1.1 reads 3e-4 as a string; accepted as float
    assert cfg.offload["prefetch_depth"] == 1 and cfg.data.paths == (TINY,)
    assert pretrain.resolve_model(cfg).layers == 1
    assert [t["path"] for t in cfg.offload["tiers"]] == [
        f"{tmp_path}/tiers/t0",
        f"{tmp_path}/tiers/t1",
    ]


def test_datasets_from_text_and_token_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 100)
    cfg = pretrain.load_config(
        TINY, ["data.source=text", f"data.paths=[{text}]", f"data.cache_dir={tmp_path}/c"]
    )
    assert pretrain.build_dataset(cfg, 256).tokens.size == 1200
    tokens = tmp_path / "t.bin"
    np.arange(1000, dtype="<u2").tofile(tokens)
    cfg = pretrain.load_config(TINY, ["data.source=tokens", f"data.paths=[{tokens}]"])
    assert pretrain.build_dataset(cfg, 1000).tokens.size == 1000
    with pytest.raises(ValueError, match="token id 999 >= vocab_size=256"):
        pretrain.build_dataset(cfg, 256)


def test_dry_run_280b_on_64_processes(tmp_path, caplog):
    caplog.set_level("INFO")
    run_dir = tmp_path / "never-created"
    t0 = time.perf_counter()
    plan = pretrain.main(
        [
            "--config",
            NODE,
            "--set",
            "model=280B",
            "--set",
            f"run_dir={run_dir}",
            "--processes",
            "64",
            "--dry-run",
        ]
    )
    assert time.perf_counter() - t0 < 10
    n = param_count(get_preset("280B"))
    assert plan["params"] == n > 2.7e11
    assert plan["params_per_process"] == math.ceil(n / 64)
    assert plan["state_bytes_per_process"] == 12 * math.ceil(n / 64)  # bf16: fp32 p, m, v
    assert plan["subgroups_per_process"] == math.ceil(n / 64 / 100_000_000)
    on_tiers = sum(t["bytes"] for t in plan["tiers"].values())
    assert on_tiers == plan["state_bytes_per_process"]
    assert sum(t["subgroups"] for t in plan["tiers"].values()) == plan["subgroups_per_process"]
    assert plan["host_bytes"] > plan["engine_host_bytes"] > 0 and plan["problem"] is None
    assert "| parameters " in caplog.text and "280,090,132,480" in caplog.text
    assert "host memory needed per process" in caplog.text
    assert not run_dir.exists()


def test_dry_run_fp32_state_and_problems():
    cfg = pretrain.load_config(TINY, ["offload.host_cache=1GiB"])
    plan = pretrain.dry_run(cfg, 1)
    assert plan["state_bytes_per_process"] == 8 * param_count(get_preset("tiny"))
    assert plan["tiers"] == {} and plan["problem"] is None
    plan = pretrain.dry_run(pretrain.load_config(TINY, ["offload.host_cache=64KiB"]), 1)
    assert "pipeline needs 6" in plan["problem"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_loads_and_validates(path):
    cfg = pretrain.load_config(str(path))
    model = pretrain.resolve_model(cfg)
    assert model.max_seq_len == cfg.seq_len
    plan = pretrain.dry_run(cfg, 1)
    assert plan["problem"] is None, plan["problem"]
    assert len(CONFIGS) >= 3
