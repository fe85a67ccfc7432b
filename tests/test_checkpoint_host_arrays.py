"""The params in a checkpoint: written by jax_mlpo before ``save`` returns, read by plain orbax."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax_mlpo
from jax_mlpo import checkpoint
from jax_mlpo.checkpoint import host_arrays, host_reads
from jax_mlpo.tiers.posix import aligned_empty


def make_job(root: Path):
    params = {
        "w": jax.random.normal(jax.random.PRNGKey(0), (1024, 1536), jnp.bfloat16),  # 3 MiB
        "b": jnp.arange(16, dtype=jnp.float32),  # small: orbax's own path
    }
    tx = jax_mlpo.adamw(
        1e-2, offload=jax_mlpo.OffloadConfig(tiers=[jax_mlpo.FileTier(str(root / "tier"))])
    )

    def step(p, s, k):
        grads = jax.tree.map(lambda x: jnp.cos(x * k).astype(x.dtype), p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    return params, tx, jax.jit(step, donate_argnums=(0,))


def bits(params) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).view(np.uint8).copy() for k, v in params.items()}


def saved_checkpoint(root: Path):
    """``(manager, the saved params' bits)``: ``make_job``'s state after one update, saved
    synchronously as step 1 into ``root / "ckpt"``, its optimizer closed."""
    params, tx, step = make_job(root)
    opt_state = tx.init(params)
    params, opt_state = step(params, opt_state, 1.0)
    mngr = checkpoint.manager(root / "ckpt", async_save=False)
    checkpoint.save(mngr, 1, params, opt_state)
    jax_mlpo.close(opt_state)
    return mngr, bits(params)


def test_async_save_writes_large_params_before_it_returns(tmp_path):
    params, tx, step = make_job(tmp_path)
    opt_state = tx.init(params)
    params, opt_state = step(params, opt_state, 1.0)
    saved = bits(params)
    mngr = checkpoint.manager(tmp_path / "ckpt")
    checkpoint.save(mngr, 1, params, opt_state, blocking=False)
    # the large leaf's file is complete when save returns: no copy of it is kept for later
    tmp = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("1")]
    data = [p for p in tmp[0].rglob("*") if p.is_file() and p.parent.parent.name == "c"]
    assert len(data) == 1 and data[0].stat().st_size == 1024 * 1536 * 2, data
    array = tmp_path / "ckpt" / "1" / "params" / data[0].parents[2].name  # once published
    for k in (2.0, 3.0):  # donate the saved params' buffers while the state is streamed
        params, opt_state = step(params, opt_state, k)
    jax.block_until_ready(params)
    assert bits(params)["w"].tobytes() != saved["w"].tobytes()
    mngr.wait_until_finished()
    jax_mlpo.close(opt_state)

    (tmp_path / "again").mkdir()
    fresh, tx, step = make_job(tmp_path / "again")
    opt_state = tx.init(fresh)
    # the README's restore: shapes as the target, the initial params dropped
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fresh)
    del fresh
    restored = checkpoint.restore(mngr, shapes, opt_state)
    assert {k: v.tobytes() for k, v in bits(restored.params).items()} == {
        k: v.tobytes() for k, v in saved.items()
    }
    params, opt_state = step(restored.params, restored.opt_state, 2.0)
    assert bits(params)["w"].tobytes() != saved["w"].tobytes()
    jax_mlpo.close(opt_state)
    mngr.close()

    # plain orbax reads the params item (its own NumpyHandler, through tensorstore)
    item = tmp_path / "ckpt" / "1" / "params"
    plain = ocp.PyTreeCheckpointer().restore(item)
    assert np.asarray(plain["tree"]["w"]).view(np.uint8).tobytes() == saved["w"].tobytes()
    # written by jax_mlpo (one raw chunk), not by tensorstore (a zarr3 shard with an index)
    meta = json.loads((array / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes"]


def test_a_restore_reads_the_large_params_itself_and_leaves_the_rest_to_orbax(
    tmp_path, monkeypatch
):
    mngr, saved = saved_checkpoint(tmp_path)
    direct, by_orbax = [], []
    read_all = host_reads.read_all
    orbax_read = ocp.type_handlers.NumpyHandler.deserialize

    def traced_read_all(arrays):
        direct.extend(Path(a[0]).parents[len(a[1])].name for a in arrays)  # <array>/c/0/0
        return read_all(arrays)

    async def traced_orbax_read(self, infos, args=None):
        by_orbax.extend(info.name for info in infos)
        return await orbax_read(self, infos, args)

    monkeypatch.setattr(host_reads, "read_all", traced_read_all)
    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "deserialize", traced_orbax_read)
    (tmp_path / "again").mkdir()
    fresh, tx, _ = make_job(tmp_path / "again")
    opt_state = tx.init(fresh)
    restored = checkpoint.restore(mngr, fresh, opt_state)
    assert direct == ["tree.w"]
    assert "tree.w" not in by_orbax and "tree.b" in by_orbax
    got = bits(restored.params)
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in saved.items()}
    jax_mlpo.close(restored.opt_state)
    mngr.close()


def test_a_truncated_large_param_is_left_to_orbax_and_named(tmp_path):
    mngr, _ = saved_checkpoint(tmp_path)
    array = tmp_path / "ckpt" / "1" / "params" / "tree.w"
    assert host_reads.one_raw_chunk(str(array)) is not None
    data = array / "c" / "0" / "0"
    os.truncate(data, data.stat().st_size - 4096)
    assert host_reads.one_raw_chunk(str(array)) is None  # not ours to read: orbax's error
    (tmp_path / "again").mkdir()
    fresh, tx, _ = make_job(tmp_path / "again")
    opt_state = tx.init(fresh)
    with pytest.raises(ValueError, match="tree.w"):  # tensorstore's, naming the array
        checkpoint.restore(mngr, fresh, opt_state)
    jax_mlpo.close(opt_state)
    mngr.close()


def test_a_flipped_byte_in_a_large_param_is_detected(tmp_path):
    mngr, _ = saved_checkpoint(tmp_path)
    data = [p for p in (tmp_path / "ckpt" / "1" / "params" / "tree.w").rglob("*") if p.is_file()]
    data = [p for p in data if p.name != "zarr.json"]
    assert len(data) == 1
    with open(data[0], "r+b") as f:
        f.seek(1234567)
        byte = f.read(1)
        f.seek(1234567)
        f.write(bytes([byte[0] ^ 0x10]))
    (tmp_path / "again").mkdir()
    fresh, tx, _ = make_job(tmp_path / "again")
    opt_state = tx.init(fresh)
    with pytest.raises(checkpoint.CorruptCheckpointError, match="leaf tree/w does not match"):
        checkpoint.restore(mngr, fresh, opt_state)
    jax_mlpo.close(opt_state)
    mngr.close()


def test_a_full_disk_fails_before_any_write(small_disk):
    value = np.ones(4 << 20, np.float32)  # 16 MiB on an 8 MiB disk
    writer = host_arrays.ArrayWriter()
    with pytest.raises(OSError) as info:
        writer.write(str(small_disk / "a"), value)
    writer.close()
    assert info.value.errno == errno.ENOSPC
    assert os.path.getsize(small_disk / "a" / "c" / "0") == 0  # its space reserved first


def test_an_async_save_streams_the_state_after_it_returns(tmp_path, monkeypatch):
    """The params are written first, alone on the disk; the state's stream starts once save
    has returned (it would otherwise share the disk with them and hold the loop longer)."""
    from jax_mlpo.checkpoint import handler

    events: list[str] = []
    write, stream = host_arrays.ArrayWriter.write, handler.write_streams

    def traced_write(self, path, value, spares=None):
        digest = write(self, path, value, spares)
        events.append("array written")
        return digest

    def traced_stream(directory, streams, spares=None):
        events.append("stream starts")
        return stream(directory, streams, spares)

    monkeypatch.setattr(host_arrays.ArrayWriter, "write", traced_write)
    monkeypatch.setattr(handler, "write_streams", traced_stream)
    params, tx, step = make_job(tmp_path)
    opt_state = tx.init(params)
    params, opt_state = step(params, opt_state, 1.0)
    mngr = checkpoint.manager(tmp_path / "ckpt")
    save = mngr.save

    def traced_save(*args, **kwargs):
        started = save(*args, **kwargs)
        events.append("save returned")  # before jax_mlpo.checkpoint.save lets the streams go
        return started

    monkeypatch.setattr(mngr, "save", traced_save)
    checkpoint.save(mngr, 1, params, opt_state, blocking=False)
    mngr.wait_until_finished()
    # one stream per item (params' and extra's have nothing to stream)
    assert events == ["array written", "save returned", *["stream starts"] * 3], events
    jax_mlpo.close(opt_state)
    mngr.close()


def test_a_manager_creating_directories_asynchronously(tmp_path):
    """orbax's default manager makes the item directories in a background thread while the
    params are being written: they wait for it (else orbax's mkdir fails and the save hangs)."""
    params, tx, step = make_job(tmp_path)
    opt_state = tx.init(params)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")  # orbax's defaults, not checkpoint.manager
    assert ocp.CheckpointManagerOptions().async_options is None  # creation is asynchronous
    for k in range(1, 4):
        params, opt_state = step(params, opt_state, float(k))
        checkpoint.save(mngr, k, params, opt_state, blocking=k % 2 == 0)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2, 3]
    saved = bits(params)
    jax_mlpo.close(opt_state)
    (tmp_path / "again").mkdir()
    fresh, tx, _ = make_job(tmp_path / "again")
    restored = checkpoint.restore(mngr, fresh, tx.init(fresh))
    assert bits(restored.params)["w"].tobytes() == saved["w"].tobytes()
    jax_mlpo.close(restored.opt_state)
    mngr.close()


def test_every_array_file_and_directory_is_synced_after_its_data(tmp_path, monkeypatch):
    """The arrays' metadata is written without tensorstore's own fsync (it stalled the stream
    under the checkpoint's I/O): the writers make zarr.json and every directory entry down to
    the data file durable themselves, after the data."""
    from jax_mlpo.checkpoint import shard_file

    synced: list[str] = []
    fsync, fdatasync = os.fsync, os.fdatasync

    def traced(sync, kind):
        def call(fd):
            synced.append(f"{kind} {os.readlink(f'/proc/self/fd/{fd}')}")
            return sync(fd)

        return call

    monkeypatch.setattr(os, "fsync", traced(fsync, "fsync"))
    monkeypatch.setattr(os, "fdatasync", traced(fdatasync, "fdatasync"))
    writer = host_arrays.ArrayWriter()
    param = tmp_path / "item" / "w"
    (tmp_path / "item").mkdir()
    writer.write(str(param), np.ones((4, 1 << 18), np.float32))
    writer.close()
    assert synced == [
        f"fdatasync {param}/c/0/0", f"fsync {param}/zarr.json", f"fsync {param}/c/0",
        f"fsync {param}/c", f"fsync {param}", f"fsync {tmp_path / 'item'}",
    ]  # fmt: skip
    synced.clear()
    shard = shard_file.ShardWriter(str(tmp_path / "item" / "mu.0"), 1 << 20)
    piece = aligned_empty(1 << 20)  # O_DIRECT: page-aligned
    piece[:] = 1.0
    shard.write(0, piece, 1 << 20)
    shard.finish()
    state = tmp_path / "item" / "mu.0"
    assert synced == [
        f"fdatasync {state}/c/0", f"fsync {state}/zarr.json", f"fsync {state}/c",
        f"fsync {state}", f"fsync {tmp_path / 'item'}",
    ]  # fmt: skip
