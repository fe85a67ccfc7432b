"""experiments/job/metrics.py: a step's figures across the job's processes, the slowest
process's time the step's, every process's figures beside it, exactly."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

from experiments.job import metrics
from jax_mlpo import StepMetrics
from jax_mlpo.testing.processes import free_port, run_local

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("metrics_worker.py")


def _two_processes(out: pathlib.Path) -> list[dict]:
    """tests/job/metrics_worker.py on two processes: each one's JSON."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    port = free_port()
    argvs = [[sys.executable, str(WORKER), str(k), "2", str(port), str(out)] for k in range(2)]
    run = run_local(argvs, env, out, timeout_s=120)
    assert run.ok, "\n".join(log[-3000:] for log in run.logs)
    return [json.loads((out / f"proc{k}.json").read_text()) for k in range(2)]


def test_metrics_flatten_and_aggregate_on_one_and_two_processes(tmp_path):
    m = StepMetrics(
        step=3, total_s=0.5, read_wait_s=0.1, compute_s=0.2, cache_hits=2, subgroups=7,
        bytes_read={"/nvme/run/proc1": 2**40 + 1, "/pfs/run": 10},
        bytes_written={"/nvme/run/proc1": 5, "/pfs/run": 6},
        tier_busy_s={"/nvme/run/proc1": 0.25, "/pfs/run": 0.125},
    )  # fmt: skip
    flat = m.as_flat()  # the tiers as configured: a process's proc<k> directory dropped
    assert flat["bytes_read:/nvme/run"] == 2**40 + 1 and flat["total_s"] == 0.5
    back = StepMetrics.from_flat(3, flat)
    assert back.bytes_read == {"/nvme/run": 2**40 + 1, "/pfs/run": 10}
    assert back.total_s == 0.5 and back.cache_hits == 2 and back.subgroups == 7
    job = metrics.aggregate(m, {"step_s": 1.5}, time_key="step_s")
    assert job.processes == 1 and job.slowest == 0 and job.step_time_s == 1.5
    assert job.metrics == back and job.per_process["step_s"] == [1.5]
    assert job.total("bytes_written:/pfs/run") == 6
    assert metrics.aggregate(None, {"step_s": 2.0}, time_key="step_s").metrics is None
    with pytest.raises(KeyError, match="time_key"):
        metrics.aggregate(None, {"x": 1.0}, time_key="step_s")
    # two processes: the same aggregate on both, the slowest process's figures, every
    # process's beside them, exact (2**40 + k travels as float64)
    infos = _two_processes(tmp_path)
    aggs = [{k: v for k, v in info.items() if k != "own"} for info in infos]
    assert aggs[0] == aggs[1]
    agg = aggs[0]
    assert agg["slowest"] == 1 and agg["step_time_s"] == 2.0
    assert agg["timings"] == {"step_s": 2.0, "big": 2.0**40 + 1}
    assert agg["per_process"]["big"] == [2.0**40, 2.0**40 + 1]
    assert agg["per_process"]["bytes_read:/nvme/run"] == [2.0**40, 2.0**40 + 1]
    for key, value in infos[1]["own"].items():
        assert agg["per_process"][key][1] == value
    assert agg["metrics"]["bytes_read"] == {"/nvme/run": 2**40 + 1}
    assert agg["metrics"]["cache_hits"] == 1
