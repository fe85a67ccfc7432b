"""Retention across the step boundary (every host buffer kept, or only those beyond the
pipeline), and the cost of an fdatasync per blob write (``FileTier.sync``).

With the alternating order the next step starts with the subgroups this one ended with. The
engine keeps one per host buffer (dirty, not written back); before, it kept only the buffers
beyond the pipeline's ``prefetch_depth x tiers + 2`` and wrote the pipeline's back (they stayed
in their buffers, clean, and were rewritten by the next step). Both run here in one process on
the same disk, steps interleaved A B B A A B ... (the disk is shared and its speed drifts), with
the page cache dropped before every step (root; otherwise a warning), each step timed as
DeepSpeed's is in ``deepspeed_peer.py``: the jitted ``tx.update`` plus ``Engine.drain()``.
"(no sync)" is the default engine without its fdatasync per blob write (``FileTier(sync=False)``;
the other two with ``sync=True``, the default before issue 20): each fdatasync on ext4 flushes the
disk's write cache and so waits for every write in flight, which makes a burst of write-backs
complete all at once (seen in the tiers' request traces); whether that costs step time is what
this measures.

"pipeline written back" sets the engine's retention count to the old value after ``init``: a
benchmark-only switch (the count is not an option).

    python -m experiments.bench.mlpo.retain_all --state 1GiB --subgroup 8388608 --cache 384MiB \\
        --rounds 7 --json experiments/results/retain_all.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_mlpo
from experiments.bench.harness import format_spread, interleave, medians, ratio_spread, write_json
from experiments.bench.sysio import drop_page_cache
from jax_mlpo.config import parse_size

log = logging.getLogger("bench.retain_all")

# name: (keep the pipeline's buffers too, fdatasync every blob)
SYSTEMS = {
    "every buffer kept": (True, True),
    "pipeline written back": (False, True),
    "every buffer kept (no sync)": (True, False),
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state", default="1GiB", help="m, v bytes (8 B/param), as update_phase")
    parser.add_argument("--subgroup", type=int, default=8 << 20, help="elements per subgroup")
    parser.add_argument("--cache", default="384MiB", help="host_cache")
    parser.add_argument("--dir", default="/tmp/jax_mlpo-retain-all", help="tier directories")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per system a round")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated, in this order (their tier directories and engines are made in "
        "this order; the first is the base of the ratios)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    n = parse_size(args.state, "--state") // 8
    rng = np.random.default_rng(0)
    # bf16 params: the tiers hold fp32 p, m, v (12 B/param), as DeepSpeed's do
    params = {"w": jnp.asarray(rng.standard_normal(n, np.float32), jnp.bfloat16)}
    grads = {"w": jnp.asarray(rng.standard_normal(n, np.float32) * 1e-3, jnp.bfloat16)}
    runs = {}
    names = args.systems.split(",")
    for k, name in enumerate(names):
        keep_all, sync = SYSTEMS[name]
        directory = os.path.join(args.dir, str(k))
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        config = jax_mlpo.OffloadConfig(
            host_cache=parse_size(args.cache, "--cache"),
            tiers=(jax_mlpo.FileTier(directory, io_mode="direct", sync=sync),),
            subgroup_size=args.subgroup,
            prefetch_depth=1,
        )
        tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)
        state = tx.init(params)
        engine = jax_mlpo.engine_of(state)
        if not keep_all:
            # the retention this stop replaced: only the buffers beyond the pipeline keep their
            # subgroup (one tier, so the split's retained count is the engine's retain set)
            kept = engine.plan.buffers - engine.plan.minimum
            engine.split = dataclasses.replace(engine.split, retained=(kept,))
        runs[name] = {"update": jax.jit(tx.update), "state": state, "engine": engine}

    def run(name: str, rnd: int) -> list[dict]:
        """``args.steps`` steps of one system; round 0 is the warm-up (compilation, first
        reads)."""
        r = runs[name]
        steps = []
        for _ in range(args.steps):
            drop_page_cache(level=1)
            t0 = time.perf_counter()
            updates, r["state"] = r["update"](grads, r["state"], params)
            jax.block_until_ready(updates)
            r["engine"].drain()
            elapsed = time.perf_counter() - t0
            del updates
            m = r["engine"].metrics[-1]
            steps.append(
                {
                    "update_s": elapsed,
                    "host_s": m.total_s,
                    "read_GB": sum(m.bytes_read.values()) / 1e9,
                    "write_GB": sum(m.bytes_written.values()) / 1e9,
                    "cache_hits": m.cache_hits,
                }
            )
        if rnd:
            log.info("round %d %s: %.3f s", rnd, name, steps[-1]["update_s"])
        return steps

    try:
        # the order rotates every round: each system runs first, second, ... equally often
        rounds = interleave(names, args.rounds + 1, run, rotate=True)
    finally:
        for r in runs.values():
            jax_mlpo.close(r["state"])
        shutil.rmtree(args.dir, ignore_errors=True)
    steps = {name: [s for rnd in rounds[name][1:] for s in rnd] for name in names}
    out = {"args": vars(args), "systems": {}}
    for name in names:
        row = medians(steps[name], steps[name][0]) | {"steps": steps[name]}
        out["systems"][name] = row
        log.info(
            "%-24s update %.3f s (host %.3f s), read %.2f GB, written %.2f GB, %d cache hits",
            name, row["update_s"], row["host_s"], row["read_GB"], row["write_GB"],
            row["cache_hits"],
        )  # fmt: skip
    out["speedup"] = {}
    base = [s["update_s"] for s in steps[names[0]]]
    for name in names[1:]:
        r = ratio_spread([s["update_s"] for s in steps[name]], base)  # per step pair
        out["speedup"][name] = r
        log.info("%s / %s (update time, per step pair): %s", name, names[0], format_spread(r))
    write_json(args.json, out, indent=1)
    return out


if __name__ == "__main__":
    main()
