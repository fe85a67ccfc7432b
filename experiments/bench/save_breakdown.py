"""Where a blocking save's stream spends its time (stop 30), optionally A/B against synced metadata.

Builds ``--params-mi`` bf16 params with all state on one disk tier (256 MiB host cache), runs two
updates, then a blocking save (page cache dropped first) with the stream's thread timed by
phase: waiting for the next blob (the tier's reads), waiting for a shard array to be created,
waiting for a piece's write to finish (queue full), and the rest. ``--synced-metadata`` creates
the arrays' ``zarr.json`` with tensorstore's own fsync, as before stop 30. Each run is a fresh
process; ``--rounds`` alternates the two.

    python -m experiments.bench.save_breakdown --params-mi 344 --rounds 3 \
        --json experiments/results/save_breakdown.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import time

logger = logging.getLogger("bench.save_breakdown")


def child(params_mi: int, root: str, synced: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    import tensorstore as ts

    import jax_mlpo
    from experiments.bench import sysio
    from jax_mlpo import checkpoint
    from jax_mlpo import snapshot as snapshots
    from jax_mlpo.checkpoint import shard_file, stream

    waits: dict[str, float] = collections.defaultdict(float)

    def timed(name, f):
        @functools.wraps(f)
        def g(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                waits[name] += time.perf_counter() - t

        return g

    stream.ShardCreator.get = timed("array creation wait", stream.ShardCreator.get)
    stream.StateWriter._settle = timed("write wait", stream.StateWriter._settle)
    stream.write_streams = timed("stream total", stream.write_streams)
    blobs = snapshots.StateSnapshot.blobs

    def timed_blobs(self):
        it = blobs(self)
        while True:
            t = time.perf_counter()
            try:
                x = next(it)
            except StopIteration:
                return
            finally:
                waits["read wait"] += time.perf_counter() - t
            yield x

    snapshots.StateSnapshot.blobs = timed_blobs
    if synced:  # tensorstore's default context: every file it writes is fsynced
        shard_file._UNSYNCED = ts.Context()
    from jax_mlpo.checkpoint import handler

    handler.write_streams = stream.write_streams
    n, leaf = params_mi * 2**20, 16 * 2**20
    make = jax.jit(lambda k: jax.random.normal(k, (leaf,), jnp.bfloat16))
    params = {
        f"w{i:03d}": make(k) for i, k in enumerate(jax.random.split(jax.random.key(0), n // leaf))
    }
    config = jax_mlpo.OffloadConfig(
        host_cache="256MiB", tiers=[jax_mlpo.FileTier(os.path.join(root, "tier"))],
        subgroup_size=4 * 2**20,
    )  # fmt: skip
    tx = jax_mlpo.adamw(1e-3, weight_decay=0.01, offload=config)
    opt_state = tx.init(params)

    def step(p, s, k):
        grads = jax.tree.map(lambda x: jnp.sin(x * k).astype(x.dtype), p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(step, donate_argnums=(0,))
    for k in (1.0, 2.0):
        params, opt_state = step(params, opt_state, k)
    jax.block_until_ready(params)
    mngr = checkpoint.manager(os.path.join(root, "ckpt"))
    jax_mlpo.engine_of(opt_state).drain()
    sysio.drop_page_cache()
    t0 = time.perf_counter()
    checkpoint.save(mngr, 2, params, opt_state, blocking=True)
    out = {"save_s": time.perf_counter() - t0, **waits}
    mngr.close()
    jax_mlpo.close(opt_state)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-mi", type=int, default=344)
    ap.add_argument("--rounds", type=int, default=1, help="A/B rounds (0: the default only)")
    ap.add_argument("--dir", default="/var/tmp/jax_mlpo_save_breakdown")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=("unsynced", "synced"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        out = child(args.params_mi, args.dir, args.child == "synced")
        print("RESULT " + json.dumps(out), flush=True)
        return out
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    runs: list[dict] = []
    kinds = ("unsynced", "synced") if args.rounds else ("unsynced",)
    for r in range(max(1, args.rounds)):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            shutil.rmtree(args.dir, ignore_errors=True)
            os.makedirs(args.dir)
            cmd = [sys.executable, "-m", "experiments.bench.save_breakdown", f"--child={kind}",
                   f"--params-mi={args.params_mi}", f"--dir={args.dir}"]  # fmt: skip
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            finally:
                shutil.rmtree(args.dir, ignore_errors=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{kind} run failed:\n{proc.stderr[-4000:]}")
            runs.append({"round": r, "metadata": kind, **json.loads(lines[-1][len("RESULT ") :])})
            logger.info("round %d, %s metadata: %s", r, kind, ", ".join(
                f"{k} {v:.2f} s" for k, v in runs[-1].items() if isinstance(v, float)))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return {"runs": runs}


if __name__ == "__main__":
    main()
