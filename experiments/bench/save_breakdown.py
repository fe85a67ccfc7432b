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
import json
import logging
import os
import time

from experiments.bench.checkpoint_job import offloaded_job, run_child
from experiments.bench.checkpoint_job import timed as timed_into

logger = logging.getLogger("bench.save_breakdown")


def child(params_mi: int, root: str, synced: bool) -> dict:
    import tensorstore as ts

    import jax_mlpo
    from experiments.bench import sysio
    from jax_mlpo import checkpoint
    from jax_mlpo import snapshot as snapshots
    from jax_mlpo.checkpoint import shard_file, stream

    waits: dict[str, float] = collections.defaultdict(float)

    def timed(name, f):
        return timed_into(waits, name, f)

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
    params, opt_state, step = offloaded_job(params_mi, root)
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
            out = run_child("experiments.bench.save_breakdown", [
                f"--child={kind}", f"--params-mi={args.params_mi}", f"--dir={args.dir}",
            ], args.dir)  # fmt: skip
            runs.append({"round": r, "metadata": kind, **out})
            logger.info("round %d, %s metadata: %s", r, kind, ", ".join(
                f"{k} {v:.2f} s" for k, v in runs[-1].items() if isinstance(v, float)))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return {"runs": runs}


if __name__ == "__main__":
    main()
