"""The sweep of experiments/bench/disk_limit.py run on jax_mlpo's disk probe instead of fio."""

from __future__ import annotations

from experiments.bench import disk_limit


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
