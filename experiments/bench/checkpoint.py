"""Checkpoints of offloaded state 8x+ the host cache: streamed save and restore.

Each round runs in a fresh process: bf16 params (leaves of 16Mi elements) under
``jax_mlpo.adamw`` with all state on one disk tier and a small host cache. It measures, on the
same disk:

* ``fio``: 50/50 random read/write, O_DIRECT, 8 MiB requests, 16 in flight, on one laid-out
  file, and ``fio_limit``: the same at 32 MiB x 32 (the best point of the disk's sweep,
  ``experiments.bench.disk_limit``). The better of the two is the disk's mixed limit (a save
  reads the tier and writes the checkpoint at once, a restore the reverse); ``fio_copy``: a
  sequential read of a file and a sequential write of a new, preallocated one at once, 8 in
  flight each (a checkpoint's own pattern: new files are written, and ext4 serialises direct
  writes into newly allocated space within a file);
* three **synchronous saves** (``blocking=True``), after updates 2, 3 and 4, with one
  checkpoint kept (``max_to_keep=1``): the first two write new files, the third rewrites the
  files of the checkpoint deleted before it (:mod:`jax_mlpo.checkpoint.recycle`), as every
  save of a training run does from its third on. The third is "the" blocking save; the
  second is reported beside it. For each: time, the bytes moved (state read from the tier
  + checkpoint written, ``/proc/self/io``) per second, and the peak RSS growth over the steady
  state (``VmHWM`` reset through ``/proc/self/clear_refs`` first);
* an **asynchronous save** (rewriting files too) after update 5 while updates 6 and 7 run:
  the time ``save`` holds the loop (the stall), and the peak RSS growth over the steady
  state's (an update's own peak included) until the checkpoint is durable (the params are
  written before ``save`` returns, without a copy, and the state is streamed from the tiers
  once it has returned);
* a **restore** of the asynchronous checkpoint into a fresh ``tx.init`` (page cache dropped
  first): time, bytes moved per second and peak RSS growth over the steady state of a process
  holding its initial params (the restore's target is their ``ShapeDtypeStruct`` s and the
  initial params are dropped, so the restored ones take their place); then updates 6 and 7
  again, whose params must equal the uninterrupted run's bit for bit.

Before each save the last update's write-behind is drained (it is the update's I/O). The page
cache is dropped before the update that precedes each save (before the first save, just before
it), not between them: a drop also evicts the process's own code (shared libraries, bytecode),
and the first thread started after one waited 14-49 ms for its pages, a cost no training loop
pays between its update and its save. Tiers and checkpoint files are read and written with
O_DIRECT, so the drop's effect on the data is the same.

Targets: RSS growth <= 512 MiB in each, throughput >= 80% of the disk's mixed limit (the
better fio mixed figure), the stall <= 10% of the synchronous save's time. Medians over rounds,
the spread beside them.

    python -m experiments.bench.checkpoint --params-mi 344 --cache 256MiB --rounds 3 \
        --dir /var/tmp/jax_mlpo_ckpt --json experiments/results/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import time

from experiments.bench import sysio
from experiments.bench.checkpoint_job import LEAF, SUBGROUP, run_child
from experiments.bench.harness import spread, write_json
from experiments.job.host_memory import process_memory

logger = logging.getLogger("bench.checkpoint")


def reset_peak() -> None:
    """Resets the process's ``VmHWM`` to its current RSS (Linux ``clear_refs``, value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(params_mi: int, cache: str, root: str, io_submit: str = "aio") -> dict:
    """One round, in this process; returns its figures."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jax_mlpo
    from jax_mlpo import checkpoint

    tier, ckpt = os.path.join(root, "tier"), os.path.join(root, "ckpt")
    n = params_mi * 2**20
    sizes = [LEAF] * (n // LEAF) + ([n % LEAF] if n % LEAF else [])
    make = jax.jit(lambda k, size: jax.random.normal(k, (size,), jnp.bfloat16), static_argnums=1)
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes))
    params = {f"w{i:03d}": make(k, s) for i, (k, s) in enumerate(zip(keys, sizes, strict=True))}

    def new_tx() -> optax.GradientTransformation:
        config = jax_mlpo.OffloadConfig(
            host_cache=cache,
            tiers=[jax_mlpo.FileTier(tier, io_submit=io_submit)],
            subgroup_size=SUBGROUP,
        )
        return jax_mlpo.adamw(1e-3, weight_decay=0.01, offload=config)

    def make_step(tx):
        def step(p, s, k):
            grads = jax.tree.map(lambda x: jnp.sin(x * k).astype(x.dtype), p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        return jax.jit(step, donate_argnums=(0,))

    def steady_peak(run) -> int:
        reset_peak()
        run()
        return process_memory()["peak_rss_bytes"]

    tx = new_tx()
    opt_state = tx.init(params)
    step = make_step(tx)
    state_bytes = jax_mlpo.engine_of(opt_state).layout.state_bytes
    for k in (1, 2):
        params, opt_state = step(params, opt_state, float(k))
    jax.block_until_ready(params)
    out: dict = {"params": n, "state_bytes": state_bytes}
    out["fio"] = sysio.fio_mixed(root, size="4GiB", runtime_s=10)
    out["fio_limit"] = sysio.fio_mixed(root, size="4GiB", block="32M", depth=32, runtime_s=10)
    out["fio_copy"] = sysio.fio_copy(root, size="4GiB", runtime_s=10)

    holder = {}

    def one_update(k: float) -> None:
        holder["p"], holder["s"] = step(holder["p"], holder["s"], k)
        jax.block_until_ready(holder["p"])

    holder["p"], holder["s"] = params, opt_state
    update_peak = steady_peak(lambda: one_update(2.5))  # an update's own peak, for the baseline
    params, opt_state = holder["p"], holder["s"]
    steady = process_memory()["rss_bytes"]
    # one checkpoint kept: from the third save on, each rewrites the files of the one deleted
    # before it (jax_mlpo.checkpoint.recycle), as a training run's saves do
    mngr = checkpoint.manager(ckpt, max_to_keep=1)

    def io_bytes() -> int:
        io = sysio.proc_io()
        return io["read"] + io["write"]

    # three synchronous saves, each after an update: the process's first, a second (both into
    # new files) and the first into a deleted checkpoint's files
    for key, ckpt_step in (("sync_first", 3), ("sync_new_files", 4), ("sync", 5)):
        sysio.drop_page_cache()  # before the update: see the module docstring
        if ckpt_step > 3:
            params, opt_state = step(params, opt_state, ckpt_step - 1.0)
            jax.block_until_ready(params)
        jax_mlpo.engine_of(opt_state).drain()  # the update's own write-behind is not the save's
        reset_peak()
        start = process_memory()["rss_bytes"]
        moved, t0 = io_bytes(), time.perf_counter()
        checkpoint.save(mngr, ckpt_step, params, opt_state, blocking=True)
        seconds = time.perf_counter() - t0
        peak = process_memory()["peak_rss_bytes"]
        out[key] = {
            "seconds": seconds, "moved_bytes": io_bytes() - moved,
            "rss_growth_bytes": peak - steady, "rss_growth_over_start_bytes": peak - start,
        }  # fmt: skip

    # the asynchronous save, updates running meanwhile
    sysio.drop_page_cache()
    params, opt_state = step(params, opt_state, 3.5)
    jax.block_until_ready(params)
    jax_mlpo.engine_of(opt_state).drain()
    reset_peak()
    t0 = time.perf_counter()
    checkpoint.save(mngr, 6, params, opt_state, blocking=False)
    stall_s = time.perf_counter() - t0
    update_s = []
    for k in (4.0, 5.0):
        t1 = time.perf_counter()
        params, opt_state = step(params, opt_state, k)
        jax.block_until_ready(params)
        update_s.append(time.perf_counter() - t1)
    mngr.wait_until_finished()
    async_s = time.perf_counter() - t0
    final = {k: np.asarray(v).view(np.uint16).copy() for k, v in params.items()}
    out["async"] = {
        "stall_seconds": stall_s, "seconds_until_durable": async_s, "update_seconds": update_s,
        "rss_growth_bytes": process_memory()["peak_rss_bytes"] - max(steady, update_peak),
    }  # fmt: skip
    # a normal update's time beside it, for the slowdown the save's I/O causes
    t1 = time.perf_counter()
    params, opt_state = step(params, opt_state, 6.0)
    jax.block_until_ready(params)
    out["async"]["plain_update_seconds"] = time.perf_counter() - t1
    tier_bytes = sum(
        os.path.getsize(os.path.join(tier, f)) for f in os.listdir(tier) if f.endswith(".blob")
    )
    out["tier_bytes_after"] = tier_bytes
    jax_mlpo.close(opt_state)

    # the restore, into a fresh optimizer
    fresh = jax.tree.map(jnp.zeros_like, params)
    del params
    tx = new_tx()
    opt_state = tx.init(fresh)
    step = make_step(tx)
    sysio.drop_page_cache()
    steady = process_memory()["rss_bytes"]  # the training process's: params and engine
    # the restored params take the place of the initial ones: the target gives their shapes
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fresh)
    del fresh
    reset_peak()
    moved, t0 = io_bytes(), time.perf_counter()
    restored = checkpoint.restore(mngr, target, opt_state, step=6)
    restore_s = time.perf_counter() - t0
    out["restore"] = {
        "seconds": restore_s, "moved_bytes": io_bytes() - moved,
        "rss_growth_bytes": process_memory()["peak_rss_bytes"] - steady,
    }  # fmt: skip
    params, opt_state = restored.params, restored.opt_state
    for k in (4.0, 5.0):
        params, opt_state = step(params, opt_state, k)
    got = {k: np.asarray(v).view(np.uint16) for k, v in params.items()}
    out["resume_bitwise_equal"] = all(np.array_equal(got[k], final[k]) for k in final)
    jax_mlpo.close(opt_state)
    mngr.close()
    return out


def summarize(rounds: list[dict]) -> dict:
    """Medians and spreads of the rounds' ratios, against the targets in the module's docstring."""
    mib = 2**20

    def ratio(r: dict, phase: str, fio: str = "fio") -> float:
        return r[phase]["moved_bytes"] / r[phase]["seconds"] / 1e9 / r[fio]["mixed_gbps"]

    def vs_limit(r: dict, phase: str) -> float:  # against the better mixed figure
        return min(ratio(r, phase, "fio"), ratio(r, phase, "fio_limit"))

    s = {
        "sync_save_vs_mixed_limit": spread(vs_limit(r, "sync") for r in rounds),
        "restore_vs_mixed_limit": spread(vs_limit(r, "restore") for r in rounds),
        "sync_save_vs_fio_mixed": spread(ratio(r, "sync") for r in rounds),
        "first_sync_save_vs_fio_mixed": spread(ratio(r, "sync_first") for r in rounds),
        "sync_save_new_files_vs_mixed_limit": spread(vs_limit(r, "sync_new_files") for r in rounds),
        "restore_vs_fio_mixed": spread(ratio(r, "restore") for r in rounds),
        "sync_save_vs_fio_copy": spread(ratio(r, "sync", "fio_copy") for r in rounds),
        "restore_vs_fio_copy": spread(ratio(r, "restore", "fio_copy") for r in rounds),
        "sync_save_rss_growth_over_start_mib": spread(
            r["sync"]["rss_growth_over_start_bytes"] / 2**20 for r in rounds
        ),
        "sync_save_state_gbps": spread(
            r["state_bytes"] / r["sync"]["seconds"] / 1e9 for r in rounds
        ),
        "restore_state_gbps": spread(
            r["state_bytes"] / r["restore"]["seconds"] / 1e9 for r in rounds
        ),
        "stall_vs_sync_save": spread(
            r["async"]["stall_seconds"] / r["sync"]["seconds"] for r in rounds
        ),
        "update_slowdown_during_async_save": spread(
            statistics.mean(r["async"]["update_seconds"]) / r["async"]["plain_update_seconds"]
            for r in rounds
        ),
        "rss_growth_mib": {
            phase: spread(r[phase]["rss_growth_bytes"] / mib for r in rounds)
            for phase in ("sync_first", "sync", "async", "restore")
        },
        "fio_mixed_gbps": spread(r["fio"]["mixed_gbps"] for r in rounds),
        "fio_mixed_32m_x32_gbps": spread(r["fio_limit"]["mixed_gbps"] for r in rounds),
        "fio_copy_gbps": spread(r["fio_copy"]["mixed_gbps"] for r in rounds),
        "resume_bitwise_equal": all(r["resume_bitwise_equal"] for r in rounds),
    }
    growth = max(s["rss_growth_mib"][p]["median"] for p in s["rss_growth_mib"])
    s["targets_met"] = {
        "rss_growth_le_512MiB": growth <= 512,
        "save_ge_0.8_fio": s["sync_save_vs_mixed_limit"]["median"] >= 0.8,
        "restore_ge_0.8_fio": s["restore_vs_mixed_limit"]["median"] >= 0.8,
        "stall_le_0.1_sync": s["stall_vs_sync_save"]["median"] <= 0.1,
    }
    return s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-mi", type=int, default=384, help="bf16 params, in Mi (12 B each)")
    ap.add_argument("--cache", default="256MiB", help="host_cache")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp/jax_mlpo_ckpt_bench", help="tier + checkpoints")
    ap.add_argument("--io-submit", default="aio", choices=("aio", "threads"),
                    help="the tier's FileTier.io_submit")  # fmt: skip
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = child(args.params_mi, args.cache, args.dir, args.io_submit)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    if shutil.which("fio") is None:  # every figure is a fraction of what fio moves
        raise SystemExit("the checkpoint benchmark measures the disk with fio: install it first")
    rounds = []
    for r in range(args.rounds):
        # 4x the state on disk: deleted after each round, whatever happens
        x = run_child("experiments.bench.checkpoint", [
            "--child", f"--params-mi={args.params_mi}", f"--cache={args.cache}",
            f"--dir={args.dir}", f"--io-submit={args.io_submit}",
        ], args.dir)  # fmt: skip
        rounds.append(x)
        logger.info(
            "round %d: fio mixed %.2f (32 MiB x 32: %.2f) GB/s; sync save %.1f s (%.2f GB/s "
            "moved), stall %.2f s, restore %.1f s (%.2f GB/s moved); RSS growth sync %.0f / "
            "async %.0f / restore %.0f MiB; bitwise resume %s; fio copy pattern %.2f GB/s",
            r, x["fio"]["mixed_gbps"], x["fio_limit"]["mixed_gbps"], x["sync"]["seconds"],
            x["sync"]["moved_bytes"] / x["sync"]["seconds"] / 1e9, x["async"]["stall_seconds"],
            x["restore"]["seconds"], x["restore"]["moved_bytes"] / x["restore"]["seconds"] / 1e9,
            x["sync"]["rss_growth_bytes"] / 2**20, x["async"]["rss_growth_bytes"] / 2**20,
            x["restore"]["rss_growth_bytes"] / 2**20, x["resume_bitwise_equal"],
            x["fio_copy"]["mixed_gbps"],
        )  # fmt: skip
    result = {"args": vars(args), "rounds": rounds, "summary": summarize(rounds)}
    logger.info("summary: %s", json.dumps(result["summary"], indent=1))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
