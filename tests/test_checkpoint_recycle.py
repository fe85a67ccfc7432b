"""A save rewrites the files of the checkpoint deleted before it (jax_mlpo.checkpoint.recycle)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import tensorstore as ts
from test_checkpoint_host_arrays import bits, make_job

import jax_mlpo
from jax_mlpo import checkpoint
from jax_mlpo.checkpoint import host_arrays, recycle, shard_file
from jax_mlpo.checkpoint.space import CheckpointSpaceError, check_space
from jax_mlpo.tiers.posix import aligned_empty, round_up_pages


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def large_inodes(step_dir) -> set[int]:
    """Inodes of the files a save may rewrite (at least recycle.MIN_BYTES)."""
    out = set()
    for top, _, names in os.walk(step_dir):
        for name in names:
            st = os.stat(os.path.join(top, name))
            if st.st_size >= recycle.MIN_BYTES:
                out.add(st.st_ino)
    return out


def test_a_save_rewrites_the_files_of_the_checkpoint_deleted_before_it(tmp_path):
    params, tx, step = make_job(tmp_path)
    opt_state = tx.init(params)
    mngr = checkpoint.manager(tmp_path / "ckpt", max_to_keep=1)
    inodes = {}
    for k in range(1, 5):
        params, opt_state = step(params, opt_state, float(k))
        checkpoint.save(mngr, k, params, opt_state, blocking=k % 2 == 0)
        mngr.wait_until_finished()
        inodes[k] = large_inodes(tmp_path / "ckpt" / str(k))
    # the params' array and the state's mu, nu and master arrays
    assert len(inodes[1]) == 4
    assert mngr.all_steps() == [4]
    # step 1 was moved aside when step 2 was saved, and step 3 took its files; step 4 step 2's
    assert inodes[3] == inodes[1]
    assert inodes[4] == inodes[2]
    assert not inodes[1] & inodes[2]
    # what step 3 did not take of step 1 was deleted when step 4 started, in the background
    recycle.wait_for_deletions()
    assert sorted(os.listdir(tmp_path / "ckpt" / recycle.RECYCLED)) == ["2", "3"]
    saved = bits(params)
    params, opt_state = step(params, opt_state, 5.0)
    after = bits(params)
    jax_mlpo.close(opt_state)
    mngr.close()

    (tmp_path / "again").mkdir()
    fresh, tx, step = make_job(tmp_path / "again")
    restored = checkpoint.restore(checkpoint.manager(tmp_path / "ckpt"), fresh, tx.init(fresh))
    assert same(bits(restored.params), saved)
    params, opt_state = step(restored.params, restored.opt_state, 5.0)
    assert same(bits(params), after)  # mu, nu and the master came back exactly
    jax_mlpo.close(opt_state)


def test_a_larger_spare_file_is_overwritten_and_cut_to_the_array(tmp_path):
    """Nothing of the deleted checkpoint's bytes is left in an array written over them."""
    size = (3 << 18) + 5  # not whole pages
    value = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    for kind in ("params", "state"):
        old = tmp_path / f"old-{kind}"
        old.write_bytes(os.urandom(5 << 20))  # larger than the array, not twice as large
        spares = recycle.SpareFiles([(5 << 20, str(old))])
        path = str(tmp_path / kind)
        if kind == "params":
            writer = host_arrays.ArrayWriter()
            writer.write(path, value, spares)
            writer.close()
            spec = host_arrays._spec(path, value.shape, value.dtype)  # noqa: SLF001
        else:
            shard = shard_file.ShardWriter(path, size, spares)
            half = size // 2 // shard_file.PAGE_ELEMS * shard_file.PAGE_ELEMS
            for start, stop in ((half, size), (0, half)):  # any order
                piece = aligned_empty(shard_file.whole_pages(stop - start))
                piece[: stop - start] = value[start:stop]
                shard.write(start, piece, stop - start)
            shard.finish()
            spec = shard_file.array_spec(path, size)
        assert not old.exists()  # renamed, not copied
        assert os.path.getsize(os.path.join(path, "c", "0")) == value.nbytes
        np.testing.assert_array_equal(ts.open(spec).result().read().result(), value)
        assert spares.nbytes == 0


def test_an_array_rewrites_the_file_of_its_last_save_whatever_its_size(tmp_path):
    """A file is cut to its array's size, which need not be whole pages; it is offered as the
    pages it holds, so the same array takes it at the next save."""
    size = (3 << 18) + 5
    old = np.arange(size, dtype=np.float32)
    writer = host_arrays.ArrayWriter()
    deleted = tmp_path / recycle.RECYCLED / "1"
    deleted.mkdir(parents=True)
    writer.write(str(deleted / "a"), old)
    inode = os.stat(deleted / "a" / "c" / "0").st_ino
    spares = recycle.spare_files(tmp_path)
    assert spares.nbytes == round_up_pages(old.nbytes) > old.nbytes
    new = -old
    writer.write(str(tmp_path / "a"), new, spares)
    writer.close()
    assert spares.nbytes == 0
    assert os.stat(tmp_path / "a" / "c" / "0").st_ino == inode
    spec = host_arrays._spec(str(tmp_path / "a"), new.shape, new.dtype)  # noqa: SLF001
    np.testing.assert_array_equal(ts.open(spec).result().read().result(), new)


def test_spare_files_take_the_smallest_large_enough_and_skip_vanished_ones(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    small.write_bytes(b"s" * (2 << 20))
    large.write_bytes(b"l" * (4 << 20))
    # a file another process renamed first is gone
    spares = recycle.SpareFiles(
        [(1 << 20, str(tmp_path / "gone")), (2 << 20, str(small)), (4 << 20, str(large))]
    )
    assert not spares.take(str(tmp_path / "a"), 5 << 20)
    assert not spares.take(str(tmp_path / "a"), recycle.MIN_BYTES - 1)  # a small array
    assert spares.take(str(tmp_path / "a"), 1 << 20)
    assert (tmp_path / "a").read_bytes()[:1] == b"s"
    assert spares.nbytes == 4 << 20
    assert not spares.take(str(tmp_path / "b"), (2 << 20) - 1)  # over twice the array
    assert spares.take(str(tmp_path / "b"), 2 << 20)
    assert not (tmp_path / "c").exists() and spares.nbytes == 0


def test_nothing_to_rewrite_without_a_deleted_checkpoint(tmp_path):
    assert recycle.spare_files(tmp_path).nbytes == 0
    (tmp_path / recycle.RECYCLED / "not-a-step").mkdir(parents=True)
    assert recycle.spare_files(tmp_path).nbytes == 0


def test_the_space_check_counts_the_files_a_save_rewrites(small_disk):
    tree = {"w": np.ones(3 << 20, np.float32)}  # 12 MiB on an 8 MiB disk
    with pytest.raises(CheckpointSpaceError, match="needs 12.6 MB"):
        check_space(tree, small_disk / "ckpt" / "1", concurrent=False)
    check_space(tree, small_disk / "ckpt" / "1", concurrent=False, reusable=8 << 20)


def test_a_failed_space_check_waits_for_the_leftovers_being_deleted(small_disk, monkeypatch):
    from jax_mlpo.checkpoint import training

    recycled = small_disk / "ckpt" / recycle.RECYCLED
    (recycled / "1").mkdir(parents=True)
    (recycled / "2").mkdir()
    (recycled / "1" / "left").write_bytes(b"x" * (6 << 20))  # not taken by save 2
    rmtree, started = recycle.shutil.rmtree, []

    def slow_rmtree(path, **kwargs):
        started.append(path)
        time.sleep(0.5)  # still there when the save checks the space
        rmtree(path, **kwargs)

    monkeypatch.setattr(recycle.shutil, "rmtree", slow_rmtree)
    spares = recycle.spare_files(small_disk / "ckpt")
    assert spares.nbytes == 0  # step 2 has no files
    tree = {"w": np.ones(1 << 20, np.float32)}  # 4 MiB: fits once the leftover is gone
    with pytest.raises(CheckpointSpaceError):
        check_space(tree, small_disk / "ckpt" / "3", concurrent=False)
    training._check_space(tree, small_disk / "ckpt" / "3", concurrent=False, spares=spares)
    assert started == [str(recycled / "1")] and not (recycled / "1").exists()
    assert not recycle.wait_for_deletions()  # nothing left to wait for


def test_a_step_the_policy_skips_does_not_wait_for_the_save_in_flight(tmp_path, monkeypatch):
    """A save waits for the last one before looking for its files, but only when it saves."""
    params, tx, step = make_job(tmp_path)
    opt_state = tx.init(params)
    params, opt_state = step(params, opt_state, 1.0)
    mngr = checkpoint.manager(tmp_path / "ckpt", save_interval_steps=5)
    waits = []
    wait = mngr.wait_until_finished
    monkeypatch.setattr(mngr, "wait_until_finished", lambda: waits.append(1) or wait())
    assert checkpoint.save(mngr, 5, params, opt_state, blocking=False)
    waited = len(waits)
    assert waited  # (orbax waits too)
    params, opt_state = step(params, opt_state, 2.0)
    assert not checkpoint.save(mngr, 6, params, opt_state, blocking=False)
    assert len(waits) == waited
    jax_mlpo.close(opt_state)
    mngr.close()
    assert mngr.all_steps() == [5]
