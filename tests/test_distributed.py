"""Data-parallel jax_mlpo over several processes (jax.distributed on CPU, gloo collectives).

Each run spawns tests/dist_worker.py processes that call jax.distributed.initialize and train a
small MLP for 20 steps with optax.chain(clip_by_global_norm, jax_mlpo.adamw) on two file tiers;
the single-process run with the same global batch is the reference. Node-level permits are
checked on the merged request traces of two processes sharing a tier.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from processes import STEPS, run_data_parallel

from jax_mlpo.engine.step_metrics import StepMetrics
from jax_mlpo.sharding import processes as distributed

TIERS = ("fast", "slow")
_run = run_data_parallel


def _state_file_bytes(directory: pathlib.Path) -> int:
    """Bytes of the subgroup blobs under ``directory``: ``state-<slot>.blob`` files (the posix
    I/O engine) or the chunks of the ``state-*`` zarr3 arrays (tensorstore)."""
    total = 0
    for entry in directory.glob("state-*"):
        files = [entry] if entry.is_file() else entry.rglob("c/**/*")
        total += sum(f.stat().st_size for f in files if f.is_file())
    return total


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(nproc, mode)``: dist_worker's job on ``nproc`` processes in its ``mode``, run once
    a module: the runs that several tests compare with (the 2-process plain and fused-clip
    loops) start their processes once. Returns the run's directory, params and JSONs."""
    done = {}

    def run(nproc: int, mode: str = "plain") -> tuple[pathlib.Path, dict, list[dict]]:
        if (nproc, mode) not in done:
            base = tmp_path_factory.mktemp(f"dp{nproc}-{mode}")
            params, infos, elapsed = _run(nproc, base, mode=mode)
            print(f"{nproc} processes, {mode}: {elapsed:.1f} s")
            done[nproc, mode] = base, params, infos
        return done[nproc, mode]

    return run


@pytest.fixture(scope="module")
def reference(runs):
    base, params, infos = runs(1)
    return base, params, infos[0]


def test_leaf_partition():
    assert distributed.leaf_spec((64, 3), 4) == P("data")
    assert distributed.leaf_spec((6, 3), 4) == P()
    assert distributed.leaf_spec((), 4) == P()
    assert distributed.leaf_spec((8,), 1) == P()
    assert distributed.local_shape((64, 3), 4) == (16, 3)
    assert distributed.local_shape((3, 5), 4) == (3, 5)


def test_fused_clipping_takes_the_global_norm_over_processes(reference, runs):
    """adamw(max_grad_norm=...) on 2 processes: each process's host update scales its shards
    by the norm of the whole gradient (taken over both processes' shards), as the chained
    optax.clip_by_global_norm does on 1 process (the clip is active on every step)."""
    _, ref_params, ref_info = reference
    _, params, infos = runs(2, "fused-clip")
    for name, ref in ref_params.items():
        np.testing.assert_allclose(params[name], ref, rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(infos[0]["losses"], ref_info["losses"], rtol=1e-5)


def test_inject_hyperparams_on_two_processes(reference, tmp_path):
    """optax.inject_hyperparams(jax_mlpo.adamw) on 2 processes: each process's re-created
    transformation finds its own engine (one per process, no new tiers), and the run is the
    single-process one (the learning rate and weight decay now float32 arrays)."""
    _, ref_params, ref_info = reference
    params, infos, _ = _run(2, tmp_path, mode="inject")
    assert [info["engines"] for info in infos] == [1, 1]
    assert all(info["step_count"] == STEPS for info in infos)
    for name, ref in ref_params.items():
        np.testing.assert_allclose(params[name], ref, rtol=0, atol=1e-6, err_msg=name)


def test_overlapped_step_on_two_processes_follows_the_plain_loop(runs, tmp_path):
    """jax_mlpo.overlapped_step on 2 processes: each process's engine takes its group calls
    (one per group of layers) and hands the first groups back before its update ends; by
    order, each process's first matmul ran while the read of the last subgroup its update
    reads was held (had the forward pass waited for the update, the hold would have ended at
    its 60 s limit first). With the chain's ``optax.clip_by_global_norm`` the params are within
    optax's tolerance of the 2-process plain loop's, not bit for bit: that norm is the user's
    own reduction, compiled with each program (1.2e-7 seen; bit for bit without it, below)."""
    _, plain, _ = runs(2)
    params, infos, _ = _run(2, tmp_path, mode="overlap")
    for info in infos:  # every update but the first step's (none) and the flush ran in groups
        assert info["step_count"] == STEPS
        assert all(b > 0 for b in info["beside_s"][:-1]) and info["beside_s"][-1] == 0
        assert info["held"] == {"unfinished": [True], "outcomes": ["hung"]}
    assert params.keys() == plain.keys()
    for name, ref in plain.items():
        np.testing.assert_allclose(params[name], ref, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("clip", ["no-clip", "fused-clip"])
def test_overlapped_step_on_two_processes_is_the_plain_loop_bit_for_bit(clip, runs, tmp_path):
    """Without clipping, and with adamw's ``max_grad_norm`` (its norm summed in one order in
    both programs), the overlapped step on 2 processes is the 2-process plain loop bit for
    bit, and overlapped (each process's first matmul ran while its last read was held)."""
    _, plain, _ = runs(2, clip)
    params, infos, _ = _run(2, tmp_path, mode=f"overlap-{clip}")
    for info in infos:
        assert info["step_count"] == STEPS
        assert info["held"] == {"unfinished": [True], "outcomes": ["hung"]}
    assert params.keys() == plain.keys()
    for name, ref in plain.items():
        np.testing.assert_array_equal(params[name], ref, err_msg=name)


@pytest.mark.parametrize("nproc", [2, 4])
def test_data_parallel_matches_single_process(nproc, reference, runs):
    ref_base, ref_params, ref_info = reference
    base, params, infos = runs(nproc)

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
        assert info["tiers"] == [str(base / "tiers" / t / f"proc{k}") for t in TIERS]

    # Each process's figures of its last update with the keys of every other process: the
    # per-tier ones under the tier as configured, not the process's directory of it, for a job
    # to gather (the pre-training job's aggregation: tests/job/test_metrics.py).
    own = [info["own"] for info in infos]
    assert all(sorted(o) == sorted(own[0]) for o in own)
    shared = {f"bytes_read:{base / 'tiers' / t}" for t in TIERS}
    assert shared <= set(own[0])
    for o in own:
        back = StepMetrics.from_flat(STEPS, o)
        assert back.as_flat() == o and back.subgroups == o["subgroups"] > 0
        assert set(back.bytes_read) == {k.partition(":")[2] for k in shared}

    # Each process wrote to its own directory of every tier, about 1/N of the state.
    ref_disk = sum(_state_file_bytes(ref_base / "tiers" / t) for t in TIERS)
    ref_written = sum(ref_info["tier_bytes"].values())
    for t in TIERS:
        tier = base / "tiers" / t
        assert sorted(p.name for p in tier.iterdir() if p.is_dir()) == [
            f"proc{k}" for k in range(nproc)
        ]
        assert not list(tier.glob("state-*")), "state written outside the per-process dirs"
    for k, info in enumerate(infos):
        disk = sum(_state_file_bytes(base / "tiers" / t / f"proc{k}") for t in TIERS)
        written = sum(info["tier_bytes"].values())
        assert 0.7 / nproc < disk / ref_disk < 1.4 / nproc, (k, disk, ref_disk)
        assert 0.7 / nproc < written / ref_written < 1.4 / nproc, (k, written, ref_written)


def _overlaps(infos: list[dict], tier: str, direction: str) -> list[tuple]:
    """Pairs of requests of ``direction`` ("any": either) on ``tier`` from different processes
    that overlap in time (the traces' times are time.monotonic, one clock for every process of
    the machine)."""
    spans = [(t0, t1, k) for k, info in enumerate(infos)
             for name, _slot, t0, t1 in info["traces"][tier]
             if direction in (name, "any")]  # fmt: skip
    spans.sort()
    pairs = []
    for i, (a0, a1, ka) in enumerate(spans):
        for b0, b1, kb in spans[i + 1 :]:
            if b0 >= a1:
                break  # sorted by start: no later span starts before a ends
            if kb != ka:
                pairs.append(((a0, a1, ka), (b0, b1, kb)))
    return pairs


@pytest.fixture(scope="module")
def permit_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Two processes sharing a tier with max_concurrency=1: with node-level permits and without."""
    runs = {}
    for mode in ("process-permits", "node-permits"):
        _, infos, elapsed = _run(2, tmp_path_factory.mktemp(mode), mode, steps=8)
        print(f"{mode}: {elapsed:.1f} s")
        runs[mode] = infos
    return runs


@pytest.mark.parametrize("direction", ["read", "write", "any"])
def test_node_permits_admit_one_process_at_a_time(permit_runs, direction):
    for mode, infos in permit_runs.items():
        tier = next(t for t in infos[0]["traces"] if t.endswith("slow"))
        for info in infos:
            spans = [r for r in info["traces"][tier] if direction in (r[0], "any")]
            assert len(spans) >= 20, (mode, len(spans))  # the tier was used every step
        overlaps = _overlaps(infos, tier, direction)
        if mode == "node-permits":
            # node_max_concurrency=1: at most one process in the tier at a time, reads and
            # writes alike (FileTier.node_permits="tier")
            assert overlaps == [], f"{len(overlaps)} overlaps, e.g. {overlaps[:3]}"
        else:
            # The control: max_concurrency=1 per process only, the processes do overlap.
            assert len(overlaps) >= 3, overlaps
