"""Checkpoints that stream the offloaded state: larger than the host cache, written while
training goes on, killed in the middle of such a save.

The job is tests/crash_worker.py's (an MLP of 263K params under optax.chain(clip_by_global_norm,
add_noise, jax_mlpo.adamw)); the arrays are cut into chunks of an odd length here, so that
chunks straddle subgroups and leaves.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import crash_worker as job
import jax
import numpy as np
import pytest
import tensorstore as ts
from checkpoint_job import (
    WORKER,
    assert_bits_equal,
    assert_states_equal,
    flip,
    logical_state,
    run_worker,
    spec_for,
    start_job,
)

import jax_mlpo
from jax_mlpo import checkpoint
from jax_mlpo.checkpoint import digest, host_arrays, state_reader, stream
from jax_mlpo.checkpoint.blocks import Region, full, volume
from jax_mlpo.checkpoint.manifest import CHECKSUMS_FILE
from jax_mlpo.checkpoint.space import space_needed
from jax_mlpo.engine.layout import build_layout, gather_state, scatter_state


def test_a_state_8x_the_host_cache_restores_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(stream, "CHUNK_ELEMS", 4099)  # pieces of 4096: whole pages
    spec = spec_for(tmp_path / "a", "bfloat16", 1, "none", False, subgroup_size=8191)
    tx, update, params, opt_state = start_job(spec)
    engine = jax_mlpo.engine_of(opt_state)
    assert engine.layout.state_bytes >= 8 * engine.config.host_cache
    params, opt_state, _ = job.train(update, params, opt_state, 0, 2)
    saved_state = logical_state(opt_state)
    mngr = checkpoint.manager(spec["ckpt"])
    checkpoint.save(mngr, 2, params, opt_state, {"step": 2})  # streamed while step 3 runs
    want, opt_state, _ = job.train(update, params, opt_state, 2, 3)
    mngr.wait_until_finished()
    jax_mlpo.close(opt_state)
    item = Path(spec["ckpt"]) / "2" / "opt_state"
    record = checkpoint.OffloadCheckpointHandler().metadata(item)["tree/2/mu/2"]  # w1's
    (shard,) = record["shards"]
    assert (shard["size"], shard["chunk"], len(shard["digest"])) == (131072, 4096, 32)
    # a zarr3 array any tensorstore user reads
    w1 = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(item / shard["array"])}}
    ).result()
    np.testing.assert_array_equal(w1.read().result(), saved_state["mu"][2].reshape(-1))

    # onto 3 tiers, other subgroups (not multiples of the chunk), the pipeline's cache only
    other = spec_for(tmp_path / "b", "bfloat16", 3, "none", False, subgroup_size=5003)
    _, update, fresh, opt_state = start_job(other)
    restored = checkpoint.restore(mngr, fresh, opt_state)
    assert_states_equal(logical_state(restored.opt_state), saved_state)
    got, opt_state, _ = job.train(update, restored.params, restored.opt_state, 2, 3)
    assert_bits_equal(job.as_bits(got), job.as_bits(want))
    jax_mlpo.close(opt_state)
    mngr.close()


def test_a_corrupt_chunk_fails_the_restore_before_the_state_is_used(tmp_path):
    spec = spec_for(tmp_path / "a", "float32", 1, "none", False)
    _, update, params, opt_state = start_job(spec)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 1)
    mngr = checkpoint.manager(spec["ckpt"], async_save=False)
    checkpoint.save(mngr, 1, params, opt_state)
    jax_mlpo.close(opt_state)
    chunk = Path(spec["ckpt"]) / "1" / "opt_state" / "jax_mlpo_state" / "0" / "process_0"
    chunk = chunk / "nu.3" / "c" / "0"  # the array's data (one zarr3 chunk)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 1
    chunk.write_bytes(bytes(data))
    _, _, fresh, opt_state = start_job(spec_for(tmp_path / "b", "float32", 1, "none", False))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"nu\.3: piece 0 does not match"):
        checkpoint.restore(mngr, fresh, opt_state)
    # the engine's state is partly replaced: it refuses to go on
    with pytest.raises(jax_mlpo.EngineFailedError, match="Restore from your last checkpoint"):
        jax_mlpo.engine_of(opt_state).state_dict()
    jax_mlpo.close(opt_state)
    mngr.close()


def _as_format_4(value):
    """A manifest's body as format 4 recorded it: every ``digest`` key named ``sha256``."""
    if isinstance(value, dict):
        return {("sha256" if k == "digest" else k): _as_format_4(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_format_4(v) for v in value]
    return value


def test_a_format_4_checkpoint_of_sha256s_still_restores_and_is_checked(tmp_path, monkeypatch):
    """A checkpoint written before the digests became CRC-32C (format 5) restores exactly, its
    sha256s checked: a flipped byte in a piece is still caught."""

    spec = spec_for(tmp_path / "a", "float32", 1, "none", False)
    _, update, params, opt_state = start_job(spec)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 2)
    saved_state, saved_params = logical_state(opt_state), job.as_bits(params)
    mngr = checkpoint.manager(spec["ckpt"], async_save=False)
    with monkeypatch.context() as m:  # the writers digest as format 4 did
        m.setattr(digest, "of", functools.partial(digest.of, kind=digest.Sha256Digest))
        m.setattr(host_arrays, "Digest", digest.Sha256Digest)
        checkpoint.save(mngr, 2, params, opt_state)
    jax_mlpo.close(opt_state)
    step = Path(spec["ckpt"]) / "2"
    for item in ("params", "opt_state", "extra"):
        path = step / item / CHECKSUMS_FILE
        body = {k: v for k, v in json.loads(path.read_text()).items() if k != "sha256"}
        assert body["format"] == 5
        body = {**_as_format_4(body), "format": 4}
        sealed = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        path.write_text(json.dumps({**body, "sha256": sealed}))
    record = checkpoint.OffloadCheckpointHandler().metadata(step / "opt_state")["tree/2/mu/2"]
    assert len(record["shards"][0]["sha256"][0]) == 64  # a bare sha256, as format 4 had

    _, _, fresh, opt_state = start_job(spec_for(tmp_path / "b", "float32", 1, "none", False))
    restored = checkpoint.restore(mngr, fresh, opt_state)
    assert_states_equal(logical_state(restored.opt_state), saved_state)
    assert_bits_equal(job.as_bits(restored.params), saved_params)
    jax_mlpo.close(restored.opt_state)

    chunk = step / "opt_state" / "jax_mlpo_state" / "0" / "process_0" / "mu.2" / "c" / "0"
    flip(chunk, chunk.stat().st_size // 2)
    _, _, fresh, opt_state = start_job(spec_for(tmp_path / "c", "float32", 1, "none", False))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"mu\.2: piece 0 does not match"):
        checkpoint.restore(mngr, fresh, opt_state)
    jax_mlpo.close(opt_state)
    mngr.close()


def test_no_room_for_an_async_save_falls_back_or_fails_clearly(tmp_path, monkeypatch):
    spec = spec_for(tmp_path, "float32", 1, "none", False)
    _, update, params, opt_state = start_job(spec)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 1)
    mngr = checkpoint.manager(spec["ckpt"])
    need = space_needed(opt_state, spec["ckpt"], concurrent=True)
    # one file system: the checkpoint and the tier's copy-on-write room add up
    ((path, nbytes),) = need.items()
    state = jax_mlpo.engine_of(opt_state).layout.state_bytes
    assert 2 * state <= nbytes < 2 * state + 1024  # and the chain's scalars
    free = {"bytes": int(1.8 * state)}  # room for the checkpoint (and params), not the copies

    class Usage:
        def __init__(self, path):
            self.free = free["bytes"]

    monkeypatch.setattr(checkpoint.space.shutil, "disk_usage", Usage)
    message = r"while training goes on needs 5\.3 MB .*blocking=True"  # state x 2 + params
    with pytest.raises(checkpoint.CheckpointSpaceError, match=message):
        checkpoint.save(mngr, 1, params, opt_state, blocking=False)
    assert mngr.all_steps() == []
    checkpoint.save(mngr, 1, params, opt_state)  # blocking=None: synchronous, logged
    assert mngr.all_steps() == [1]
    free["bytes"] = state // 2
    with pytest.raises(checkpoint.CheckpointSpaceError, match="keep fewer checkpoints"):
        checkpoint.save(mngr, 2, params, opt_state)
    jax_mlpo.close(opt_state)
    mngr.close()


def test_a_kill_during_an_async_save_while_training_resumes_exactly(tmp_path, worker_env):  # noqa: F811
    """A save streamed slowly while the next updates run, killed before it is published: the
    checkpoint set holds the previous steps, and the run resumes from them to the
    uninterrupted params."""
    steps = 8
    spec = spec_for(tmp_path / "run", "bfloat16", 2, "part", True, steps=steps, save_every=2)
    spec["slow_stream"] = 0.1  # a save takes ~1 s, the updates between saves much less
    spec["direct_bytes"] = 64 << 10  # w1 and w2 written by jax_mlpo before save returns
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(spec)], env=worker_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    saving = None
    for line in proc.stdout:
        if line.startswith("saving 4"):
            saving = 4
        elif saving and line.startswith("step 5"):  # an update ran after save 4 returned
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert saving == 4 and proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    mngr = checkpoint.manager(spec["ckpt"])
    assert mngr.all_steps() == [2]  # 4 was in flight: not published; 2 intact
    mngr.close()
    run_worker(spec, worker_env)
    with np.load(spec["out"]) as out:
        assert int(out["start"]) == 2
        got = {k: out[k] for k in job.SHAPES}

    ref = spec_for(tmp_path / "ref", "bfloat16", 2, "part", True)
    _, update, params, opt_state = start_job(ref)
    params, opt_state, _ = job.train(update, params, opt_state, 0, steps)
    jax_mlpo.close(opt_state)
    assert_bits_equal(got, job.as_bits(params))
    jax.clear_caches()


@pytest.mark.parametrize("chunk", [4099, 2**21])
def test_arrays_of_any_size_round_trip_through_pieces(tmp_path, chunk):
    """Leaves of sizes around page and piece boundaries, subgroups that straddle them: what the
    writer streams, the reader gives back, into subgroups of another size."""
    sizes = [1, 3, 1023, 1024, 4097, 4098, 10_000]
    params = {f"p{i}": jax.ShapeDtypeStruct((n,), np.float32) for i, n in enumerate(sizes)}
    params["w"] = jax.ShapeDtypeStruct((37, 211), jax.numpy.bfloat16)
    saved = build_layout(params, 3001)
    rng = np.random.default_rng(0)
    blobs = [rng.standard_normal(sg.state_elems).astype(np.float32) for sg in saved.subgroups]
    shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
    flat = [Region(j, full(shape), 0, math.prod(shape)) for j, shape in enumerate(shapes)]
    writer = stream.StateWriter(tmp_path, "s", saved, flat, chunk_elems=chunk)
    shards = writer.write(zip(saved.subgroups, blobs, strict=True))
    assert sorted(shards) == sorted(
        [(q, leaf) for leaf in range(len(params)) for q in ("mu", "nu")] + [("master", 7)]
    )
    restoring = build_layout(params, 1777)
    records = {key: [record] for key, record in shards.items()}
    reader = state_reader.StateReader(tmp_path, records, shapes, flat, restoring.subgroups)
    got = [np.zeros(sg.state_elems, np.float32) for sg in restoring.subgroups]
    for sg, blob in zip(restoring.subgroups, got, strict=True):
        reader.fill(sg, blob)
    reader.close()
    state = {q: [np.zeros(s, np.float32) for s in saved.shapes] for q in ("mu", "nu", "master")}
    again = {q: [np.zeros(s, np.float32) for s in saved.shapes] for q in ("mu", "nu", "master")}
    for sg, blob in zip(saved.subgroups, blobs, strict=True):
        gather_state(sg, blob, state)
    for sg, blob in zip(restoring.subgroups, got, strict=True):
        gather_state(sg, blob, again)
    for q in ("mu", "nu"):
        for a, b in zip(state[q], again[q], strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(state["master"][7], again["master"][7])


# Two leaves cut three ways: blocks of a (2, 2) mesh (split on a later dimension, over both
# axes, replicated over one), blocks of a (4,) mesh, flat ranges (one device per process).
SHAPES = [(64, 96), (8, 24, 20)]
CUTS = {
    "mesh2x2": [[((0, 32), (0, 48)), ((0, 32), (48, 96)), ((32, 64), (0, 48)),
                 ((32, 64), (48, 96))], [((0, 8), (0, 12), (0, 20)), ((0, 8), (12, 24), (0, 20))]],
    "mesh4": [[((0, 64), (24 * k, 24 * k + 24)) for k in range(4)],
              [((2 * k, 2 * k + 2), (0, 24), (0, 20)) for k in range(4)]],
    "flat": [[(0, 2048), (2048, 6144)], [(0, 3840)]],
}  # fmt: skip


def _regions(cut: str) -> list[Region]:
    regions = []
    for leaf, (shape, parts) in enumerate(zip(SHAPES, CUTS[cut], strict=True)):
        for part in parts:
            if cut == "flat":
                regions.append(Region(leaf, full(shape), part[0], part[1] - part[0]))
            else:
                regions.append(Region(leaf, part, 0, volume(part)))
    return regions


def _engine_params(regions: list[Region]) -> list[jax.ShapeDtypeStruct]:
    dtypes = [np.float32, jax.numpy.bfloat16]  # the second leaf has a master copy
    return [jax.ShapeDtypeStruct((r.size,), dtypes[r.leaf]) for r in regions]


def _values(state: dict[str, np.ndarray], r: Region) -> np.ndarray:
    block = state[r.leaf][tuple(slice(a, b) for a, b in r.box)].reshape(-1)
    return block[r.start : r.start + r.size]


@pytest.mark.parametrize(
    "saved_cut,restored_cut",
    [("mesh2x2", "mesh4"), ("mesh2x2", "flat"), ("flat", "mesh2x2"), ("mesh4", "mesh4")],
)
def test_shards_cut_into_other_blocks_restore_each_element(tmp_path, saved_cut, restored_cut):
    """A state saved in one set of blocks (or flat ranges) comes back in another, element for
    element, through pieces smaller than the blocks and subgroups that straddle them."""
    rng = np.random.default_rng(3)
    state = {q: [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
             for q in ("mu", "nu", "master")}  # fmt: skip
    saved_regions = _regions(saved_cut)
    saved = build_layout(_engine_params(saved_regions), 1500)
    per_leaf = {q: [_values(state[q], r) for r in saved_regions] for q in state}
    blobs = []
    for sg in saved.subgroups:
        blobs.append(np.zeros(sg.state_elems, np.float32))
        scatter_state(sg, per_leaf, blobs[-1])
    writer = stream.StateWriter(tmp_path, "s", saved, saved_regions, chunk_elems=1024)
    shards = writer.write(zip(saved.subgroups, blobs, strict=True))
    records: dict = {}
    for (q, j), record in shards.items():
        records.setdefault((q, saved_regions[j].leaf), []).append(record)
    for (q, leaf), leaf_records in records.items():
        assert checkpoint.blocks.covers(SHAPES[leaf], leaf_records), (q, leaf)
    restored_regions = _regions(restored_cut)
    restoring = build_layout(_engine_params(restored_regions), 1100)
    reader = state_reader.StateReader(
        tmp_path, records, SHAPES, restored_regions, restoring.subgroups
    )
    got = {q: [np.zeros(r.size, np.float32) for r in restored_regions] for q in state}
    for sg in restoring.subgroups:
        blob = np.full(sg.state_elems, np.nan, np.float32)
        reader.fill(sg, blob)
        gather_state(sg, blob, got)
    reader.close()
    for q in state:
        for j, r in enumerate(restored_regions):
            if q != "master" or r.leaf == 1:
                np.testing.assert_array_equal(got[q][j], _values(state[q], r), err_msg=f"{q} {j}")


def test_a_process_that_writes_none_of_the_state_streams_nothing(tmp_path):
    """With several processes, one whose leaves are all replicated (process 0 writes those)
    writes no array of an offloaded state: its stream ends with no records and no error."""
    from jax_mlpo.checkpoint.snapshot import snapshot

    spec = spec_for(tmp_path / "a", "float32", 1, "none", False)
    _, update, params, opt_state = start_job(spec)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 1)
    _, streams = snapshot(opt_state)
    (one,) = streams
    one.skip = list(range(len(one.layout.shapes)))  # as a process > 0 with replicated leaves
    item = tmp_path / "item"
    item.mkdir()
    records = stream.write_streams(item, streams)
    assert records and all(r["shards"] == [] for r in records.values())  # process 0's to merge
    assert not (item / stream.STATE_DIR).exists()
    jax_mlpo.close(opt_state)
