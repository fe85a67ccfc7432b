"""Storage faults during training: each fails with an error that names its cause and its fix,
and no state is lost or silently wrong: the engine refuses to go on, and the last checkpoint
restores into a new optimizer that continues exactly as optax would have.

The faults come from :mod:`jax_mlpo.testing`'s fault plans (a request of the tier's blob I/O
that fails, finds its blob corrupted, or hangs), from the file system itself (a read-only
directory, a truncated blob file), and from a real S3 server (moto_server: stopped mid-run, or
behind ``tests/s3_server.py``'s proxy answering 5xx or holding its requests).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fault_training import (
    LR,
    WD,
    N,
    Training,
    assert_resumes_as_optax,
    file_config,
    make_params,
    object_config,
    optax_params,
)
from s3_server import FaultyS3Proxy

import jax_mlpo
from jax_mlpo.testing import tier_faults
from jax_mlpo.testing.s3_server import S3Server, dummy_credentials
from jax_mlpo.tiers.errors import TierFullError

# -- file tiers ---------------------------------------------------------------------------------


def test_a_write_that_fails_during_write_behind_fails_the_next_update(tmp_path):
    run = Training(file_config(tmp_path / "run", retain=False))  # write-behind: on by default
    run.run(2)
    mngr = run.save(tmp_path / "ckpt")
    last = N - 1  # the third update runs in ascending order: its last write-back
    store = run.engine.tiers[0]
    with tier_faults(run.state) as plan:
        plan.hang("write", slot=last, limit_s=30).fail("write", slot=last, errno=errno.EIO)
        run.run(1)  # returns with that write-back in flight
        plan.wait_for(1, op="write", outcome="hung+failed")
        assert run.step == 3 and not run.engine.failed
        plan.release()
        with pytest.raises(jax_mlpo.TierIOError, match=(
            rf"subgroup {last}: tier {re.escape(repr(store.tier.path))}: error "
            rf"writing blob {re.escape(store.blob_path(last))} to the tier: \[Errno 5\] "
            r"Input/output error.*Cause: check that the file system is mounted, writable and "
            "healthy"
        )), jax_mlpo.errors.typed():  # fmt: skip
            run.run(1)
    assert plan.outcomes("write").count("hung+failed") == 1
    run.assert_refuses_to_go_on(mngr)
    jax_mlpo.close(run.state)
    assert_resumes_as_optax(mngr, file_config(tmp_path / "resumed"), steps=5)


def test_a_full_tier_moves_its_subgroups_to_another_tier(tmp_path, caplog):
    config = file_config(tmp_path / "run", tiers=2, retain=False, write_behind=False)
    run = Training(config)
    on_full = [i for i, k in enumerate(run.engine.tier_of) if k == 0]
    assert on_full and len(on_full) < N
    paths = [store.tier.path for store in run.engine.tiers]
    with tier_faults(run.state, tier=0) as plan, caplog.at_level(logging.WARNING, "jax_mlpo"):
        plan.fail("write", errno=errno.ENOSPC, count=None)  # full from now on
        run.run(3)
    # each subgroup's first write-back found the tier full and went to the other tier, where
    # it stays: none was written to the full tier again
    assert run.engine.tier_of == [1] * N
    assert plan.outcomes("write") == ["failed"] * len(on_full)
    assert sorted(e.slot for e in plan.trace if e.op == "write") == on_full
    moved = sorted(int(m) for m in re.findall(r"subgroup (\d+) moved to tier", caplog.text))
    assert moved == on_full
    assert f"tier {paths[0]!r} is full; subgroup {on_full[0]} moved to tier {paths[1]!r}" in (
        caplog.text
    )
    np.testing.assert_allclose(np.asarray(run.params["w"]), optax_params(3), rtol=1e-6)
    jax_mlpo.close(run.state)


def test_a_full_tier_without_fallback_fails_naming_the_fix(tmp_path):
    run = Training(file_config(tmp_path / "run", retain=False, fallback_on_full=False))
    run.run(1)
    mngr = run.save(tmp_path / "ckpt")
    path = run.engine.tiers[0].tier.path
    with tier_faults(run.state) as plan:
        plan.fail("write", errno=errno.ENOSPC, count=None)
        with pytest.raises(TierFullError, match=(
            rf"subgroup \d+: tier {re.escape(repr(path))}: error writing blob "
            r".*No space left on device.*Cause: the file system is full\. Free space there or "
            "configure another tier, then restore the optimizer state from your last checkpoint"
        )), jax_mlpo.errors.typed():  # fmt: skip
            run.run(1)
    assert plan.outcomes("write")[0] == "failed"
    run.assert_refuses_to_go_on(mngr)
    jax_mlpo.close(run.state)
    assert_resumes_as_optax(mngr, file_config(tmp_path / "resumed"), steps=3)
    assert issubclass(TierFullError, jax_mlpo.TierIOError)


@pytest.mark.parametrize("io_engine", ["posix", "tensorstore"])
def test_a_corrupt_read_is_caught_by_its_checksum(tmp_path, io_engine):
    run = Training(file_config(tmp_path / "run", io_engine=io_engine, write_behind=False))
    run.run(1)
    mngr = run.save(tmp_path / "ckpt")
    store = run.engine.tiers[0]
    with tier_faults(run.state) as plan:
        plan.corrupt()  # the next read's blob, as bit rot would leave it
        with (
            pytest.raises(jax_mlpo.CorruptBlobError, match=r"subgroup (\d+): ") as info,
            jax_mlpo.errors.typed(),
        ):
            run.run(1)
    (victim,) = [e.slot for e in plan.trace if e.outcome == "corrupted"]
    text = str(info.value)
    assert f"subgroup {victim}: " in text
    assert f"error reading blob {store.blob_path(victim)} from the tier" in text
    assert "fail their crc32c" in text or "Digest mismatch" in text  # the engine's own check
    assert (
        "Cause: the blob on disk does not match its checksum (corrupted or half-written). "
        "Restore the optimizer state from your last checkpoint." in text
    )
    run.assert_refuses_to_go_on(mngr)
    jax_mlpo.close(run.state)
    assert_resumes_as_optax(mngr, file_config(tmp_path / "resumed"), steps=3)


def test_a_read_that_hangs_past_io_timeout_s_fails_the_update(tmp_path):
    run = Training(file_config(tmp_path / "run", write_behind=False, io_timeout_s=0.5))
    run.run(1)
    mngr = run.save(tmp_path / "ckpt")
    path = run.engine.tiers[0].tier.path
    with tier_faults(run.state) as plan:
        plan.hang("read", limit_s=30)  # the file system stops answering the next read
        with pytest.raises(jax_mlpo.TierIOError, match=(
            rf"subgroup \d+: tier {re.escape(repr(path))} did not complete a request "
            r"within io_timeout_s=0\.5 s\. The file system may be hung or overloaded: check it, "
            "or raise io_timeout_s if it is just slow"
        )), jax_mlpo.errors.typed():  # fmt: skip
            run.run(1)
        # the update gave up while the read was still held, not when it came back
        assert plan.hanging == 1
    assert plan.outcomes("read")[0] == "hung"
    run.assert_refuses_to_go_on(mngr)
    jax_mlpo.close(run.state)
    assert_resumes_as_optax(mngr, file_config(tmp_path / "resumed"), steps=3)


NOBODY = 65534  # the unprivileged uid root drops to where it cannot mount


def can_write(directory: Path) -> bool:
    try:
        (directory / ".probe").touch()
    except OSError:
        return False
    (directory / ".probe").unlink()
    return True


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[str]:
    """Makes ``directory`` read-only for this process; yields how.

    ``"mode"``: chmod 0o555 (the process is not root). Root ignores the mode bits, so then
    ``"mount"``: a read-only bind mount over it; where root may not mount, ``"setuid"``: the
    process's effective uid is :data:`NOBODY`'s for the block (every thread's: glibc's
    ``seteuid``), so the mode bits apply. The directory's parents must let others through.
    Fails the test where none of them works: an unchecked refusal is no test.
    """
    directory.chmod(0o555)
    try:
        if not can_write(directory):
            yield "mode"
            return
        mount = subprocess.run(
            ["mount", "--bind", "-o", "ro", str(directory), str(directory)], capture_output=True
        )
        if mount.returncode == 0:
            try:
                yield "mount"
            finally:
                subprocess.run(["umount", str(directory)], check=True)
            return
        try:
            os.seteuid(NOBODY)
        except OSError as e:
            pytest.fail(
                f"cannot make {directory} read-only for root: the mode bits do not bind root, "
                f"mount --bind -o ro failed ({mount.stderr.decode().strip()}) and "
                f"os.seteuid({NOBODY}) failed ({e}). Run the test as a user other than root, or "
                "with CAP_SYS_ADMIN (mount) or CAP_SETUID"
            )
        try:
            if can_write(directory):
                pytest.fail(f"{directory} (mode 0o555) is still writable as uid {NOBODY}")
            yield "setuid"
        finally:
            os.seteuid(0)
    finally:
        directory.chmod(0o700)


@pytest.fixture
def reachable_tmp():
    """A temporary directory that every user may pass through (mode 0o711), unlike pytest's
    ``tmp_path`` under root, so that only a directory's own mode bits stop an unprivileged
    uid."""
    base = Path(tempfile.mkdtemp(prefix="jax_mlpo-ro-"))
    base.chmod(0o711)
    try:
        yield base
    finally:
        shutil.rmtree(base)


def test_a_read_only_tier_directory_is_refused_before_training(reachable_tmp):
    tier_dir = reachable_tmp / "run" / "t0"
    tier_dir.mkdir(parents=True)
    (tier_dir / "notes.txt").write_text("not ours")
    config = file_config(reachable_tmp / "run")
    tx = jax_mlpo.adamw(LR, weight_decay=WD, offload=config)  # validated while writable
    with read_only(tier_dir) as how:
        cause = {"mount": "Read-only file system"}.get(how, "Permission denied")
        # a new optimizer checks the path first
        with pytest.raises(jax_mlpo.ConfigError, match=(
            rf"FileTier.path={re.escape(repr(str(tier_dir)))} is not writable \({cause}\)\. "
            "Choose a directory you can write to, or fix its permissions or free space"
        )):  # fmt: skip
            jax_mlpo.adamw(LR, offload=file_config(reachable_tmp / "run"))
        # one validated before the directory turned read-only fails at init
        fix = {
            "mount": "the tier's file system is read-only .* Choose a writable directory, or "
            "remount it read-write",
        }.get(how, "permission denied. Fix the directory's permissions or choose another path")
        with pytest.raises(jax_mlpo.TierIOError, match=(
            rf"tier {re.escape(repr(str(tier_dir)))}: error locking the directory of the tier: "
            rf".*{cause}.*Cause: {fix}"
        )):  # fmt: skip
            tx.init(make_params())
        assert sorted(p.name for p in tier_dir.iterdir()) == ["notes.txt"]  # nothing touched
    # writable again: nothing left behind (no lock, no blob) stands in the way
    run = Training(config)
    run.run(2)
    np.testing.assert_allclose(np.asarray(run.params["w"]), optax_params(2), rtol=1e-6)
    jax_mlpo.close(run.state)
    assert (tier_dir / "notes.txt").read_text() == "not ours"


def test_a_truncated_blob_file_is_named_and_the_checkpoint_restores(tmp_path):
    run = Training(file_config(tmp_path / "run", write_behind=False))
    run.run(1)
    mngr = run.save(tmp_path / "ckpt")
    blobs = sorted((tmp_path / "run" / "t0").glob("state-*.blob"))
    assert blobs
    for blob in blobs:  # a disk that lost the end of every blob file
        os.truncate(blob, blob.stat().st_size // 2)
    with pytest.raises(jax_mlpo.CorruptBlobError, match=(
        r"subgroup (\d+): .*state-\1\.blob is \d+ bytes, a blob of \d+ bytes "
        r"needs \d+: the file is truncated.*Restore the optimizer state from your last checkpoint"
    )), jax_mlpo.errors.typed():  # fmt: skip
        run.run(1)
    run.assert_refuses_to_go_on(mngr)
    jax_mlpo.close(run.state)
    assert_resumes_as_optax(mngr, file_config(tmp_path / "resumed"), steps=3)


# -- the object store -----------------------------------------------------------------------------


def test_an_object_store_lost_during_write_behind_fails_the_next_update(server, tmp_path):
    lost = S3Server().start()
    try:
        run = Training(object_config(lost.endpoint, lost.bucket(), request_retries=1))
        run.run(2)
        mngr = run.save(tmp_path / "ckpt")
        last = N - 1  # the third update's last write-back
        with tier_faults(run.state) as plan:
            plan.hang("write", slot=last, limit_s=30).on("write", lost.kill, slot=last)
            run.run(1)  # returns with that write-back in flight
            plan.wait_for(1, op="write", outcome="hung+called")
            plan.release()  # the server dies, then the write-back reaches it
            with pytest.raises(jax_mlpo.TierIOError, match=(
                # the held write-back, or one behind it that reaches the dead server first
                r"subgroup \d+: .*error writing blob .*state-\d+\.blob.*"
                rf"the endpoint {lost.endpoint} is unreachable \(server down, or a wrong "
                r"endpoint\)\. Start the server or fix ObjectTier\.endpoint; after a failed "
                "update restore the optimizer state from your last checkpoint"
            )), jax_mlpo.errors.typed():  # fmt: skip
                run.run(1)
        run.assert_refuses_to_go_on(mngr)
        jax_mlpo.close(run.state)
    finally:
        lost.kill()
    # the checkpoint (on local disk) restores onto another server
    assert_resumes_as_optax(mngr, object_config(server.endpoint, server.bucket()), steps=5)


def test_an_object_store_lost_at_init_is_named():
    lost = S3Server().start()
    with dummy_credentials():
        try:
            bucket = lost.bucket()
            config = object_config(lost.endpoint, bucket, request_retries=1)
            tx = jax_mlpo.adamw(LR, offload=config)  # checked while the server was up
        finally:
            lost.kill()
        fix = (
            rf"the endpoint {lost.endpoint} is unreachable \(server down, or a wrong "
            r"endpoint\)\. Start the server or fix ObjectTier\.endpoint"
        )
        with pytest.raises(jax_mlpo.TierIOError, match=f"error opening the tier: .*{fix}"):
            tx.init(make_params())
        with pytest.raises(jax_mlpo.ConfigError, match=fix):  # a new optimizer checks it first
            jax_mlpo.adamw(LR, offload=object_config(lost.endpoint, bucket, request_retries=1))


def test_an_object_store_answering_5xx_is_retried_then_named(server, tmp_path):
    proxy = FaultyS3Proxy(server.endpoint)
    try:
        # each update's requests are its own: no write-back after it, no read before it
        run = Training(
            object_config(proxy.endpoint, server.bucket(), write_behind=False, read_ahead=False)
        )
        run.run(1)
        before = proxy.forwarded
        run.run(1)
        per_update = proxy.forwarded - before  # every subgroup read and written once
        assert per_update == 2 * N and proxy.errors == 0
        # two 503s: the requests they answered are retried and succeed
        proxy.fail_next(2)
        before = proxy.forwarded
        run.run(1)
        assert proxy.errors == 2 and proxy.forwarded - before == per_update
        run.run(1)
        np.testing.assert_allclose(np.asarray(run.params["w"]), optax_params(4), rtol=1e-6)
        mngr = run.save(tmp_path / "ckpt")
        # a server that keeps failing: the update fails once the retries are spent
        proxy.fail_next(10_000)
        with pytest.raises(jax_mlpo.TierIOError, match=(
            rf"subgroup \d+: .*the server at {proxy.endpoint} kept answering HTTP "
            r"503 \(unavailable or overloaded\) through all ObjectTier\.request_retries=3 "
            "retries. Check the server; if it is only overloaded, raise request_retries"
        )), jax_mlpo.errors.typed():  # fmt: skip
            run.run(1)
        proxy.fail_next(0)
        run.assert_refuses_to_go_on(mngr)
        jax_mlpo.close(run.state)
    finally:
        proxy.close()
    assert_resumes_as_optax(mngr, object_config(server.endpoint, server.bucket()), steps=6)


def test_an_object_store_slower_than_io_timeout_s_fails_the_update(server, tmp_path):
    proxy = FaultyS3Proxy(server.endpoint)
    try:
        config = object_config(proxy.endpoint, server.bucket(), io_timeout_s=2.0)
        run = Training(config)
        run.run(1)
        mngr = run.save(tmp_path / "ckpt")
        proxy.hold()  # the server stops answering
        with pytest.raises(jax_mlpo.TierIOError, match=(
            rf"subgroup \d+: tier {re.escape(repr(config.tiers[0].path))} did not "
            r"complete a request within io_timeout_s=2\.0 s.*raise io_timeout_s if it is just "
            "slow"
        )), jax_mlpo.errors.typed():  # fmt: skip
            run.run(1)
        assert proxy.held >= 1  # the request was still waiting at the server
        proxy.release()
        run.assert_refuses_to_go_on(mngr)
        jax_mlpo.close(run.state)
    finally:
        proxy.close()
    assert_resumes_as_optax(mngr, object_config(server.endpoint, server.bucket()), steps=3)
