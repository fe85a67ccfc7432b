"""One process of tests/job/test_metrics.py's two: the job's step figures gathered across
processes (experiments/job/metrics.py's ``aggregate``) on made-up figures.

Usage: metrics_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Process k reports a step time of k + 1 s (the last process is the slowest) and 2**40 + k (a
figure float32 would round), beside engine figures of its own; it writes OUT_DIR/proc<k>.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "1"

import jax  # noqa: E402


def main() -> None:
    pid, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                               process_id=pid, initialization_timeout=60)  # fmt: skip
    from experiments.job import metrics
    from jax_mlpo import StepMetrics

    own = StepMetrics(step=4, total_s=0.1 * (pid + 1), subgroups=3, cache_hits=pid,
                      bytes_read={f"/nvme/run/proc{pid}": 2**40 + pid},
                      bytes_written={f"/nvme/run/proc{pid}": 7},
                      tier_busy_s={f"/nvme/run/proc{pid}": 0.5})  # fmt: skip
    job = metrics.aggregate(own, {"step_s": pid + 1.0, "big": 2.0**40 + pid}, time_key="step_s")
    info = {
        "slowest": job.slowest,
        "step_time_s": job.step_time_s,
        "timings": job.timings,
        "per_process": job.per_process,
        "metrics": job.metrics.as_dict(),
        "own": own.as_flat(),
    }
    with open(os.path.join(out_dir, f"proc{pid}.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
