"""Node-level permits in the update phase: N processes sharing two capped tiers, with and without.

N local processes (``jax.distributed`` on CPU, one device each) run the data-parallel offloaded
AdamW update (``jax_mlpo.adamw`` on a sharded parameter vector, each process streaming its
shard's state through its own ``<tier>/proc<k>`` directories) on two tiers that every process of
the node shares. Two variants, launched alternately (A B A B ...), each in fresh processes and
fresh tier directories:

- ``process``: ``FileTier.max_concurrency`` requests in flight per process and direction (the
  per-process limit only: N processes put N times that on the device);
- ``node``: the same plus ``node_max_concurrency`` (permits shared by the node's processes,
  flock'd lock files in ``--permits-dir``).

What a "capped tier" is when processes share it (``--device``):

- ``shared-cap`` (default): a device of fixed bandwidth shared by the node. The cap is
  jax_mlpo's token bucket (a request holding its permit reserves ``bytes / cap`` on a virtual
  clock and completes no earlier than its reservation), with the virtual clock kept in a file
  under ``--permits-dir`` (flock'd) instead of in each process, so the node's processes
  together never exceed the cap. ``FileTier.bandwidth_cap`` paces each process on its own (N
  processes would get N times the cap), which does not model a shared device. The tiers' files
  go to tmpfs (``/dev/shm``) so that the bucket is the only device: on a disk, fsync stalls
  under concurrent writers showed through the cap (single writes of 2 MiB taking 0.8 s). This
  model has no interference between concurrent streams: it shows what serialization by the
  permits costs or saves when the device's throughput does not depend on how many requests it
  serves.
- ``disk``: no cap, the real disk under ``--dir`` with O_DIRECT (the posix I/O engine's
  default), the page cache dropped before each run when root. Whatever interference (or gain
  from concurrency) the device really has is in the result.
- ``process-cap``: ``FileTier.bandwidth_cap`` per process, for comparison (N x the cap).

Each run: ``--warmup`` steps, then ``--steps`` measured; a step's time is the slowest process's
update (``experiments.job.metrics.aggregate``; the processes start each update together). The table
gives the median over repeats of each run's median step, and ``ratio = node / process`` (< 1:
node-level permits make the update faster). The JSON holds every run, every process's step
times and permit waits, and the merged request traces of the last repeat (``--plot`` draws
one step of them).

Usage:
  python -m experiments.bench.mlpo.dist_update --processes 2 --state 512MiB --cache 64MiB \
      --caps 300MB,150MB --repeats 3 --json experiments/results/dist_update_shared_cap.json \
      --plot docs/dist_update_trace.png
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

logger = logging.getLogger("bench.dist_update")

MODULE = "experiments.bench.mlpo.dist_update"  # its worker processes run it again

VARIANTS = ("process", "node")
DEVICES = ("shared-cap", "disk", "process-cap")
# every process's figures kept per step (the rest of StepMetrics.as_flat's keys dropped)
KEPT = ("update_s", "permit_wait_s", "total_s", "read_wait_s", "write_wait_s", "compute_s",
        "bytes_", "tier_busy_s")  # fmt: skip


# -- one process of a run ----------------------------------------------------------------------


def _offload_config(cfg: dict[str, Any], variant: str) -> Any:
    import jax_mlpo
    from jax_mlpo.config import Bandwidth, TierLimits, parse_size

    caps = [parse_size(c, "--caps") for c in cfg["caps"].split(",")]
    tiers = []
    for k, cap in enumerate(caps):
        tiers.append(
            jax_mlpo.FileTier(
                os.path.join(cfg["run_dir"], f"tier{k}"),
                limits=TierLimits(
                    max_concurrency=cfg["concurrency"],
                    node_max_concurrency=cfg["node_concurrency"] if variant == "node" else None,
                    # shared-cap: one pacing clock for the node's processes (a shared device);
                    # process-cap: each process paced alone
                    node_bandwidth_cap=cap if cfg["device"] == "shared-cap" else None,
                    bandwidth_cap=cap if cfg["device"] == "process-cap" else None,
                ),
                # placement needs the tiers' ratio only; no probe, the same plan in every run
                bandwidth=Bandwidth(read=cap, write=cap),
            )
        )
    return jax_mlpo.OffloadConfig(
        host_cache=cfg["cache"],
        tiers=tiers,
        subgroup_size=cfg["subgroup"],
        prefetch_depth=cfg["prefetch_depth"],
        replan=False,  # the same placement in both variants
        node_permits_dir=cfg["permits_dir"],
    )


def worker(cfg: dict[str, Any], pid: int, variant: str, port: int) -> None:
    """One process: ``warmup + steps`` updates; process 0 writes the run's JSON."""
    nproc = cfg["processes"]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if nproc > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=nproc,
            process_id=pid,
            initialization_timeout=120,
        )
    import numpy as np
    from jax.experimental import multihost_utils

    import jax_mlpo
    from experiments.job import metrics
    from jax_mlpo.config import parse_size
    from jax_mlpo.sharding import processes as distributed

    n = parse_size(cfg["state"], "--state") // 8 // nproc * nproc  # fp32 params: m, v
    mesh = distributed.data_parallel_mesh()
    sharding = distributed.param_shardings({"w": np.empty(n, np.float32)}, mesh)["w"]

    def vector(scale: float, offset: int) -> jax.Array:  # deterministic, made per shard only
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            i = np.arange(*index[0].indices(n), dtype=np.float64)
            return (np.sin(i * 0.618 + offset) * scale).astype(np.float32)

        return jax.make_array_from_callback((n,), sharding, shard)

    params, grads = {"w": vector(1.0, 0)}, {"w": vector(1e-3, 1)}
    tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=_offload_config(cfg, variant))
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    names = [f"tier{k}" for k in range(len(engine.tiers))]
    update = jax.jit(tx.update)
    steps = []
    if nproc > 1:
        multihost_utils.sync_global_devices("dist_update_start")
    for step in range(cfg["warmup"] + cfg["steps"]):
        measured = step >= cfg["warmup"]
        if step == cfg["warmup"]:
            for store in engine.tiers:
                store.trace = []
        waits = [dict(store.permits.wait_s) for store in engine.tiers]
        t0 = time.perf_counter()
        updates, state = update(grads, state, params)
        jax.block_until_ready(updates)
        dt = time.perf_counter() - t0
        del updates
        timings = {"update_s": dt}
        for name, store, before in zip(names, engine.tiers, waits, strict=True):
            for d in ("read", "write"):
                timings[f"permit_wait_s/{name}/{d}"] = store.permits.wait_s[d] - before[d]
        # a collective: the processes leave it together, so the next update starts together
        job = metrics.aggregate(engine.metrics[-1], timings, time_key="update_s")
        if pid == 0:
            logger.info("%s step %d: %.3f s (slowest: process %d)", variant, step,
                        job.step_time_s, job.slowest)  # fmt: skip
        if measured:
            steps.append(
                {
                    "step_s": job.step_time_s,
                    "slowest": job.slowest,
                    "per_process": {k: v for k, v in job.per_process.items() if k.startswith(KEPT)},
                }
            )
    traces = [
        [[pid, name, *event] for event in store.trace]
        for name, store in zip(names, engine.tiers, strict=True)
    ]
    jax_mlpo.close(state)
    Path(cfg["out"], f"trace{pid}.json").write_text(json.dumps(traces))
    if nproc > 1:
        multihost_utils.sync_global_devices("dist_update_done")
    if pid == 0:
        merged = []
        for k in range(nproc):
            for events in json.loads(Path(cfg["out"], f"trace{k}.json").read_text()):
                merged.extend(events)
        merged.sort(key=lambda e: e[4])  # by start time
        result = {"steps": steps, "trace": merged, "tiers": names}
        Path(cfg["out"], "result.json").write_text(json.dumps(result))


# -- the launcher ------------------------------------------------------------------------------


def launch(cfg: dict[str, Any], variant: str, repeat: int) -> dict[str, Any]:
    """Runs one variant in fresh processes and tier directories; returns process 0's result."""
    run = dict(cfg)
    run["run_dir"] = os.path.join(cfg["dir"], f"{variant}-{repeat}")
    run["permits_dir"] = os.path.join(cfg["permits_root"], f"{variant}-{repeat}")
    run["out"] = os.path.join(run["run_dir"], "out")
    for d in (run["run_dir"], run["permits_dir"]):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(run["out"])
    os.makedirs(run["permits_dir"])
    dropped = drop_page_cache() if cfg["device"] == "disk" else None
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    argv = [sys.executable, "-m", MODULE, "--worker", json.dumps(run)]
    argvs = [[*argv, str(k), variant, str(port)] for k in range(cfg["processes"])]
    done = run_local(argvs, env, Path(run["out"]), cfg["timeout"])
    if not done.ok:
        for k, text in enumerate(done.logs):
            logger.error("process %d:\n%s", k, text[-4000:])
        raise SystemExit(f"{variant} run {repeat} failed: exit codes {done.codes}")
    result = json.loads(Path(run["out"], "result.json").read_text())
    result.update(
        variant=variant,
        repeat=repeat,
        wall_s=done.elapsed_s,
        page_cache_dropped=dropped,
        median_step_s=statistics.median(s["step_s"] for s in result["steps"]),
    )
    result["occupancy"] = occupancy(result["trace"], result["tiers"])
    if cfg["device"] != "disk":
        result["io_bound_s"] = statistics.median(io_bound(s, cfg) for s in result["steps"])
    shutil.rmtree(run["run_dir"], ignore_errors=True)
    shutil.rmtree(run["permits_dir"], ignore_errors=True)
    return result


def io_bound(step: dict[str, Any], cfg: dict[str, Any]) -> float:
    """The step's I/O lower bound under the caps: max over tiers of the bytes it moved (all
    processes) / the node's cap (shared-cap), or of one process's bytes / its cap (process-cap)."""
    from jax_mlpo.config import parse_size

    caps = [parse_size(c, "--caps") for c in cfg["caps"].split(",")]
    bound = 0.0
    for k, cap in enumerate(caps):
        moved = [0.0] * cfg["processes"]
        for key, values in step["per_process"].items():
            if key.startswith("bytes_") and key.endswith(f"/tier{k}"):
                moved = [m + v for m, v in zip(moved, values, strict=True)]
        per = sum(moved) if cfg["device"] == "shared-cap" else max(moved)
        bound = max(bound, per / cap)
    return bound


def occupancy(trace: list[list], tiers: list[str]) -> dict[str, dict[str, float]]:
    """Per tier and direction: seconds with a request in flight, and the share of that time
    with requests of two or more processes in flight at once (a sweep over the merged trace)."""
    out = {}
    for tier in tiers:
        for direction in ("read", "write"):
            edges = []
            for pid, name, kind, _slot, t0, t1 in trace:
                if name == tier and kind == direction:
                    edges += [(t0, 1, pid), (t1, -1, pid)]
            edges.sort()
            active: dict[int, int] = {}
            busy = shared = 0.0
            last = None
            for t, delta, pid in edges:
                if last is not None:
                    procs = sum(1 for c in active.values() if c > 0)
                    busy += (t - last) if procs else 0.0
                    shared += (t - last) if procs > 1 else 0.0
                active[pid] = active.get(pid, 0) + delta
                last = t
            out[f"{tier}/{direction}"] = {
                "busy_s": busy,
                "multi_process_share": shared / busy if busy else 0.0,
            }
    return out


def plot(results: list[dict[str, Any]], path: str) -> None:
    """One measured step of the last repeat of each variant: every request of every process on
    every tier, reads above writes, one row per (tier, process)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = {r["variant"]: r for r in results}
    fig, axes = plt.subplots(len(last), 1, figsize=(11, 2.2 + 1.6 * len(last)), squeeze=False)
    for ax, (variant, r) in zip(axes[:, 0], last.items(), strict=True):
        nproc = 1 + max(e[0] for e in r["trace"])
        # the window of the last measured step: its slowest process's time back from the end
        end = max(e[5] for e in r["trace"])
        start = end - r["steps"][-1]["step_s"]
        rows = [(t, p) for t in r["tiers"] for p in range(nproc)]
        for pid, name, kind, _slot, t0, t1 in r["trace"]:
            if t1 < start:
                continue
            y = rows.index((name, pid))
            off = 0.05 if kind == "read" else -0.4
            color = f"C{pid}"
            ax.broken_barh([(t0 - start, t1 - t0)], (y + off, 0.35), facecolors=color,
                           alpha=1.0 if kind == "read" else 0.45, edgecolor="none")  # fmt: skip
        ax.set_yticks(range(len(rows)), [f"{t} p{p}" for t, p in rows])
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_xlim(0, end - start)
        occ = r["occupancy"]
        shares = ", ".join(f"{k} {100 * v['multi_process_share']:.0f}%" for k, v in occ.items())
        ax.set_title(f"{variant}-level permits: step {r['steps'][-1]['step_s']:.2f} s; time "
                     f"with 2+ processes in flight: {shares}", fontsize=9)  # fmt: skip
    axes[-1, 0].set_xlabel("seconds into the last measured step (dark: reads, light: writes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        cfg = json.loads(sys.argv[2])
        worker(cfg, int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--state", default="512MiB", help="optimizer state of all processes")
    parser.add_argument("--cache", default="64MiB", help="host cache per process")
    parser.add_argument("--caps", default="300MB,150MB",
                        help="bandwidth per tier (B/s); shared-cap: the node's")  # fmt: skip
    parser.add_argument("--device", choices=DEVICES, default="shared-cap")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="FileTier.max_concurrency (per process)")  # fmt: skip
    parser.add_argument("--node-concurrency", type=int, default=1,
                        help="FileTier.node_max_concurrency of the 'node' variant")  # fmt: skip
    parser.add_argument("--subgroup", type=int, default=1 << 20, help="elements per subgroup")
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None,
                        help="where the tiers go (default: /dev/shm/jax_mlpo-dist-bench-tiers "
                        "for the caps, so that the cap is the only device; "
                        "/tmp/jax_mlpo-dist-bench for --device disk)")  # fmt: skip
    parser.add_argument("--permits-dir", default="/dev/shm/jax_mlpo-dist-bench",
                        help="node-local directory of the permits and shared buckets")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="timeline PNG of the last repeat")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.dir is None:
        disk = args.device == "disk"
        args.dir = "/tmp/jax_mlpo-dist-bench" if disk else "/dev/shm/jax_mlpo-dist-bench-tiers"
    cfg = {
        "processes": args.processes,
        "state": args.state,
        "cache": args.cache,
        "caps": args.caps,
        "device": args.device,
        "concurrency": args.concurrency,
        "node_concurrency": args.node_concurrency,
        "subgroup": args.subgroup,
        "prefetch_depth": args.prefetch_depth,
        "steps": args.steps,
        "warmup": args.warmup,
        "dir": args.dir,
        "permits_root": args.permits_dir,
        "timeout": args.timeout,
    }

    def run(variant: str, repeat: int) -> dict[str, Any]:
        r = launch(cfg, variant, repeat)
        logger.info("%s repeat %d: median step %.3f s (run %.1f s)", variant, repeat,
                    r["median_step_s"], r["wall_s"])  # fmt: skip
        return r

    by_variant = interleave(VARIANTS, args.repeats, run)  # process node process node ...
    results = [by_variant[v][k] for k in range(args.repeats) for v in VARIANTS]  # run order
    shutil.rmtree(args.dir, ignore_errors=True)
    summary: dict[str, Any] = {}
    steps = {v: [s for r in results if r["variant"] == v for s in r["steps"]] for v in VARIANTS}
    for variant in VARIANTS:
        runs = [r["median_step_s"] for r in results if r["variant"] == variant]
        occ = [r["occupancy"] for r in results if r["variant"] == variant]
        summary[variant] = {
            "step_s": statistics.median(runs),
            "io_bound_s": statistics.median(
                r.get("io_bound_s", float("nan")) for r in results if r["variant"] == variant
            ),
            "step_s_runs": runs,
            "multi_process_share": {
                k: statistics.median(o[k]["multi_process_share"] for o in occ) for k in occ[0]
            },
            "permit_wait_s_per_step": {  # median over steps and runs of the processes' mean
                k: statistics.median(
                    statistics.mean(step["per_process"][k]) for step in steps[variant]
                )
                for k in steps[variant][0]["per_process"]
                if k.startswith("permit_wait_s")
            },
        }
    ratio = summary["node"]["step_s"] / summary["process"]["step_s"]
    tiers = f"tiers capped at {args.caps} B/s ({args.device})"
    if args.device == "disk":
        tiers = f"tiers on the disk of {args.dir}, O_DIRECT, no cap (placement {args.caps})"
    print(f"{args.processes} processes, state {args.state} in all, host cache {args.cache} "
          f"per process, {tiers}, max_concurrency "
          f"{args.concurrency} per process, node_max_concurrency {args.node_concurrency}; "
          f"median of {args.repeats} runs x median of {args.steps} steps")  # fmt: skip
    width = max(6 * args.repeats + 2, 10)
    print(f"{'permits':<10}{'step s':>9}  {'runs (s)':<{width}}time with 2+ processes in a tier")
    for variant in VARIANTS:
        s = summary[variant]
        runs = " ".join(f"{x:.2f}" for x in s["step_s_runs"])
        shares = " ".join(f"{k} {100 * v:.0f}%" for k, v in s["multi_process_share"].items())
        print(f"{variant:<10}{s['step_s']:>9.3f}  {runs:<{width}}{shares}")
    if args.device != "disk":
        print(f"I/O lower bound under the caps: {summary['process']['io_bound_s']:.3f} s/step")
    print(f"ratio node/process = {ratio:.3f}")
    if args.json:
        for r in results[: -len(VARIANTS)]:
            r.pop("trace")  # keep the last repeat's traces only
        result = {"args": vars(args), "summary": summary, "ratio_node_over_process": ratio,
                  "runs": results}  # fmt: skip
        write_json(args.json, result, indent=None)  # one line: the traces are long
    if args.plot:
        plot(results[-len(VARIANTS) :], args.plot)


if __name__ == "__main__":
    main()
