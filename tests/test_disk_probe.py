"""The disk sweep's own probe (jax_mlpo/ffi/disk_probe.cc): what it moves, what it refuses,
and the sweep of experiments/bench/disk_limit.py run with it instead of fio."""

from __future__ import annotations

import pytest

from experiments.bench import disk_limit
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


def test_the_sweep_runs_on_the_probe_without_fio(tmp_path):
    result = disk_limit.sweep(str(tmp_path / "sweep"), "8MiB", 0.2, ["1M", "2M"], [2],
                              ["read", "write", "mixed"], engine="probe")  # fmt: skip
    assert result["engine"] == "probe" and len(result["points"]) == 6
    assert result["limit_gbps"] == result["best"]["mixed"]["total_gbps"] > 0
    assert not list((tmp_path / "sweep").iterdir())  # the file it laid out is removed
    table = disk_limit.table(result, ["read", "write", "mixed"], ["1M", "2M"], [2])
    assert "best mixed" in table


def test_a_sweep_point_is_the_median_of_its_passes(tmp_path):
    result = disk_limit.sweep(str(tmp_path / "sweep"), "8MiB", 0.1, ["1M"], [2], ["mixed"],
                              engine="probe", repeats=3)  # fmt: skip
    (point,) = result["points"]
    assert len(point["runs_gbps"]) == 3 and result["repeats"] == 3
    assert point["total_gbps"] == sorted(point["runs_gbps"])[1]
