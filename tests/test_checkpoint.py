"""jax_mlpo.checkpoint: exact resume in a new process, restore onto another layout, kill -9 at
random points of training, a full disk, and flipped bytes in checkpoints and tier blobs.

The job is tests/crash_worker.py's: an MLP of 263K params under optax.chain(clip_by_global_norm,
add_noise, jax_mlpo.adamw), so a checkpoint also carries add_noise's count and PRNG key and
adamw's count; the subprocesses run that file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import crash_worker as job
import jax.numpy as jnp
import numpy as np
import pytest
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
from jax_mlpo.checkpoint.manifest import CHECKSUMS_FILE
from jax_mlpo.engine.snapshot import StateSnapshot
from jax_mlpo.tiers.errors import TierFullError

PACKAGE = Path(jax_mlpo.__file__).parent

# -- exact resume in a new process ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    tiers: int
    cache: str  # "all" (host only), "part" (pipeline + 2 retained), "none" (pipeline only)
    retain: bool


# Each value of each dimension at least once: where the state lives (host memory only, one
# tier, two tiers), retention across steps (on, off) and param dtype (float32, bfloat16).
RESUME_CASES = [
    Case("host-only-fp32", "float32", 0, "all", True),
    Case("1tier-noretain-bf16", "bfloat16", 1, "none", False),
    Case("2tiers-retain-bf16", "bfloat16", 2, "part", True),
]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, worker_env):
    """Each case: 2 steps, save, 2 more steps here; then one new process (for all cases)
    restores each checkpoint and replays steps 3 and 4."""
    root = tmp_path_factory.mktemp("resume")
    expected, specs = {}, []
    for case in RESUME_CASES:
        spec = spec_for(root / case.name, case.dtype, case.tiers, case.cache, case.retain, steps=4)
        _, update, params, opt_state = start_job(spec)
        mngr = checkpoint.manager(spec["ckpt"])
        params, opt_state, _ = job.train(update, params, opt_state, 0, 2)
        checkpoint.save(mngr, 2, params, opt_state, {"step": 2})
        # the next steps run while the checkpoint is written: the snapshot is already taken
        params, opt_state, losses = job.train(update, params, opt_state, 2, 4)
        mngr.wait_until_finished()
        mngr.close()
        jax_mlpo.close(opt_state)  # the new process takes the same tier directories
        expected[case.name] = (losses, job.as_bits(params))
        specs.append(spec)
    run_worker(specs, worker_env)
    replayed = {}
    for case, spec in zip(RESUME_CASES, specs, strict=True):
        with np.load(spec["out"]) as out:
            replayed[case.name] = {k: out[k] for k in out.files}
    return expected, replayed


@pytest.mark.parametrize("case", RESUME_CASES, ids=[c.name for c in RESUME_CASES])
def test_exact_resume_in_a_new_process(case, resume_runs):
    expected, replayed = resume_runs
    losses, params = expected[case.name]
    out = replayed[case.name]
    assert int(out["start"]) == 2
    assert out["losses"].tolist() == losses  # float equality: bit for bit
    assert_bits_equal({k: out[k] for k in params}, params)


# -- restore onto another layout --------------------------------------------------------------


def test_restore_onto_other_subgroups_tiers_and_host_cache(tmp_path):
    spec = spec_for(tmp_path / "a", "bfloat16", 1, "part", True)
    _, update, params, opt_state = start_job(spec)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 2)
    mngr = checkpoint.manager(spec["ckpt"], async_save=False)
    checkpoint.save(mngr, 2, params, opt_state, {"step": 2})
    saved_state = logical_state(opt_state)
    want, opt_state, _ = job.train(update, params, opt_state, 2, 3)
    jax_mlpo.close(opt_state)

    # 14 subgroups instead of 9, on 3 tiers instead of 1, a host cache of the pipeline only
    other = spec_for(tmp_path / "b", "bfloat16", 3, "none", False, subgroup_size=20_011)
    _, update, fresh, opt_state = start_job(other)
    step, got, opt_state, extra = checkpoint.restore(mngr, fresh, opt_state)
    assert (step, extra) == (2, {"step": 2})
    assert int(opt_state[1].count) == int(opt_state[2].count) == 2  # add_noise, adamw
    assert_states_equal(logical_state(opt_state), saved_state)
    got, opt_state, _ = job.train(update, got, opt_state, 2, 3)
    assert_bits_equal(job.as_bits(got), job.as_bits(want))
    jax_mlpo.close(opt_state)

    # float32 params have no master copy: the bfloat16 checkpoint does not fit them
    fp32 = spec_for(tmp_path / "d", "float32", 0, "all", True)
    _, _, fresh, opt_state = start_job(fp32)
    with pytest.raises(ValueError, match="does not fit the target tree"):
        checkpoint.restore(mngr, fresh, opt_state)
    jax_mlpo.close(opt_state)
    mngr.close()


def test_save_is_asynchronous_and_snapshots_the_state(tmp_path, monkeypatch):
    """save returns with the offloaded state still being streamed from the tiers; the updates
    that run meanwhile write copy-on-write blobs, so none of them leaks into the checkpoint, and
    the blobs the checkpoint has read are deleted: the tier never holds more than 2x."""
    spec = spec_for(tmp_path, "float32", 1, "none", False)
    _, update, params, opt_state = start_job(spec)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 1)
    saved_state, saved_params = logical_state(opt_state), job.as_bits(params)
    blobs = StateSnapshot.blobs
    first_read, release = threading.Event(), threading.Event()

    def held_blobs(self):
        for n, item in enumerate(blobs(self)):
            yield item
            if n == 0:  # the stream stays in flight after its first subgroup
                first_read.set()
                release.wait(timeout=60)

    monkeypatch.setattr(StateSnapshot, "blobs", held_blobs)
    mngr = checkpoint.manager(spec["ckpt"])
    checkpoint.save(mngr, 1, params, opt_state)  # returns with the stream in flight
    assert first_read.wait(timeout=60)
    engine = jax_mlpo.engine_of(opt_state)
    n = len(engine.layout.subgroups)
    _, opt_state, _ = job.train(update, params, opt_state, 1, 3)  # rewrites every tier blob
    tier = Path(spec["tiers"][0])
    alt = sorted(tier.glob("state.alt-*.blob"))
    assert len(alt) == n  # written aside (the one being read too: it is released once consumed)
    assert not (Path(spec["ckpt"]) / "1").exists()  # published once every file is written
    release.set()
    mngr.wait_until_finished()
    assert mngr.latest_step() == 1 and (Path(spec["ckpt"]) / "1").is_dir()
    # each subgroup has one blob again: the old ones were deleted once read
    assert len(list(tier.glob("state-*.blob"))) + len(list(tier.glob("state.alt-*.blob"))) == n
    jax_mlpo.close(opt_state)
    _, _, fresh, opt_state = start_job(spec)
    restored = checkpoint.restore(mngr, fresh, opt_state)
    assert_bits_equal(job.as_bits(restored.params), saved_params)
    assert_states_equal(logical_state(restored.opt_state), saved_state)
    # a state that is not the latest of its optimizer is refused
    clip, noise, adam = restored.opt_state
    stale = (clip, noise, adam._replace(count=jnp.zeros([], jnp.int32)))
    with pytest.raises(jax_mlpo.StaleStateError, match="at step 0, but its offloaded state"):
        checkpoint.save(mngr, 5, restored.params, stale)
    jax_mlpo.close(restored.opt_state)
    mngr.close()


# -- kill -9 ------------------------------------------------------------------------------------


def test_kill_9_at_random_points_then_resume(tmp_path, worker_env):
    """Training with a checkpoint every step and slowed tier writes, killed 10 times at random
    points (restore, update phases, checkpoint writes), resumes to the uninterrupted params."""
    steps, trials = 30, 10  # a trial advances the run by 0-5 steps, typically 1
    spec = spec_for(tmp_path / "run", "bfloat16", 2, "part", True, steps=steps, save_every=1)
    spec["slow_writes"] = 0.03
    spec["direct_bytes"] = 64 << 10  # w1 and w2 (256 KiB) written by jax_mlpo, during save
    spec["recycle_bytes"] = 64 << 10  # their arrays rewrite the files of deleted checkpoints
    rng = random.Random(0)
    resumed_at = []
    for trial in range(trials):
        stderr = tmp_path / f"trial{trial}.err"
        with open(stderr, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(spec)],
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        lines = []
        # kill a random delay after tx.init (restore), after the restore (compilation and
        # the first update), or after the first or second update of this process
        wait_for, delay = rng.choice([0, 1, 2, 2, 3]), rng.uniform(0.0, 0.4)
        for line in proc.stdout:
            if line.startswith("saving"):
                continue
            lines.append(line.strip())
            if line.startswith("start"):
                resumed_at.append(int(line.split()[1]))
            if len(lines) > wait_for:  # "init", "start <step>", then "step <n>" per update
                break
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        # killed: neither finished nor failed (e.g. on a checkpoint it could not restore)
        assert proc.returncode == -signal.SIGKILL, (lines, stderr.read_text()[-3000:])
    out = run_worker(spec, worker_env)
    assert resumed_at[0] == 0 and max(resumed_at) > 0, resumed_at  # it made progress
    rewritten = int(re.search(r"done, (\d+) files of deleted", out).group(1))
    assert rewritten > 0, out  # its saves rewrote the files of deleted checkpoints

    ref = spec_for(tmp_path / "ref", "bfloat16", 2, "part", True)
    _, update, params, opt_state = start_job(ref)
    params, opt_state, _ = job.train(update, params, opt_state, 0, steps)
    jax_mlpo.close(opt_state)
    with np.load(spec["out"]) as out:
        assert_bits_equal({k: out[k] for k in job.SHAPES}, job.as_bits(params))


# -- a full disk ---------------------------------------------------------------------------------


def fill(disk: Path) -> None:
    """Fills the file system with a ballast file, to the last block."""
    fd = os.open(disk / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 4096, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:  # ENOSPC: try smaller writes
                pass
    finally:
        os.close(fd)


def _a_bug_of_ours(error: BaseException) -> bool:
    """Whether ``error`` is a programming error raised inside jax_mlpo (a TypeError, a
    KeyError...), rather than orbax's, tensorstore's or jax_mlpo's refusal of a bad file."""
    bugs = (TypeError, AttributeError, KeyError, IndexError, NameError, AssertionError)
    innermost = traceback.extract_tb(error.__traceback__)[-1].filename
    return isinstance(error, bugs) and innermost.startswith(str(PACKAGE))


# orbax leaves tensorstore callbacks for an event loop it closed after a failed read or write
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_full_tier_fails_clearly_and_the_checkpoint_survives(small_disk, tmp_path):
    # tensorstore writes every blob to a new file then renames it, so a tier can fill up midway
    # through a run (the posix engine rewrites preallocated files in place: see the next test)
    spec = spec_for(small_disk, "float32", 1, "none", False, io_engine="tensorstore")
    _, update, params, opt_state = start_job(spec)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 2)
    mngr = checkpoint.manager(spec["ckpt"])  # on the same disk
    checkpoint.save(mngr, 2, params, opt_state, {"step": 2})
    mngr.wait_until_finished()
    saved_state, saved_params = logical_state(opt_state), job.as_bits(params)

    fill(small_disk)
    tier = spec["tiers"][0]
    with (
        pytest.raises(TierFullError, match="No space left on device") as info,
        jax_mlpo.errors.typed(),
    ):
        job.train(update, params, opt_state, 2, 3)
    message = str(info.value)
    assert f"tier {tier!r}" in message and "/state-" in message  # the tier and the blob file
    assert "the file system is full. Free space there or configure another tier" in message
    with pytest.raises(jax_mlpo.EngineFailedError, match="Restore from your last checkpoint"):
        checkpoint.save(mngr, 3, params, opt_state)  # never a half-updated state

    # restore onto another disk; a checkpoint write on the full one fails and changes nothing
    other = spec_for(tmp_path / "other", "float32", 1, "none", False)
    _, update, fresh, new_state = start_job(other)
    jax_mlpo.close(opt_state)
    restored = checkpoint.restore(mngr, fresh, new_state)
    assert_states_equal(logical_state(restored.opt_state), saved_state)
    # a step first: until an update runs, a save's wait for the updates in flight re-raises
    # the failed one's error
    params, opt_state, _ = job.train(update, restored.params, restored.opt_state, 2, 3)
    with pytest.raises(
        checkpoint.CheckpointSpaceError,
        match=r"a checkpoint needs [\d.]+ MB on the file system of .*/ckpt, which has [\d.]+ MB "
        "free: free space there",
    ):
        checkpoint.save(mngr, 3, params, opt_state)
        mngr.wait_until_finished()
    assert mngr.all_steps() == [2]
    mngr.close()
    jax_mlpo.close(opt_state)

    _, _, fresh, opt_state = start_job(other)
    mngr = checkpoint.manager(spec["ckpt"])
    restored = checkpoint.restore(mngr, fresh, opt_state)
    assert restored.step == 2
    assert_bits_equal(job.as_bits(restored.params), saved_params)
    assert_states_equal(logical_state(restored.opt_state), saved_state)
    mngr.close()
    jax_mlpo.close(restored.opt_state)


def test_posix_tiers_reserve_their_space_at_init(small_disk, tmp_path):
    """The posix engine preallocates each blob at its first write: a disk that fills up later
    does not stop the run, and one too small for the state fails at init, naming the fix."""
    spec = spec_for(small_disk / "a", "float32", 1, "none", False)
    _, update, params, opt_state = start_job(spec)
    params, opt_state, losses = job.train(update, params, opt_state, 0, 2)
    fill(small_disk)
    params, opt_state, more = job.train(update, params, opt_state, 2, 4)  # no error
    jax_mlpo.close(opt_state)
    reference = spec_for(tmp_path / "ref", "float32", 1, "none", False)
    _, update, ref_params, ref_state = start_job(reference)
    ref_params, ref_state, ref_losses = job.train(update, ref_params, ref_state, 0, 4)
    jax_mlpo.close(ref_state)
    assert losses + more == ref_losses

    # the disk is still full (the first run's blobs stay): a new optimizer cannot reserve space
    spec = spec_for(small_disk / "b", "float32", 1, "none", False)
    with pytest.raises(TierFullError, match="No space left on device") as info:
        start_job(spec)
    message = str(info.value)
    assert f"tier {spec['tiers'][0]!r}" in message and "/state-" in message
    assert "the file system is full. Free space there or configure another tier" in message


def test_a_full_tier_falls_back_to_another_and_the_run_matches(small_disk, tmp_path):
    (tmp_path / "b").mkdir()
    spec = spec_for(tmp_path / "run", "float32", 2, "none", False, io_engine="tensorstore")
    spec["tiers"] = [str(small_disk / "tier0"), str(tmp_path / "b" / "tier1")]
    _, update, params, opt_state = start_job(spec)
    params, opt_state, losses = job.train(update, params, opt_state, 0, 2)
    engine = jax_mlpo.engine_of(opt_state)
    on_small = engine.tier_of.count(0)
    assert on_small > 0
    fill(small_disk)
    params, opt_state, more = job.train(update, params, opt_state, 2, 4)  # no error
    assert engine.tier_of.count(0) < on_small  # the full tier's subgroups moved on write-back

    reference = spec_for(tmp_path / "ref", "float32", 2, "none", False, io_engine="tensorstore")
    _, update, ref_params, ref_state = start_job(reference)
    ref_params, ref_state, ref_losses = job.train(update, ref_params, ref_state, 0, 4)
    assert losses + more == ref_losses
    assert_bits_equal(job.as_bits(params), job.as_bits(ref_params))
    jax_mlpo.close(opt_state)
    jax_mlpo.close(ref_state)


# -- flipped bytes ------------------------------------------------------------------------------


def _a_bug_of_ours(error: BaseException) -> bool:
    """Whether ``error`` is a programming error raised inside jax_mlpo (a TypeError, a
    KeyError...), rather than orbax's, tensorstore's or jax_mlpo's refusal of a bad file."""
    bugs = (TypeError, AttributeError, KeyError, IndexError, NameError, AssertionError)
    innermost = traceback.extract_tb(error.__traceback__)[-1].filename
    return isinstance(error, bugs) and innermost.startswith(str(PACKAGE))


# orbax leaves tensorstore callbacks for an event loop it closed after a failed read or write
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_every_flipped_byte_is_detected(tmp_path):
    """A byte flipped anywhere in a checkpoint either fails the restore or, where restore does
    not read it (orbax's bookkeeping: timestamps, stale OCDBT nodes), leaves the restored state
    bit for bit the saved one. Flips in a tier blob fail the read (crc32c)."""
    spec = spec_for(tmp_path / "run", "bfloat16", 1, "none", False)
    _, update, params, opt_state = start_job(spec)
    params, opt_state, _ = job.train(update, params, opt_state, 0, 2)
    mngr = checkpoint.manager(spec["ckpt"], async_save=False)
    checkpoint.save(mngr, 2, params, opt_state, {"step": 2, "seed": 7})
    mngr.close()
    saved_state, saved_params = logical_state(opt_state), job.as_bits(params)

    # tier blobs: every flip (data, padding, trailer) is caught by a crc32c on the next read
    engine = jax_mlpo.engine_of(opt_state)
    store = engine.tiers[0]
    blob = Path(store.blob_path(0))
    size = blob.stat().st_size
    out = np.empty(engine.layout.subgroups[0].state_elems, np.float32)
    rng = random.Random(0)
    for pos in sorted({0, 1, size - 5, size - 4, size - 1, *rng.sample(range(size), 40)}):
        flip(blob, pos)
        with pytest.raises(jax_mlpo.CorruptBlobError, match="does not match its checksum"):
            store.read(0, out).result()
        flip(blob, pos)
    store.read(0, out).result()
    jax_mlpo.close(opt_state)

    # checkpoint files: sampled positions in every file, always the first and last byte
    target = spec_for(tmp_path / "target", "bfloat16", 0, "all", True)
    _, _, fresh, opt_state = start_job(target)
    step_dir = Path(spec["ckpt"]) / "2"
    files = sorted(p for p in step_dir.rglob("*") if p.is_file())
    outcomes: dict[Path, list[str]] = {path: [] for path in files}
    for path in files:
        size = path.stat().st_size
        positions = {0, size - 1, *rng.sample(range(size), min(size, 8 if size > 10_000 else 2))}
        for pos in sorted(positions):
            flip(path, pos)
            reader = checkpoint.manager(spec["ckpt"], async_save=False)
            try:
                restored = checkpoint.restore(reader, fresh, opt_state)
            except checkpoint.CorruptCheckpointError:
                outcomes[path].append("digest")
            except Exception as e:  # noqa: BLE001 - orbax or tensorstore refused to read it
                assert not _a_bug_of_ours(e), f"{path} byte {pos}: {e!r}"
                outcomes[path].append("orbax")
            else:
                assert restored.extra == {"step": 2, "seed": 7}, (path, pos)
                assert_bits_equal(job.as_bits(restored.params), saved_params)
                assert_states_equal(logical_state(restored.opt_state), saved_state)
                outcomes[path].append("harmless")
            finally:
                reader.close()
                flip(path, pos)
            if jax_mlpo.engine_of(opt_state).failed:  # a restore found a bad chunk midway
                jax_mlpo.close(opt_state)
                _, _, fresh, opt_state = start_job(target)
    for item in ("params", "opt_state", "extra"):
        assert set(outcomes[step_dir / item / CHECKSUMS_FILE]) == {"digest"}
    # zarr3's array files have no checksum: flips in the params' data are caught by the manifest
    # (the optimizer state's orbax part is a few scalars; its arrays are streamed: below)
    data = max((p for p in files if p.relative_to(step_dir).parts[0] == "params"
                and "c" in p.relative_to(step_dir).parts),
               key=lambda p: p.stat().st_size)  # fmt: skip
    assert "digest" in outcomes[data], outcomes[data]
    # the offloaded state's arrays: every flip in a chunk is caught by its digest
    chunks = [p for p in files if "jax_mlpo_state" in p.parts and p.parent.name == "c"]
    assert chunks and all(set(outcomes[p]) == {"digest"} for p in chunks), chunks
    # and the untouched checkpoint still restores
    restored = checkpoint.restore(checkpoint.manager(spec["ckpt"]), fresh, opt_state)
    assert_states_equal(logical_state(restored.opt_state), saved_state)
    jax_mlpo.close(opt_state)
