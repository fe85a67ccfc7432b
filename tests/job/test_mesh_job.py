"""The main job (experiments/pretrain.py) on a (2, 2) mesh of four CPU devices, in one process
and in two, against the same run on one device; the config's mesh section refused where it
does not fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.job.run_config import ConfigError, load_config
from jax_mlpo.testing.processes import free_port, run_local

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "experiments" / "configs" / "tiny.yaml")


def _pretrain(devices: int, run_dir: Path, cache: Path, *sets: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)}
    argv = [sys.executable, str(ROOT / "experiments" / "pretrain.py"), "--config", TINY]
    for item in (f"run_dir={run_dir}", f"data.cache_dir={cache}", "report.plot=false", *sets):
        argv += [item] if item.startswith("--") else ["--set", item]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics-offload.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory) -> tuple[Path, list[float]]:
    """The tiny job's first 30 steps on one device (batch 8), and its data cache."""
    root = tmp_path_factory.mktemp("one-device")
    done = _pretrain(1, root / "run", root / "data-cache", "steps=30")
    assert done.returncode == 0, done.stderr[-8000:]
    return root / "data-cache", _losses(root / "run")


def _assert_follows(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference) == 30 and losses[-1] < losses[0]
    worst = max(abs(x - y) / abs(x) for x, y in zip(reference, losses, strict=True))
    assert worst <= 1e-3, f"losses differ by {worst:.3g} relative"


def test_tiny_job_on_a_2x2_mesh_follows_the_single_device_run(one_device_run, tmp_path):
    """The main job with its params on a (2, 2) fsdp x tensor mesh of four devices: the loss
    curve of the same run on one device, up to the order of the sharded reductions. It
    checkpoints at step 20, and its last 10 steps are a resume of that on one device."""
    cache, reference = one_device_run
    mesh = _pretrain(4, tmp_path / "mesh", cache, "steps=30", "mesh.shape=[2, 2]",
                     "checkpoint.every=20", "checkpoint.final=false")  # fmt: skip
    assert mesh.returncode == 0, mesh.stderr[-3000:]
    assert "mesh {'fsdp': 2, 'tensor': 2} over 4 devices of 1 process(es)" in mesh.stderr
    _assert_follows(_losses(tmp_path / "mesh"), reference)
    resumed = _pretrain(1, tmp_path / "mesh", cache, "steps=30", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 20" in resumed.stderr and "mesh {" not in resumed.stderr
    _assert_follows(_losses(tmp_path / "mesh"), reference)


def test_tiny_job_on_two_processes_of_two_devices(one_device_run, tmp_path):
    """The same on 2 processes x 2 devices, batch 4 per process (the same global batch)."""
    cache, reference = one_device_run
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}
    argv = [sys.executable, str(ROOT / "experiments" / "pretrain.py"), "--config", TINY]
    for item in (f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache}", "report.plot=false",
                 "steps=30", "batch_size=4", "mesh.shape=[2, 2]"):  # fmt: skip
        argv += ["--set", item]
    argv += ["--num-processes", "2", "--coordinator", f"127.0.0.1:{free_port()}"]
    logs = tmp_path / "logs"
    logs.mkdir()
    done = run_local([[*argv, "--process-id", str(k)] for k in range(2)], env, logs, 600)
    assert done.ok, "\n".join(text[-8000:] for text in done.logs)
    assert "mesh {'fsdp': 2, 'tensor': 2} over 4 devices of 2 process(es)" in done.logs[0]
    _assert_follows(_losses(tmp_path / "run"), reference)


def test_tiny_job_on_a_mesh_refuses_a_wrong_shape(tmp_path):
    done = _pretrain(4, tmp_path / "b", tmp_path / "data-cache", "mesh.shape=[3, 1]")
    assert done.returncode != 0 and "holds 3 devices, the job has 4" in done.stderr
    assert not (tmp_path / "b" / "metrics-offload.jsonl").exists()


@pytest.mark.parametrize(
    "item,message",
    [
        ("mesh.axes=[data, data]", "must name one or two distinct axes"),
        ("mesh.axes=[a, b, c]", "must name one or two distinct axes"),
        ("mesh.shape=[4]", "must give a positive size for each of mesh.axes"),
        ("mesh.shape=[2, 0]", "must give a positive size for each of mesh.axes"),
        ("mesh.shape=[two, 2]", "config key 'mesh.shape.0': Couldn't parse 'two' into an int"),
        ("mesh.axes=fsdp", "config key 'mesh.axes': must be a list"),
    ],
)
def test_mesh_config_errors(item, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [item])
