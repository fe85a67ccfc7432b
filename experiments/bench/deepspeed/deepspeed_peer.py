"""Update phase side by side: jax_mlpo against DeepSpeed ZeRO-Infinity's NVMe optimizer swappers.

Same fp32 state on disk (master params p and moments m, v: jax_mlpo gets bf16 params so that
its tiers hold p, m, v as DeepSpeed's do; plus fp32 gradients where the system writes them),
same subgroup size, same pinned host memory budget, same disk directory for both systems:

- ``deepspeed partitioned`` / ``deepspeed pipelined``: DeepSpeed's own PartitionedOptimizerSwapper
  and PipelinedOptimizerSwapper with DeepSpeedCPUAdam, driven standalone as ``stage3.py`` drives
  them (``ds_update.py``, run in the DeepSpeed venv ``.peer-venv``). ZeRO-3 swaps the fp32
  gradients out in backward and back in with the state: ``grad_write_s`` is the backward part,
  ``update_s`` the optimizer step (swap in, CPU Adam, swap out, per subgroup).
- ``jax_mlpo baseline``: every principle off (one path, ascending, nothing retained, fp32
  gradients written to the tier in the update and read back); its ``total_s`` includes that
  gradient write.
- ``jax_mlpo all (2 dirs)``: all principles, two tier directories on the same disk (DeepSpeed has
  one ``nvme_path``; two directories on one disk give the placement nothing to exploit, but it is
  the configuration all principles are built for); ``jax_mlpo all (1 dir)``: all principles on
  the single directory DeepSpeed uses; ``jax_mlpo all (1 dir), bf16 m and v``: the same with
  ``mu_dtype`` and ``nu_dtype`` bfloat16 (8 of the 12 bytes per param on the disk, the same
  host budget); ``jax_mlpo all (1 dir), q8 m and v``: with ``"q8"`` moments (6.03 of 12).

Host memory budget: DeepSpeed pipelined needs ``buffer_count`` = 3 subgroups x 4 tensors (p, m,
v, gradient) = 12 buffers of one subgroup each, 48 bytes per subgroup element; every system gets
that budget (the partitioned swapper uses only 4 of its 12 buffers at a time, jax_mlpo's
``host_cache`` is set to the same bytes). jax_mlpo tiers use O_DIRECT (``io_mode="direct"``), as
DeepSpeed's async_io does, so neither reads from the page cache.

Each system runs in its own process per round; rounds interleave the systems (A B C ... A B C
...), each run has warm-up steps then ``--steps`` measured steps, a run's figure is its median
step, and the table gives the median and min-max over the rounds. Each round also measures the
disk (fio, O_DIRECT, 1 MiB requests, queue depth 8 as DeepSpeed's aio config); memcpy and STREAM
triad are measured at the start and the end.

Usage (after ``bash experiments/bench/deepspeed/install_deepspeed_peer.sh``):
  .venv/bin/python -m experiments.bench.deepspeed.deepspeed_peer --state 1GiB \
      --subgroup 8388608 --rounds 5 --json experiments/results/deepspeed_update.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time

from experiments.bench.deepspeed.peer import (
    ROOT,
    module_command,
    require_peer,
    worker_command,
    worker_env,
)
from experiments.bench.deepspeed.peer_report import LABELS, print_report, summarize
from experiments.bench.harness import (
    interleave,
    median_time,
    medians,
    spread,
    write_json,
)
from experiments.bench.sysio import (
    drop_page_cache,
    filesystem,
    fio_bandwidth,
    fio_mixed,
    proc_io,
)

logger = logging.getLogger("bench.deepspeed_peer")

MODULE = "experiments.bench.deepspeed.deepspeed_peer"  # its jax_mlpo workers run it again
SYSTEMS = (
    "ds-partitioned", "ds-pipelined", "jax-baseline", "jax-all-2dirs", "jax-all-1dir",
    "jax-bf16-moments", "jax-q8-moments", "jax-all-1dir-threads",
)  # fmt: skip


# ---- jax_mlpo worker (runs in the jax venv) ------------------------------------------------


def jax_worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_mlpo

    n = args.elems
    dtype = jnp.bfloat16 if args.jax_dtype == "bf16" else jnp.float32
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal(n, np.float32), dtype)}
    grads = {"w": jnp.asarray(rng.standard_normal(n, np.float32) * 1e-3, dtype)}
    ntiers = 2 if args.worker == "jax-all-2dirs" else 1
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    # "-threads": the tier's requests on a thread each (FileTier.io_submit) instead of kernel AIO
    io_submit = "threads" if args.worker.endswith("-threads") else "aio"
    tiers = tuple(
        jax_mlpo.FileTier(
            os.path.join(args.dir, f"tier{k}"),
            io_mode=args.io_mode,
            io_submit=io_submit,
            chunk_bytes=args.chunk,
            queue_depth=args.queue_depth,
            sync=args.tier_sync == "on",
        )
        for k in range(ntiers)
    )
    config = jax_mlpo.OffloadConfig(
        host_cache=args.cache,
        tiers=tiers,
        subgroup_size=args.subgroup,
        prefetch_depth=args.prefetch_depth,
    )
    if args.worker == "jax-baseline":
        config = config.baseline()
    t0 = time.perf_counter()
    moments = {}
    if args.worker == "jax-bf16-moments":
        moments = dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
    if args.worker == "jax-q8-moments":
        moments = dict(mu_dtype="q8", nu_dtype="q8", q8_rounding=args.q8_rounding)
    tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config, **moments)
    # The gradients donated, as they are intermediates inside a train step: the update is then
    # written over their buffer (a fresh copy each step, made outside the timing).
    update = jax.jit(tx.update, donate_argnums=(0,))
    state = tx.init(params)
    init_s = time.perf_counter() - t0
    steps = []
    for step in range(args.warmup + args.steps):
        dropped = drop_page_cache(level=1)  # outside the timing: every step reads from the disk
        step_grads = jax.block_until_ready(jax.tree.map(jnp.copy, grads))
        io0 = proc_io()
        t0 = time.perf_counter()
        updates, state = update(step_grads, state, params)
        jax.block_until_ready(updates)
        jax_mlpo.engine_of(state).drain()  # its last write-backs (write_behind) count too
        dt = time.perf_counter() - t0
        io1 = proc_io()
        del updates
        m = jax_mlpo.engine_of(state).metrics[-1]
        row = {
            "update_s": dt,
            "engine_s": m.total_s,
            "grad_write_s": m.grad_write_s,
            "read_wait_s": m.read_wait_s,
            "write_wait_s": m.write_wait_s,
            "compute_s": m.compute_s,
            "cache_hits": m.cache_hits,
            "tier_bytes_read": sum(m.bytes_read.values()),
            "tier_bytes_written": sum(m.bytes_written.values()),
            "tier_busy_s": {os.path.basename(k): v for k, v in m.tier_busy_s.items()},
            "bytes_read": io1["read"] - io0["read"],
            "bytes_written": io1["write"] - io0["write"],
            "page_cache_dropped": dropped,
        }
        logger.info("%s step %d: %s", args.worker, step, row)
        if step >= args.warmup:
            steps.append(row)
    engine = jax_mlpo.engine_of(state)
    out = {
        "system": LABELS[args.worker],
        "jax_mlpo_tiers": [os.path.basename(t.tier.path) for t in engine.tiers],
        "subgroups_per_tier": [engine.tier_of.count(k) for k in range(len(engine.tiers))],
        "host_cache": config.host_cache,
        "dtype": args.jax_dtype,
        "retained": engine.plan.retained,
        "init_s": init_s,
        "steps": steps,
    }
    out.update(medians(steps, ("update_s", "engine_s", "grad_write_s", "read_wait_s", "compute_s")))
    jax_mlpo.close(state)
    shutil.rmtree(args.dir, ignore_errors=True)
    return out


# ---- hardware limits -------------------------------------------------------------------------


def memory_bandwidth(n: int = 1 << 26, repeats: int = 7) -> dict:
    """memcpy (8 B/elem) and STREAM triad (12 B/elem) with jax_mlpo's native kernels."""
    import numpy as np

    from jax_mlpo import native

    a, b, c = (np.full(n, 1.0, np.float32) for _ in range(3))
    res = {}
    for key, nbytes, fn in (
        ("memcpy_gbps", 8 * n, lambda: native.parallel_copy(a, b)),
        ("triad_gbps", 12 * n, lambda: native.stream_triad(a, b, c, 3.0)),
    ):
        res[key] = nbytes / median_time(fn, repeats) / 1e9
    res["threads"] = native.num_threads()
    return res


# ---- the driver ------------------------------------------------------------------------------


def run_system(system: str, args, directory: str) -> dict:
    common = ["--subgroup", str(args.subgroup), "--steps", str(args.steps)]
    if system.startswith("ds-"):
        env = worker_env()
        cmd = worker_command(
            "ds_update.py",
            "--swapper",
            system[3:],
            "--dir",
            directory,
            "--elems",
            str(args.elems),
            "--buffer-count",
            str(args.buffer_count),
            "--warmup",
            str(args.ds_warmup),
            *common,
        )
    else:
        env = dict(os.environ)
        cmd = module_command(
            MODULE,
            "--worker",
            system,
            "--dir",
            directory,
            "--elems",
            str(args.elems),
            "--cache",
            str(args.cache_bytes),
            "--warmup",
            str(args.jax_warmup),
            "--io-mode",
            args.io_mode,
            "--chunk",
            args.chunk,
            "--queue-depth",
            str(args.queue_depth),
            "--tier-sync",
            args.tier_sync,
            "--prefetch-depth",
            str(args.prefetch_depth),
            "--jax-dtype",
            args.jax_dtype,
            "--q8-rounding",
            args.q8_rounding,
            *common,
        )
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"{system} failed (rc {res.returncode}):\n{res.stderr[-4000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", default="1GiB", help="m, v bytes (8 B/param), as update_phase")
    parser.add_argument("--subgroup", type=int, default=8 << 20, help="elements per subgroup")
    parser.add_argument(
        "--buffer-count",
        type=int,
        default=12,
        help="DeepSpeed pinned buffers (pipelined needs 3 x 4 with grads)",
    )
    parser.add_argument("--prefetch-depth", type=int, default=1)
    parser.add_argument(
        "--jax-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="jax_mlpo params and grads: bf16 puts fp32 p, m, v in the tiers (12 B/param, as "
        "DeepSpeed); fp32 params stay with the caller and only m, v are offloaded (8 B/param)",
    )
    parser.add_argument("--io-mode", default="direct", help="jax_mlpo FileTier.io_mode")
    parser.add_argument("--chunk", default="8MiB", help="jax_mlpo FileTier.chunk_bytes")
    parser.add_argument("--queue-depth", type=int, default=8, help="jax_mlpo FileTier.queue_depth")
    parser.add_argument("--tier-sync", choices=("on", "off"), default="off",
                        help="jax_mlpo FileTier.sync")  # fmt: skip
    parser.add_argument("--q8-rounding", default="stochastic", choices=("nearest", "stochastic"),
                        help="jax-q8-moments' q8_rounding")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--ds-warmup", type=int, default=1, help="after DeepSpeed's initial pass")
    parser.add_argument("--jax-warmup", type=int, default=4, help="covers a re-plan")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--dir", default="/tmp/jax_mlpo-ds-peer", help="the one disk directory both systems use"
    )
    parser.add_argument("--limit-block", default="32M", help="fio mixed request size (the limit)")
    parser.add_argument("--limit-depth", type=int, default=32, help="fio mixed requests in flight")
    parser.add_argument("--burst-runtime", type=int, default=2,
                        help="seconds of the burst-length mixed figure (about a step)")  # fmt: skip
    parser.add_argument("--json", default=None)
    # worker mode (internal)
    parser.add_argument("--worker", choices=[s for s in SYSTEMS if s.startswith("jax")])
    parser.add_argument("--elems", type=int)
    parser.add_argument("--cache", type=int)
    parser.add_argument("--warmup", type=int)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )

    if args.worker:
        print(json.dumps(jax_worker(args)))
        return

    from jax_mlpo.config import parse_size

    args.elems = parse_size(args.state, "--state") // 8
    args.cache_bytes = args.buffer_count * args.subgroup * 4
    systems = args.systems.split(",")
    if any(s.startswith("ds-") for s in systems):
        require_peer()
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "disk_dir": args.dir,
        "filesystem": filesystem(os.path.dirname(args.dir)),
    }
    limits = {"memory_start": memory_bandwidth(), "disk": [], "mixed": [], "mixed_burst": []}
    logger.info("memory: %s", limits["memory_start"])

    def measure_disk(rnd: int) -> None:
        disk = fio_bandwidth(os.path.join(args.dir, "fio"))
        # the limit an update is held to: fio's 50/50 random mix at the sweep's best point
        # (experiments/bench/disk_limit.py; 32 MiB x 32 in flight on this disk)
        mixed = fio_mixed(os.path.join(args.dir, "fio"), block=args.limit_block,
                          depth=args.limit_depth)  # fmt: skip
        # the same point for as long as a step lasts, about a second or two: an update is a
        # burst, and short fio runs have moved more than 10 s ones on this disk
        burst = fio_mixed(os.path.join(args.dir, "fio"), block=args.limit_block,
                          depth=args.limit_depth, runtime_s=args.burst_runtime)  # fmt: skip
        shutil.rmtree(args.dir, ignore_errors=True)
        limits["disk"].append(disk)
        limits["mixed"].append(mixed)
        limits["mixed_burst"].append(burst)
        logger.info("round %d disk: %s mixed: %s burst: %s", rnd, disk, mixed, burst)

    def run(system: str, rnd: int) -> dict:
        out = run_system(system, args, os.path.join(args.dir, system))
        out["round"] = rnd
        logger.info(
            "round %d %s: update %.2f s (grad write %.2f s) process %.0f s",
            rnd,
            system,
            out["update_s"],
            out["grad_write_s"],
            out["process_s"],
        )
        return out

    runs = interleave(systems, args.rounds, run, before_round=measure_disk)
    limits["memory_end"] = memory_bandwidth()
    limits["disk_summary"] = (
        {k: spread(d[k] for d in limits["disk"] if k in d) for k in ("write_gbps", "read_gbps")}
        if all("error" not in d for d in limits["disk"])
        else limits["disk"]
    )

    rows, ratios = summarize(runs, limits)
    print_report(rows, ratios, limits, args)
    result = {
        "args": vars(args),
        "machine": machine,
        "limits": limits,
        "rows": rows,
        "ratios": ratios,
        "runs": runs,
    }
    write_json(args.json, result)


if __name__ == "__main__":
    main()
