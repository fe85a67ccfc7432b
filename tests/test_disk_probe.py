"""The disk sweep's own probe (jax_mlpo/ffi/disk_probe.cc): what it moves, what it refuses (the
sweep of experiments/bench/disk_limit.py run with it: tests/job/test_disk_limit.py)."""

from __future__ import annotations

import pytest

from jax_mlpo.native import disk_probe

MiB = 2**20


@pytest.fixture
def laid_out(tmp_path):
    path = tmp_path / "probe.dat"
    disk_probe.lay_out(path, 8 * MiB)
    return path


def test_each_direction_moves_only_its_own_bytes(laid_out):
    read = disk_probe.probe(laid_out, 8 * MiB, MiB, 2, "read", 0.2)
    write = disk_probe.probe(laid_out, 8 * MiB, MiB, 2, "write", 0.2)
    mixed = disk_probe.probe(laid_out, 8 * MiB, MiB, 4, "mixed", 0.3)
    assert read.read_gbps > 0 and read.write_gbps == 0
    assert write.write_gbps > 0 and write.read_gbps == 0
    assert mixed.read_gbps > 0 and mixed.write_gbps > 0
    assert all(p.seconds >= 0.2 for p in (read, write, mixed))
    assert laid_out.stat().st_size == 8 * MiB  # requests stay inside the file


def test_bad_arguments_and_paths_say_what_is_wrong(laid_out, tmp_path):
    with pytest.raises(ValueError, match="positive multiple of 4096"):
        disk_probe.probe(laid_out, 8 * MiB, 1000, 2, "read", 0.1)
    with pytest.raises(ValueError, match="at most the file's"):
        disk_probe.probe(laid_out, MiB, 2 * MiB, 2, "read", 0.1)
    with pytest.raises(ValueError, match="mode must be one of"):
        disk_probe.probe(laid_out, 8 * MiB, MiB, 2, "append", 0.1)
    with pytest.raises(OSError, match="cannot open .*missing.dat: No such file"):
        disk_probe.probe(tmp_path / "missing.dat", 8 * MiB, MiB, 2, "read", 0.1)
    with pytest.raises(OSError, match="No such file or directory"):
        disk_probe.lay_out(tmp_path / "no-dir" / "probe.dat", MiB)
