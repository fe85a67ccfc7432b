"""jax_mlpo.checkpoint with several processes: a checkpoint written by 2 processes restores onto
1 and onto 4, with other subgroups and tiers, and the next step is exact.

tests/ckpt_dist_worker.py runs the job (tests/dist_worker.py's MLP, data parallel under
jax.distributed on CPU). The 2-process run trains 6 steps, saves, and takes two more steps
while the checkpoint is written: an *exact* step (gradients of the whole batch computed by the
same operations in any process count) and an ordinary data-parallel one (it saved at steps
3-5 too, keeping two, so the last save rewrote the files of the first). The 1- and 4-process
runs restore the checkpoint and take the same two steps; the 1-process run then restores a copy
with a flipped byte in a file process 1 wrote, and the 4-process run does it on every process.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from processes import ROOT, run_workers

from jax_mlpo import checkpoint
from jax_mlpo.checkpoint.manifest import CHECKSUMS_FILE
from jax_mlpo.testing.processes import free_port

WORKER = pathlib.Path(__file__).with_name("ckpt_dist_worker.py")
STEPS = 6
TIMEOUT_S = 120
LEAVES = ("b1", "b2", "odd", "w1", "w2")  # jax.tree order
SHAPES = {"b1": (64,), "b2": (16,), "odd": (3, 5), "w1": (64, 64), "w2": (64, 16)}


def _run(nproc: int, base: pathlib.Path, spec: dict) -> dict:
    """Runs the worker on ``nproc`` processes; returns process 0's results and every info."""
    out = base / f"out{nproc}"
    out.mkdir()
    for tier in spec["tiers"]:
        os.makedirs(tier, exist_ok=True)
    spec = {**spec, "out": str(out), "steps": STEPS}
    elapsed = run_workers(
        WORKER,
        nproc,
        lambda k, port: [str(k), str(nproc), str(port), json.dumps(spec)],
        out,
        TIMEOUT_S,
    )
    print(f"{spec['mode']} on {nproc} process(es): {elapsed:.1f} s")
    with np.load(out / "result.npz") as f:
        result = {k: f[k] for k in f.files}
    infos = [json.loads((out / f"proc{k}.json").read_text()) for k in range(nproc)]
    return {"result": result, "infos": infos}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The 2-process training run, then restores onto 1 and 4 processes with other layouts."""
    base = tmp_path_factory.mktemp("ckpt_dp")
    ckpt = str(base / "ckpt")

    def tiers(name: str, count: int) -> list[str]:
        return [str(base / name / f"tier{i}") for i in range(count)]

    # three checkpoints before the last, which rewrites the files of the first (4 KiB arrays)
    trained = _run(2, base, {"mode": "train", "ckpt": ckpt, "tiers": tiers("train", 2),
                             "subgroup_size": 64, "recycle_bytes": 4096})  # fmt: skip
    one = _run(1, base, {"mode": "restore", "ckpt": ckpt, "tiers": tiers("one", 1),
                         "subgroup_size": 100, "corrupt": True})  # fmt: skip
    four = _run(4, base, {"mode": "restore", "ckpt": ckpt, "tiers": tiers("four", 3),
                          "subgroup_size": 48, "corrupt": True})  # fmt: skip
    return {"base": base, "ckpt": pathlib.Path(ckpt), 2: trained, 1: one, 4: four}


def _assert_bits_equal(got: dict, want: dict, prefix: str) -> None:
    keys = sorted(k for k in want if k.startswith(prefix + "/"))
    assert keys and keys == sorted(k for k in got if k.startswith(prefix + "/"))
    for k in keys:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k, strict=True)


def test_the_checkpoint_is_the_global_state_written_by_each_process(runs):
    step = runs["ckpt"] / str(STEPS)
    # orbax's multi-process layout for the params (zarr3 without OCDBT): a chunk file per shard,
    # each written by the process holding it; a replicated leaf is one chunk
    for leaf in ("w1", "w2"):
        chunks = sorted(p.name for p in (step / "params" / f"tree.{leaf}" / "c").iterdir())
        assert chunks == ["0", "1"], (leaf, chunks)
    assert [p.name for p in (step / "params" / "tree.odd" / "c").iterdir()] == ["0"]
    for item in ("params", "opt_state"):
        # one manifest, merged from the processes' digests, covering every leaf
        assert not list((step / item).glob("jax_mlpo_checksums.process_*"))
    # the offloaded state: each process streamed its shards into arrays of its own
    streamed = step / "opt_state" / "jax_mlpo_state" / "0"
    assert sorted(p.name for p in streamed.iterdir()) == ["process_0", "process_1"]
    leaves = checkpoint.OffloadCheckpointHandler().metadata(step / "opt_state")
    for name in ("mu", "nu"):
        for i, leaf in enumerate(LEAVES):
            record = leaves[f"tree/1/{name}/{i}"]  # chain member 1: jax_mlpo.adamw's state
            assert record["shape"] == list(SHAPES[leaf])  # the global shape
            shards = [(s["start"], s["size"], s["array"]) for s in record["shards"]]
            size = int(np.prod(SHAPES[leaf]))
            if leaf == "odd":  # replicated over the processes: saved once, whole, by process 0
                assert shards == [(0, size, f"jax_mlpo_state/0/process_0/{name}.{i}")]
            else:  # each process's rows, flattened: a contiguous half
                half = size // 2
                assert shards == [
                    (0, half, f"jax_mlpo_state/0/process_0/{name}.{i}"),
                    (half, half, f"jax_mlpo_state/0/process_1/{name}.{i}"),
                ]
    assert leaves["tree/1/count"]["shape"] == []
    params = checkpoint.OffloadCheckpointHandler().metadata(step / "params")
    assert len(params["tree/w1"]["shards"]) == 2 and "digest" in params["tree/odd"]
    # the processes' saves rewrote the files of the checkpoint deleted before the last one
    rewritten = [info["rewritten"] for info in runs[2]["infos"]]
    assert sum(rewritten) > 0, rewritten


@pytest.mark.parametrize("nproc", [1, 4])
def test_restore_onto_other_process_counts_is_exact(nproc, runs):
    trained, restored = runs[2], runs[nproc]
    tiers = {1: ("one", 1), 4: ("four", 3)}[nproc]
    for k, info in enumerate(restored["infos"]):
        assert info["restored"] == {"step": STEPS, "extra": {"step": STEPS, "seed": 7}}
        # each process's engine holds its shards only (the (3, 5) leaf is replicated), in its
        # own directories of the restoring run's tiers
        expect = [[SHAPES[leaf][0] // nproc, *SHAPES[leaf][1:]] for leaf in LEAVES]
        expect[LEAVES.index("odd")] = [3, 5]
        assert info["shapes"] == expect
        assert not info["host_only"]
        dirs = [runs["base"] / tiers[0] / f"tier{i}" for i in range(tiers[1])]
        assert info["tiers"] == [str(d / f"proc{k}" if nproc > 1 else d) for d in dirs]
        assert info["step_count"] == STEPS + 2
        # Each process read whole saved shards, only those overlapping its own: with 4
        # processes, the half of each split leaf that process 0 or 1 saved, holding its quarter.
        assert len(info["reads"]) == len(LEAVES) + 1  # params; adamw's count
        # the offloaded state's chunks: only from the saved shards overlapping its own (with 4
        # processes, process k's quarter lies in the half process k // 2 saved)
        for i, leaf in enumerate(LEAVES):
            for name in ("mu", "nu"):
                read = {a for a in info["arrays"] if a.endswith(f"/{name}.{i}")}
                savers = [0] if leaf == "odd" else [k // 2] if nproc == 4 else [0, 1]
                assert read == {f"jax_mlpo_state/0/process_{j}/{name}.{i}" for j in savers}
        for read in info["reads"]:
            rows = read["shape"][0] if read["shape"] else None
            if nproc == 1 or read["saved"] == 1:  # one process, or a leaf saved whole
                assert read["rows"] == ([0, rows] if rows else [])
            else:
                half = k // 2
                assert read["saved"] == 2 and read["rows"] == [half * rows // 2,
                                                               (half + 1) * rows // 2]  # fmt: skip
    # The restored state is the saved one, bit for bit: params, and m and v of every leaf
    # (gathered from the engines' shards).
    _assert_bits_equal(restored["result"], trained["result"], "params")
    _assert_bits_equal(restored["result"], trained["result"], "state")
    # The next step from it is bit for bit the uninterrupted 2-process run's.
    _assert_bits_equal(restored["result"], trained["result"], "exact")


@pytest.mark.parametrize("nproc", [1, 4])
def test_a_data_parallel_step_after_restore_differs_only_by_reduction_order(nproc, runs):
    """The ordinary data-parallel step is exact on the state but sums each process's partial
    gradients across processes (the loss's mean over the batch, the clipping norm): with 1 or 4
    processes the fp32 additions run in another order than with 2, so the gradients differ in
    their last bits; AdamW then moves each param by at most about lr (1e-2 here) times a
    bounded ratio, so the params differ by float32 rounding only."""
    got, want = runs[nproc]["result"], runs[2]["result"]
    for leaf in LEAVES:
        # measured: at most 1 ulp of the param (3e-8 for |p| < 0.5) in 1-5% of the elements
        np.testing.assert_allclose(got[f"dp/{leaf}"], want[f"dp/{leaf}"], rtol=1e-6, atol=1e-7,
                                   err_msg=leaf)  # fmt: skip


@pytest.mark.parametrize("nproc", [1, 4])
def test_a_corrupt_file_of_the_multiprocess_save_is_detected(nproc, runs):
    for info in runs[nproc]["infos"]:
        assert "/process_1/" in info["corrupted"]
        # every process refuses it, whichever of them read the flipped byte
        assert info["corrupt_restore"].startswith("CorruptCheckpointError"), info


def test_a_manifest_missing_a_process_s_shard_is_refused(runs, tmp_path):
    """The manifest must cover every leaf exactly once: without one process's digests of a leaf
    (resealed, as if written so), the checkpoint is refused before anything is read."""
    manifest = json.loads((runs["ckpt"] / str(STEPS) / "opt_state" / CHECKSUMS_FILE)
                          .read_text())  # fmt: skip
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    body["streamed"]["tree/1/mu/3"]["shards"].pop()  # w1's rows of process 1
    sealed = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    (tmp_path / CHECKSUMS_FILE).write_text(json.dumps({**body, "sha256": sealed}))
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match="array tree/1/mu/3 do not cover it"
    ):
        checkpoint.OffloadCheckpointHandler().metadata(tmp_path)


KILL_WORKER = pathlib.Path(__file__).with_name("ckpt_kill_worker.py")


def test_a_process_killed_during_a_save_leaves_the_last_checkpoint(tmp_path):
    """Process 1 of 2 dies (SIGKILL) while checkpoint 4 is being saved asynchronously; the job
    is then stopped, as a launcher stops it. Checkpoint 3 is intact and the latest the manager
    sees (4 was never published), and it restores, verified, onto 1 process with the params
    the run had at step 3, bit for bit."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    spec = {"mode": "train", "ckpt": str(ckpt), "tier": str(tmp_path / "tier"), "out": str(out)}
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    port = free_port()
    logs = [open(tmp_path / f"log{k}.txt", "w+") for k in range(2)]  # noqa: SIM115
    procs = [
        subprocess.Popen([sys.executable, str(KILL_WORKER), str(k), "2", str(port),
                          json.dumps(spec)], env=env, stdout=log, stderr=subprocess.STDOUT)
        for k, log in enumerate(logs)
    ]  # fmt: skip
    try:
        code1 = procs[1].wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:  # process 0 waits for process 1's part of the save: stop it
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    assert code1 == -9, texts[1][-3000:]  # killed, by itself, during the save of step 4
    assert "SAVED" not in texts[0], texts[0][-3000:]  # process 0 never saw step 4 finish

    mngr = checkpoint.manager(str(ckpt))
    assert mngr.all_steps() == [3] and mngr.latest_step() == 3
    mngr.close()
    spec = {**spec, "mode": "restore", "tier": str(tmp_path / "tier-restore")}
    run_workers(KILL_WORKER, 1, lambda k, port: [str(k), "1", str(port), json.dumps(spec)],
                tmp_path, TIMEOUT_S)  # fmt: skip
    with np.load(out / "saved.npz") as saved, np.load(out / "restored.npz") as restored:
        assert int(restored["step"]) == 3
        for name in saved.files:
            np.testing.assert_array_equal(restored[name], saved[name], err_msg=name, strict=True)
