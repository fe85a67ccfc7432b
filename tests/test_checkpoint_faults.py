"""Faults during a checkpoint save, injected into the checkpoint's own I/O through
``jax_mlpo.testing.checkpoint_faults`` (and into a tier's through ``tier_faults``): a full disk
midway through a save, a torn chunk, an object store lost during an asynchronous save, the
process killed during one, and a second save started while one is in flight.

After each: the failed checkpoint is never listed by the manager (``latest_step()``,
``all_steps()``), the error names the checkpoint, the cause and the fix, and the previous
checkpoint restores bit for bit into a new optimizer that then trains on exactly as optax. The
state is on a file (or object) tier, with the host cache holding only the pipeline's buffers,
so the saves stream it from the tier.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest
from fault_training import (
    BLOB,
    N,
    Training,
    file_config,
    object_config,
    optax_params,
)
from helpers import assert_bits_equal

import jax_mlpo
from jax_mlpo.checkpoint import CheckpointWriteError, CorruptCheckpointError
from jax_mlpo.testing import checkpoint_faults, tier_faults
from jax_mlpo.testing.s3_server import S3Server

WORKER = Path(__file__).with_name("ckpt_killed_save_worker.py")
ROOT = Path(__file__).resolve().parents[1]
NOT_PUBLISHED = (
    r"It was not published: the manager does not list step {step} and the earlier checkpoints "
    r"are intact \(the partial directory .*/{step}\.orbax-checkpoint-tmp is deleted by the next "
    r"jax_mlpo\.checkpoint\.manager on .*/ckpt, before its first save\)\."
)


def saved(run: Training) -> dict[str, np.ndarray]:
    """What a checkpoint of ``run`` now must restore: its params and its offloaded state."""
    state = run.engine.state_dict()
    return {"params": np.asarray(run.params["w"]).copy(), "mu": state["mu"][0],
            "nu": state["nu"][0]}  # fmt: skip


def start(tmp_path: Path) -> tuple[Training, object, dict[str, np.ndarray]]:
    """Two updates on a file tier and checkpoint 2, written; then two more updates.

    Returns:
      The run (at step 4), its manager and what checkpoint 2 holds.
    """
    run = Training(file_config(tmp_path / "run"))
    run.run(2)
    mngr = jax_mlpo.checkpoint.manager(str(tmp_path / "ckpt"))
    jax_mlpo.checkpoint.save(mngr, 2, run.params, run.state, blocking=True)
    # the state is on the tier, not in the host cache: the saves stream it from there
    assert len(list((tmp_path / "run" / "t0").glob("state*.blob"))) == N
    assert run.engine.config.host_cache < N * BLOB
    at_2 = saved(run)
    run.run(2)
    return run, mngr, at_2


def assert_restores(mngr, step: int, want: dict[str, np.ndarray], config, steps: int) -> None:
    """Checkpoint ``step`` restores bit for bit as ``want`` into a new optimizer on ``config``,
    which then runs to ``steps`` updates as optax does."""
    run = Training(config)
    restored = jax_mlpo.checkpoint.restore(mngr, run.params, run.state, step=step)
    assert restored.step == step
    run.params, run.state, run.step = restored.params, restored.opt_state, restored.step
    assert_bits_equal(np.asarray(run.params["w"]), want["params"], "params")
    state = run.engine.state_dict()
    assert_bits_equal(state["mu"][0], want["mu"], "mu")
    assert_bits_equal(state["nu"][0], want["nu"], "nu")
    run.run(steps - step)
    np.testing.assert_allclose(np.asarray(run.params["w"]), optax_params(steps), rtol=1e-6)
    jax_mlpo.close(run.state)


def release_once_waiting(plan: jax_mlpo.testing.FaultPlan, waiter: threading.Thread) -> dict:
    """Releases ``plan``'s held requests once ``waiter`` is blocked in orbax's
    ``CheckpointManager.wait_until_finished`` (seen in its stack), from a thread of its own.

    Returns:
      ``{"seen": bool}``, set once released: whether ``waiter`` was seen waiting.
    """
    found = {"seen": False}
    stop = threading.Event()

    def watch() -> None:
        for _ in range(6000):  # a 60 s bound, so a save that never waits fails the test
            frame = sys._current_frames().get(waiter.ident)
            if frame is not None and any(
                f.name == "wait_until_finished" and "orbax" in f.filename
                for f in traceback.extract_stack(frame)
            ):
                found["seen"] = True
                break
            if stop.wait(0.01):
                break
        plan.release()

    threading.Thread(target=watch, daemon=True).start()
    return found


# -- a full disk ---------------------------------------------------------------------------------


def test_a_disk_full_midway_through_an_async_save(tmp_path):
    run, mngr, at_2 = start(tmp_path)
    with checkpoint_faults() as plan:
        # after the first piece; the writes run on several threads, so the second to reach
        # the disk is the first subgroup's mu or nu, whichever comes first
        plan.fail("write", kind="state", nth=2, errno=errno.ENOSPC)
        jax_mlpo.checkpoint.save(mngr, 4, run.params, run.state)  # returns while it streams
        with pytest.raises(CheckpointWriteError, match=(
            r"checkpoint 4 in .*/ckpt was not saved: error writing .*/4\.orbax-checkpoint-tmp/"
            r"opt_state.*/jax_mlpo_state/0/process_0/(mu|nu)\.0/c/0: \[Errno 28\] No space left "
            rf"on device\. {NOT_PUBLISHED.format(step=4)} Cause: the file system is full\. Free "
            r"space there \(or give the manager another directory\), then save again: training "
            "can go on meanwhile"
        )):  # fmt: skip
            mngr.wait_until_finished()
    assert plan.outcomes("write", kind="state") == ["passed", "failed"]  # midway
    assert mngr.latest_step() == 2 and mngr.all_steps() == [2]
    partial = tmp_path / "ckpt" / "4.orbax-checkpoint-tmp"
    assert (partial / "opt_state.orbax-checkpoint-tmp").is_dir()
    # what the user does next (space freed): training goes on, and the next save succeeds;
    # a new manager on the directory (a new run) lists the same, and deletes the partial one
    run.run(1)
    mngr.close()
    reopened = jax_mlpo.checkpoint.manager(str(tmp_path / "ckpt"))
    assert reopened.all_steps() == [2]
    jax_mlpo.checkpoint.save(reopened, 5, run.params, run.state)
    reopened.wait_until_finished()
    assert reopened.all_steps() == [2, 5] and not partial.exists()
    jax_mlpo.close(run.state)
    with pytest.raises(FileNotFoundError, match=(
        r"no checkpoint of step 4 in .*/ckpt \(a save that failed or was killed is never "
        r"listed\); its checkpoints are steps \[2, 5\]: restore one of those"
    )):  # fmt: skip
        jax_mlpo.checkpoint.restore(reopened, run.params, run.state, step=4)
    assert_restores(reopened, 2, at_2, file_config(tmp_path / "restored"), steps=6)


# -- a torn chunk --------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
def test_a_torn_chunk_fails_the_restore_naming_the_steps_to_restore(tmp_path, damage):
    run, mngr, at_2 = start(tmp_path)
    jax_mlpo.checkpoint.save(mngr, 4, run.params, run.state, blocking=True)
    jax_mlpo.close(run.state)
    # the disk reported the write complete: the manager lists the checkpoint, the restore
    # finds the damage before using any of it
    assert mngr.all_steps() == [2, 4]
    arrays = tmp_path / "ckpt" / "4" / "opt_state" / "jax_mlpo_state" / "0" / "process_0"
    if damage == "truncated":  # the file lost its tail
        data = arrays / "nu.0" / "c" / "0"
        os.truncate(data, data.stat().st_size // 2)
        cause = r"piece 0 cannot be read \(\[Errno 5\] short read at byte 0 \(the file is truncated"
    else:
        cause = (
            r"piece 0 does not match its digest \(the checkpoint is corrupt: a changed or "
            r"half-written file\)"
        )
    target = Training(file_config(tmp_path / "target"))
    with checkpoint_faults() as plan:
        if damage == "corrupted":
            plan.corrupt(kind="state", nth=2)  # the second piece read: nu's, bits flipped
        with pytest.raises(CorruptCheckpointError, match=(
            rf"checkpoint 4 in .*/ckpt is corrupt: .*/nu\.0.*{cause}.* The manager's other "
            r"checkpoints are steps \[2\]: pass step=2 to restore the latest\."
        )):  # fmt: skip
            jax_mlpo.checkpoint.restore(mngr, target.params, target.state)
    # every piece read was checked: mu's passed, nu's was the damaged one
    assert [e.where.split("/")[-3] for e in plan.trace if e.kind == "state"] == ["mu.0", "nu.0"]
    if damage == "corrupted":
        assert plan.outcomes("read", kind="state") == ["passed", "corrupted"]
    assert target.engine.failed  # partly loaded: restore into a new tx.init
    jax_mlpo.close(target.state)
    assert_restores(mngr, 2, at_2, file_config(tmp_path / "restored"), steps=5)


# -- an object store lost ------------------------------------------------------------------------


def test_an_object_store_lost_during_an_async_save(server, tmp_path):
    lost = S3Server().start()
    try:
        run = Training(
            object_config(lost.endpoint, lost.bucket(), request_retries=1, read_ahead=False)
        )
        run.run(2)
        mngr = jax_mlpo.checkpoint.manager(str(tmp_path / "ckpt"))
        jax_mlpo.checkpoint.save(mngr, 2, run.params, run.state, blocking=True)
        at_2 = saved(run)
        run.run(2)
        with tier_faults(run.state) as plan:
            # the server dies while the save streams the state from it
            plan.on("read", lost.kill, kind="state", nth=2)
            jax_mlpo.checkpoint.save(mngr, 4, run.params, run.state)
            with pytest.raises(CheckpointWriteError, match=(
                r"checkpoint 4 in .*/ckpt was not saved: reading the optimizer state from its "
                r"tier failed: subgroup \d+: .*error reading blob .*state-\d+\.blob.*the "
                rf"endpoint {lost.endpoint} is unreachable \(server down, or a wrong endpoint\)\. "
                rf"Start the server or fix ObjectTier\.endpoint.*{NOT_PUBLISHED.format(step=4)} "
                "Fix the tier as its error says. Its state may be lost with it: restore the last "
                "checkpoint into a new tx.init"
            )):  # fmt: skip
                mngr.wait_until_finished()
        # the state was on the object store: the save read it there, until the server died
        assert plan.outcomes("read", kind="state")[:2] == ["passed", "called"]
        assert mngr.latest_step() == 2 and mngr.all_steps() == [2]
        with (
            pytest.raises(
                jax_mlpo.TierIOError, match=f"the endpoint {lost.endpoint} is unreachable"
            ),
            jax_mlpo.errors.typed(),
        ):
            run.run(1)  # the state went with the server
        jax_mlpo.close(run.state)
    finally:
        lost.kill()
    # the checkpoint (on local disk) restores onto another server
    assert_restores(mngr, 2, at_2, object_config(server.endpoint, server.bucket()), steps=5)


# -- the process killed --------------------------------------------------------------------------


def test_the_process_killed_during_an_async_save(tmp_path, worker_env):
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path)],
        env={**worker_env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert proc.stdout.split() == ["SAVING"]  # killed inside the save, before it completed
    ckpt = tmp_path / "ckpt"
    partial = ckpt / "4.orbax-checkpoint-tmp"
    arrays = partial / "opt_state.orbax-checkpoint-tmp" / "jax_mlpo_state" / "0" / "process_0"
    assert (arrays / "mu.0" / "c" / "0").is_file()  # its first piece was written
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", partial.name]
    mngr = jax_mlpo.checkpoint.manager(str(ckpt))
    assert mngr.latest_step() == 2 and mngr.all_steps() == [2]
    run = Training(file_config(tmp_path / "target"))
    with pytest.raises(FileNotFoundError, match=(
        r"no checkpoint of step 4 in .*/ckpt \(a save that failed or was killed is never "
        r"listed\); its checkpoints are steps \[2\]: restore one of those"
    )):  # fmt: skip
        jax_mlpo.checkpoint.restore(mngr, run.params, run.state, step=4)
    jax_mlpo.close(run.state)
    with np.load(tmp_path / "saved.npz") as at_2:
        assert_restores(mngr, 2, dict(at_2), file_config(tmp_path / "restored"), steps=5)


# -- a second save while one is in flight -------------------------------------------------------


def test_a_second_save_while_a_failing_one_is_in_flight(tmp_path):
    run, mngr, at_2 = start(tmp_path)
    with checkpoint_faults() as plan:
        # the save's first piece is held, then fails: the save is in flight until released (the
        # pieces are written on several threads: either moment's can be the first)
        plan.hang("write", kind="state", limit_s=60).fail("write", kind="state")
        jax_mlpo.checkpoint.save(mngr, 4, run.params, run.state)
        plan.wait_for(1, op="write", outcome="hung+failed")
        run.run(2)  # training goes on during the save
        waited = release_once_waiting(plan, threading.current_thread())
        with pytest.raises(CheckpointWriteError, match=(
            r"checkpoint 6 was not started: the save before it failed, and orbax reports that "
            r"at the next save\. Call save again for step 6 once its cause is fixed\. The failed "
            r"save: checkpoint 4 in .*/ckpt was not saved: error writing .*/(mu|nu)\.0/c/0: "
            r"\[Errno 5\] "
            rf"Input/output error\. {NOT_PUBLISHED.format(step=4)} Cause: the file system failed "
            "the write: check that it is mounted, writable and healthy, then save again"
        )):  # fmt: skip
            jax_mlpo.checkpoint.save(mngr, 6, run.params, run.state)
    assert waited["seen"]  # the second save waited for the first, in flight
    assert plan.outcomes("write", kind="state").count("hung+failed") == 1
    assert all("/4.orbax-checkpoint-tmp/" in e.where for e in plan.trace)  # none of step 6
    assert mngr.all_steps() == [2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2", "4.orbax-checkpoint-tmp"]
    # saved again, step 6 is complete
    jax_mlpo.checkpoint.save(mngr, 6, run.params, run.state)
    mngr.wait_until_finished()
    assert mngr.latest_step() == 6 and mngr.all_steps() == [2, 6]
    at_6 = saved(run)
    jax_mlpo.close(run.state)
    assert_restores(mngr, 6, at_6, file_config(tmp_path / "restored6"), steps=7)
    assert_restores(mngr, 2, at_2, file_config(tmp_path / "restored2"), steps=3)


def test_a_restore_while_a_failing_save_is_in_flight_takes_the_previous_step(tmp_path, caplog):
    run, mngr, at_2 = start(tmp_path)
    target = Training(file_config(tmp_path / "target"))
    with checkpoint_faults() as plan:
        plan.hang("write", kind="state", limit_s=60).fail("write", kind="state")
        jax_mlpo.checkpoint.save(mngr, 4, run.params, run.state)
        plan.wait_for(1, op="write", outcome="hung+failed")
        assert mngr.latest_step() == 4  # orbax lists the save in flight
        waited = release_once_waiting(plan, threading.current_thread())
        with caplog.at_level(logging.WARNING, "jax_mlpo"):
            restored = jax_mlpo.checkpoint.restore(mngr, target.params, target.state)
    assert waited["seen"] and restored.step == 2
    assert re.search(
        r"restoring from the checkpoints before a failed save: checkpoint 4 in .* was not saved: "
        r"error writing .*Input/output error",
        caplog.text,
    )
    assert mngr.all_steps() == [2]
    assert_bits_equal(np.asarray(restored.params["w"]), at_2["params"], "params")
    state = target.engine.state_dict()
    assert_bits_equal(state["mu"][0], at_2["mu"], "mu")
    assert_bits_equal(state["nu"][0], at_2["nu"], "nu")
    jax_mlpo.close(restored.opt_state)
    jax_mlpo.close(run.state)
