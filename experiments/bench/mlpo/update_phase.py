"""The update phase with optimizer state several times the host cache: baseline vs MLP-Offload.

Two file tiers capped well below the disk's raw speed (token buckets: an honest, reproducible
emulation of a fast and a slow path). Rows: in-memory optax (no offload), the baseline (every
principle off: one path, ascending order, nothing retained, fp32 gradients written to the tier
and read back), each principle alone on top of the baseline, read-ahead across steps on top of
delayed conversion (it needs the gradients in host memory), and all principles with and without
read-ahead. All offloaded rows get the same host memory budget. Between two updates the host
sleeps ``--gap-s`` (the forward and backward pass, as on a GPU node where the host is idle then):
the write-backs an update leaves behind land then, and the next update's reads issued ahead.
Each row runs warm-up steps, then ``--steps`` measured steps; the table gives medians of the
update's time (with ``--gap-s 0``: until its last write-back landed).

The I/O lower bound of a row is max over tiers of (bytes the tier moved during the update, not
between updates / its cap); ``bound_efficiency`` = lower bound / update time.

Usage:
  python -m experiments.bench.mlpo.update_phase --state 1GiB --cache 256MiB --caps 600MB,300MB \
      --json experiments/results/update_phase.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_mlpo
from experiments.bench.harness import medians, spread, write_json
from jax_mlpo.config import TierLimits, parse_size

logger = logging.getLogger("bench.update_phase")


def rows(tiers, cache: int, subgroup: int, depth: int) -> dict[str, jax_mlpo.OffloadConfig | None]:
    all_on = jax_mlpo.OffloadConfig(
        host_cache=cache, tiers=tiers, subgroup_size=subgroup, prefetch_depth=depth
    )
    base = all_on.baseline()
    return {
        "optax in memory": None,
        "baseline": base,
        "+ placement by bandwidth": dataclasses.replace(base, placement="measured", replan=True),
        "+ cache-friendly order & retention": dataclasses.replace(
            base, order="alternate", retain=True
        ),
        "+ delayed grad conversion": dataclasses.replace(base, delayed_conversion=True),
        "+ delayed conversion & read-ahead": dataclasses.replace(
            base, delayed_conversion=True, read_ahead=True
        ),
        "all principles": all_on,
        "all principles without read-ahead": dataclasses.replace(all_on, read_ahead=False),
        "all principles (retain slow tiers first)": dataclasses.replace(
            all_on, retain_policy="slow_tiers"
        ),
    }


def run_row(name, config, params, grads, steps: int, warmup: int, gap_s: float) -> dict:
    if config is None:
        tx = optax.adamw(1e-3, weight_decay=0.1)
        update = jax.jit(tx.update, donate_argnums=(1,))
    else:
        tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)
        update = jax.jit(tx.update)
    state = tx.init(params)
    times, metrics, own = [], [], []
    for step in range(warmup + steps):
        time.sleep(gap_s)  # the forward and backward pass
        t0 = time.perf_counter()
        updates, state = update(grads, state, params)
        jax.block_until_ready(updates)
        if config is not None and gap_s == 0:  # its last write-backs (write_behind) count
            jax_mlpo.engine_of(state).drain()
        dt = time.perf_counter() - t0
        del updates
        if step >= warmup:
            times.append(dt)
            if config is not None:
                m = jax_mlpo.engine_of(state).metrics[-1]
                metrics.append(m)  # its I/O until the next update starts, when that closes it
                # the bytes it moved itself: what its figures hold when it returns
                own.append({p: m.bytes_read.get(p, 0) + m.bytes_written.get(p, 0)
                            for p in m.bytes_read})  # fmt: skip
        logger.info("%s: step %d %.2f s", name, step, dt)
    t = spread(times)
    out = {"update_s": t["median"], "update_s_range": [t["min"], t["max"]]}
    if config is not None:
        engine = jax_mlpo.engine_of(state)
        steps = [
            {"cache_hits": m.cache_hits, "reads_ahead": m.reads_ahead,
             "grad_write_s": m.grad_write_s, "read_wait_s": m.read_wait_s,
             "compute_s": m.compute_s, "engine_s": m.total_s}
            for m in metrics
        ]  # fmt: skip
        out.update(medians(steps, steps[0]))
        tiers = {}
        bound = 0.0  # the bytes the update moved itself (not those between updates) at the caps
        for store in engine.tiers:
            path = store.tier.path
            moved = medians(
                [{"r": m.bytes_read[path], "w": m.bytes_written[path], "busy": m.tier_busy_s[path]}
                 for m in metrics],
                ("r", "w", "busy"),
            )  # fmt: skip
            moved_r, moved_w, busy = moved["r"], moved["w"], moved["busy"]
            tiers[os.path.basename(path)] = {
                "read_gbps": moved_r / out["update_s"] / 1e9,
                "write_gbps": moved_w / out["update_s"] / 1e9,
                "busy_s": busy,
                "gbps_while_busy": (moved_r + moved_w) / busy / 1e9,
                "subgroups": engine.tier_of.count(engine.tiers.index(store)),
            }
            in_update = statistics.median(o.get(path, 0) for o in own)
            tiers[os.path.basename(path)]["in_update_bytes"] = in_update
            bound = max(bound, in_update / store.tier.limits.bandwidth_cap)
        out["tiers"] = tiers
        out["io_bound_s"] = bound
        out["bound_efficiency"] = bound / out["update_s"]
        jax_mlpo.close(state)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", default="1GiB", help="optimizer state (fp32 m, v: 8 B/param)")
    parser.add_argument("--cache", default="256MiB", help="host memory budget of every row")
    parser.add_argument("--caps", default="600MB,300MB", help="bandwidth cap per tier (B/s)")
    parser.add_argument("--subgroup", type=int, default=1 << 20)
    parser.add_argument("--prefetch-depth", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=4, help="covers a re-plan after 3 steps")
    parser.add_argument(
        "--gap-s", type=float, default=1.0, help="host idle time between updates (fwd+bwd)"
    )
    parser.add_argument("--dir", default="/tmp/jax_mlpo-update-bench")
    parser.add_argument("--only", default=None, help="comma-separated row names to run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    n = parse_size(args.state, "--state") // 8
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(n, np.float32))}
    grads = {"w": jnp.asarray(np.random.default_rng(1).standard_normal(n, np.float32) * 1e-3)}
    caps = [parse_size(c, "--caps") for c in args.caps.split(",")]
    cache = parse_size(args.cache, "--cache")
    results = {}
    for name, config in rows([], cache, args.subgroup, args.prefetch_depth).items():
        if args.only and name not in args.only.split(","):
            continue
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
        tiers = [
            jax_mlpo.FileTier(
                os.path.join(args.dir, f"tier{k}-{cap // 10**6}MBps"),
                limits=TierLimits(bandwidth_cap=cap),
            )
            for k, cap in enumerate(caps)
        ]
        if config is not None:
            config = dataclasses.replace(config, tiers=tuple(tiers))
        results[name] = run_row(name, config, params, grads, args.steps, args.warmup, args.gap_s)
    shutil.rmtree(args.dir, ignore_errors=True)

    base, full = results.get("baseline"), results.get("all principles")
    summary = {}
    if base and full:
        summary["speedup_all_vs_baseline"] = base["update_s"] / full["update_s"]
        summary["bound_efficiency"] = full["bound_efficiency"]
    ahead, behind = (results.get(k) for k in ("+ delayed conversion & read-ahead",
                                              "+ delayed grad conversion"))  # fmt: skip
    if ahead and behind:
        summary["speedup_read_ahead"] = behind["update_s"] / ahead["update_s"]
    print(f"state {args.state} (fp32 params: m, v), host cache {args.cache}, caps {args.caps}, "
          f"subgroup {args.subgroup}, {args.gap_s} s between updates, medians of {args.steps} "
          "steps")  # fmt: skip
    head = f"{'row':<36}{'update s':>9}{'vs base':>8}{'hits':>6}{'ahead':>6}{'bound s':>9}"
    head += f"{'eff':>6}  tiers"
    head += "  (read_wait / compute / grad_write s in the JSON)"
    print(head)
    for name, r in results.items():
        speed = base["update_s"] / r["update_s"] if base else float("nan")
        tiers = "  ".join(
            f"{k}: r {v['read_gbps']:.2f} w {v['write_gbps']:.2f} GB/s ({v['subgroups']} sg)"
            for k, v in r.get("tiers", {}).items()
        )
        hits, bound = r.get("cache_hits", 0), r.get("io_bound_s", 0)
        eff, ahead = r.get("bound_efficiency", 0), r.get("reads_ahead", 0)
        print(f"{name:<36}{r['update_s']:>9.2f}{speed:>8.2f}{hits:>6.0f}{ahead:>6.0f}"
              f"{bound:>9.2f}{eff:>6.2f}  {tiers}")  # fmt: skip
    for k, v in summary.items():
        print(f"{k} = {v:.3f}")
    write_json(args.json, {"args": vars(args), "rows": results, **summary})


if __name__ == "__main__":
    main()
