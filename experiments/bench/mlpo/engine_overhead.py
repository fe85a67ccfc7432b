"""Time an update spends outside the host engine (XLA's FFI copies in and out, the callbacks),
and the process's peak RSS.

One optimizer over two capped disk tiers; each step's wall time (jitted update + drain) minus
the engine's own time; peak RSS (``ru_maxrss``, and ``VmHWM``) after the steps. Run it once
per code version in a fresh process to compare them
(experiments/results/restructure_ab.txt):

    python -m experiments.bench.mlpo.engine_overhead --params-mi 128 --cache 256MiB
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp

import jax_mlpo
from experiments.bench.harness import format_spread, spread
from experiments.host_memory import peak_rss_bytes, process_memory

logger = logging.getLogger("bench.engine_overhead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-mi", type=int, default=128, help="fp32 params, in Mi")
    parser.add_argument("--cache", default="256MiB")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = tempfile.mkdtemp(prefix="jax_mlpo-overhead-")
    try:
        tiers = [
            jax_mlpo.FileTier(os.path.join(root, "a"), bandwidth_cap="300MB"),
            jax_mlpo.FileTier(os.path.join(root, "b"), bandwidth_cap="150MB"),
        ]
        config = jax_mlpo.OffloadConfig(
            host_cache=args.cache, tiers=tiers, subgroup_size=1 << 20, prefetch_depth=2
        )
        n = args.params_mi * 2**20
        params = {"w": jnp.zeros((n,), jnp.float32)}
        grads = {"w": jnp.full((n,), 1e-3, jnp.float32)}
        tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)
        state = tx.init(params)
        update, engine = jax.jit(tx.update), jax_mlpo.engine_of(state)
        wall, outside = [], []
        for step in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            updates, state = update(grads, state, params)
            jax.block_until_ready(updates)
            engine.drain()
            dt = time.perf_counter() - t0
            del updates
            if step >= args.warmup:
                wall.append(dt)
                outside.append(dt - engine.metrics[-1].total_s)
        print(f"wall {format_spread(spread(wall))} s, outside the engine "
              f"{format_spread(spread(outside))} s")  # fmt: skip
        hwm = process_memory()["peak_rss_bytes"]
        print(f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB (ru_maxrss; VmHWM {hwm // 1024} kB)")
        jax_mlpo.close(state)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
