"""Checkpoint digests, CRC-32C against sha256, side by side (stop 30).

Runs, in fresh processes and alternating, a blocking save, its restore and an asynchronous
save's stall of ``--params-mi`` bf16 params with all state on one disk tier (256 MiB host
cache), once with the checkpoint's own digests (CRC-32C, format 5) and once with every digest
made a sha256 as formats 3 and 4 wrote it (the writers patched; restore checks either kind).
Prints each run's wall and CPU seconds (the process's, all threads) and the medians per digest.

    python -m experiments.bench.digest_ab --params-mi 344 --rounds 2 --dir /var/tmp/jax_mlpo_ab
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import resource
import statistics
import time

from experiments.bench.checkpoint_job import offloaded_job, run_child

logger = logging.getLogger("bench.digest_ab")
PHASES = ("save", "stall", "restore")


def cpu_seconds() -> float:
    """This process's CPU time so far, user + system, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _use_sha256() -> None:
    """Every digest the checkpoint writes becomes a sha256, as formats 3 and 4 wrote them."""
    from jax_mlpo.checkpoint import digest, host_arrays

    digest.of = functools.partial(digest.of, kind=digest.Sha256Digest)
    host_arrays.Digest = digest.Sha256Digest


def child(params_mi: int, root: str, kind: str) -> dict:
    import jax

    import jax_mlpo
    from experiments.bench import sysio
    from jax_mlpo import checkpoint

    if kind == "sha256":
        _use_sha256()
    params, opt_state, step = offloaded_job(params_mi, root)
    mngr = checkpoint.manager(os.path.join(root, "ckpt"), max_to_keep=2)
    out = {}
    jax_mlpo.engine_of(opt_state).drain()
    sysio.drop_page_cache()
    t0, c0 = time.perf_counter(), cpu_seconds()
    checkpoint.save(mngr, 2, params, opt_state, blocking=True)
    out["save_s"], out["save_cpu_s"] = time.perf_counter() - t0, cpu_seconds() - c0
    params, opt_state = step(params, opt_state, 3.0)
    jax.block_until_ready(params)
    jax_mlpo.engine_of(opt_state).drain()
    sysio.drop_page_cache()
    t0, c0 = time.perf_counter(), cpu_seconds()
    checkpoint.save(mngr, 3, params, opt_state, blocking=False)
    out["stall_s"], out["stall_cpu_s"] = time.perf_counter() - t0, cpu_seconds() - c0
    mngr.wait_until_finished()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    sysio.drop_page_cache()
    t0, c0 = time.perf_counter(), cpu_seconds()
    restored = checkpoint.restore(mngr, target, opt_state, step=2)
    out["restore_s"], out["restore_cpu_s"] = time.perf_counter() - t0, cpu_seconds() - c0
    jax_mlpo.close(restored.opt_state)
    mngr.close()
    return out


def _line(x: dict) -> str:
    return ", ".join(f"{p} {x[p + '_s']:.2f} s (CPU {x[p + '_cpu_s']:.2f} s)" for p in PHASES)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-mi", type=int, default=344)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/var/tmp/jax_mlpo_digest_ab")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=("crc32c", "sha256"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.params_mi, args.dir, args.child)), flush=True)
        return {}
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    runs: dict[str, list[dict]] = {"crc32c": [], "sha256": []}
    for r in range(args.rounds):
        for kind in ("sha256", "crc32c") if r % 2 else ("crc32c", "sha256"):
            runs[kind].append(run_child("experiments.bench.digest_ab", [
                f"--child={kind}", f"--params-mi={args.params_mi}", f"--dir={args.dir}",
            ], args.dir))  # fmt: skip
            x = runs[kind][-1]
            logger.info("round %d %s: %s", r, kind, _line(x))
    medians = {
        kind: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for kind, xs in runs.items()
    }
    for kind, m in medians.items():
        logger.info("median %s: %s", kind, _line(m))
    result = {"args": vars(args), "runs": runs, "medians": medians}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
