"""The update phase of one state on 1 process x N devices against N processes x 1 device.

The same fp32 parameter vector, split into N shards along its only dimension, is updated by
``jax_mlpo.adamw`` in two layouts, launched alternately (A B A B ...) in fresh processes and
fresh tier directories on the disk under ``--dir`` (the page cache dropped first when root):

- ``mesh``: one process with ``JAX_NUM_CPU_DEVICES=N``, the vector on a ``(N,)`` mesh: one
  engine over the N shards, the devices' calls meeting (:mod:`jax_mlpo.sharding.mesh`), with the
  whole ``--cache``;
- ``processes``: N processes (``jax.distributed``, one CPU device each), each an engine over
  its shard with ``--cache / N`` (the same host memory in all), tiers in ``<tier>/proc<k>``.

A step's time is the update's wall time (the slowest process's, for ``processes``). The table
gives each variant's median over repeats of each run's median step, and ``ratio = mesh /
processes``.

Usage:
  python -m experiments.bench.mlpo.mesh_update --devices 4 --state 1GiB --cache 128MiB \\
      --repeats 3 --json experiments/results/mesh_update.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from experiments.bench.harness import interleave, write_json
from experiments.bench.sysio import drop_page_cache
from jax_mlpo.testing.processes import free_port, run_local

logger = logging.getLogger("bench.mesh_update")

MODULE = "experiments.bench.mlpo.mesh_update"  # its worker processes run it again
VARIANTS = ("mesh", "processes")


def worker(cfg: dict[str, Any], pid: int, variant: str, port: int) -> None:
    """One process: ``warmup + steps`` updates; process 0 writes the run's JSON."""
    import jax

    nproc = 1 if variant == "mesh" else cfg["devices"]
    if nproc > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
            initialization_timeout=120,
        )  # fmt: skip
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_mlpo
    from experiments.job import metrics
    from jax_mlpo.config import parse_size

    devices = cfg["devices"]
    n = parse_size(cfg["state"], "--state") // 8 // devices * devices  # fp32 params: m, v
    mesh = Mesh(np.array(jax.devices()), ("data",))  # as jax_mlpo.sharding.processes's
    sharding = NamedSharding(mesh, P("data"))

    def vector(scale: float, offset: int) -> jax.Array:  # deterministic, made per shard only
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            i = np.arange(*index[0].indices(n), dtype=np.float64)
            return (np.sin(i * 0.618 + offset) * scale).astype(np.float32)

        return jax.make_array_from_callback((n,), sharding, shard)

    config = jax_mlpo.OffloadConfig(
        host_cache=parse_size(cfg["cache"], "--cache") // nproc,
        tiers=[jax_mlpo.FileTier(os.path.join(cfg["run_dir"], "tier0"))],
        subgroup_size=cfg["subgroup"], prefetch_depth=1, replan=False,
    )  # fmt: skip
    params, grads = {"w": vector(1.0, 0)}, {"w": vector(1e-3, 1)}
    tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    update = jax.jit(tx.update)
    steps = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        t0 = time.perf_counter()
        updates, state = update(grads, state, params)
        jax.block_until_ready(updates)
        dt = time.perf_counter() - t0
        del updates
        # multi-process: a collective, so the next update starts together in every process
        job = metrics.aggregate(engine.metrics[-1], {"update_s": dt}, time_key="update_s")
        if step >= cfg["warmup"]:
            steps.append(job.step_time_s)
        if pid == 0:
            logger.info("%s step %d: %.3f s", variant, step, job.step_time_s)
    jax_mlpo.close(state)
    if pid == 0:
        out = {"steps": steps, "state_bytes": 8 * n, "processes": nproc}
        Path(cfg["out"], "result.json").write_text(json.dumps(out))


def launch(cfg: dict[str, Any], variant: str, repeat: int) -> dict[str, Any]:
    """Runs one variant in fresh processes and tier directories; returns its result."""
    run = dict(cfg, run_dir=os.path.join(cfg["dir"], f"{variant}-{repeat}"))
    run["out"] = os.path.join(run["run_dir"], "out")
    shutil.rmtree(run["run_dir"], ignore_errors=True)
    os.makedirs(run["out"])
    dropped = drop_page_cache()
    nproc, per = (1, cfg["devices"]) if variant == "mesh" else (cfg["devices"], 1)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(per))
    argv = [sys.executable, "-m", MODULE, "--worker", json.dumps(run)]
    port = free_port()
    done = run_local([[*argv, str(k), variant, str(port)] for k in range(nproc)], env,
                     Path(run["out"]), cfg["timeout"])  # fmt: skip
    if not done.ok:
        for k, text in enumerate(done.logs):
            logger.error("process %d:\n%s", k, text[-4000:])
        raise SystemExit(f"{variant} run {repeat} failed: exit codes {done.codes}")
    result = json.loads(Path(run["out"], "result.json").read_text())
    result.update(variant=variant, repeat=repeat, page_cache_dropped=dropped,
                  median_step_s=statistics.median(result["steps"]))  # fmt: skip
    shutil.rmtree(run["run_dir"], ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--state", default="1GiB", help="fp32 params x 8 B (m, v)")
    parser.add_argument("--cache", default="128MiB", help="host cache, all processes together")
    parser.add_argument("--subgroup", type=int, default=4 * 2**20, help="elements")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp/jax_mlpo_mesh_update")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    if args.worker:
        pid, variant, port = rest
        worker(json.loads(args.worker), int(pid), variant, int(port))
        return
    cfg = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
    try:
        runs = interleave(VARIANTS, args.repeats, lambda v, r: launch(cfg, v, r), rotate=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    medians = {v: statistics.median(r["median_step_s"] for r in runs[v]) for v in VARIANTS}
    ratio = medians["mesh"] / medians["processes"]
    print("| variant | runs' median update (s) | each run's median |")
    print("|---|---:|---|")
    for v in VARIANTS:
        each = ", ".join(f"{r['median_step_s']:.2f}" for r in runs[v])
        print(f"| {v} | {medians[v]:.2f} | {each} |")
    print(f"ratio mesh / processes = {ratio:.3f}")
    if args.json:
        write_json(args.json, {"config": cfg, "medians_s": medians, "ratio": ratio,
                               "runs": runs})  # fmt: skip


if __name__ == "__main__":
    main()
