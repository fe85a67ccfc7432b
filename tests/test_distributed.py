"""Data-parallel jax_mlpo over several processes (jax.distributed on CPU, gloo collectives).

Each run spawns tests/dist_worker.py processes that call jax.distributed.initialize and train a
small MLP for 20 steps with optax.chain(clip_by_global_norm, jax_mlpo.adamw) on two file tiers;
the single-process run with the same global batch is the reference.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_mlpo import distributed

WORKER = pathlib.Path(__file__).with_name("dist_worker.py")
ROOT = str(WORKER.parents[1])
STEPS = 20
TIMEOUT_S = 80
TIERS = ("fast", "slow")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(nproc: int, base: pathlib.Path) -> tuple[dict, list[dict], float]:
    tiers, out = base / "tiers", base / "out"
    tiers.mkdir(parents=True)
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    port = _free_port()
    t0 = time.monotonic()
    logs = [open(base / f"log{k}.txt", "w+") for k in range(nproc)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(k),
                str(nproc),
                str(port),
                str(tiers),
                str(out),
                str(STEPS),
            ],
            env=env,
            stdout=logs[k],
            stderr=subprocess.STDOUT,
        )
        for k in range(nproc)
    ]
    try:
        deadline = t0 + TIMEOUT_S
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - t0
    text = []
    for k, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- process {k} ---\n{log.read()[-3000:]}")
        log.close()
    assert codes is not None, f"timed out after {TIMEOUT_S} s\n" + "\n".join(text)
    assert codes == [0] * nproc, f"exit codes {codes}\n" + "\n".join(text)
    params = dict(np.load(out / "params.npz"))
    infos = [json.loads((out / f"proc{k}.json").read_text()) for k in range(nproc)]
    return params, infos, elapsed


def _state_file_bytes(directory: pathlib.Path) -> int:
    """Bytes of the subgroup blobs (chunks of the ``state-*`` arrays) under ``directory``."""
    return sum(f.stat().st_size for d in directory.glob("state-*") for f in d.rglob("c/**/*")
               if f.is_file())  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("dp1")
    params, infos, elapsed = _run(1, base)
    print(f"single process: {elapsed:.1f} s")
    return base, params, infos[0]


def test_leaf_partition():
    assert distributed.leaf_spec((64, 3), 4) == P("data")
    assert distributed.leaf_spec((6, 3), 4) == P()
    assert distributed.leaf_spec((), 4) == P()
    assert distributed.leaf_spec((8,), 1) == P()
    assert distributed.local_shape((64, 3), 4) == (16, 3)
    assert distributed.local_shape((3, 5), 4) == (3, 5)


@pytest.mark.parametrize("nproc", [2, 4])
def test_data_parallel_matches_single_process(nproc, reference, tmp_path):
    ref_base, ref_params, ref_info = reference
    params, infos, elapsed = _run(nproc, tmp_path)
    print(f"{nproc} processes: {elapsed:.1f} s")

    # The same params as one process with the same global batch (fp32, 20 steps).
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        np.testing.assert_allclose(params[name], ref, rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(infos[0]["losses"], ref_info["losses"], rtol=1e-5)
    assert all(info["step_count"] == STEPS for info in infos)

    # Each process's engine holds its shards only (plus the replicated (3, 5) leaf), and used
    # the tiers (the state does not fit in host_cache).
    replicated = 2 * 4 * 15  # m and v of the replicated leaf
    expected = (ref_info["state_bytes"] - replicated) // nproc + replicated
    for k, info in enumerate(infos):
        assert not info["host_only"]
        assert info["state_bytes"] == expected
        assert info["tiers"] == [str(tmp_path / "tiers" / t / f"proc{k}") for t in TIERS]

    # Each process wrote to its own directory of every tier, about 1/N of the state.
    ref_disk = sum(_state_file_bytes(ref_base / "tiers" / t) for t in TIERS)
    ref_written = sum(ref_info["tier_bytes"].values())
    for t in TIERS:
        tier = tmp_path / "tiers" / t
        assert sorted(p.name for p in tier.iterdir() if p.is_dir()) == [
            f"proc{k}" for k in range(nproc)
        ]
        assert not list(tier.glob("state-*")), "state written outside the per-process dirs"
    for k, info in enumerate(infos):
        disk = sum(_state_file_bytes(tmp_path / "tiers" / t / f"proc{k}") for t in TIERS)
        written = sum(info["tier_bytes"].values())
        assert 0.7 / nproc < disk / ref_disk < 1.4 / nproc, (k, disk, ref_disk)
        assert 0.7 / nproc < written / ref_written < 1.4 / nproc, (k, written, ref_written)
