"""Saves into a deleted checkpoint's files against saves into new files (stop 31), side by side.

One process builds ``--params-mi`` bf16 params with all state on one disk tier (256 MiB host
cache; ``checkpoint_job.offloaded_job``) and two checkpoint managers (``max_to_keep=1``) on the
same disk: ``recycled``, as :func:`jax_mlpo.checkpoint.manager` makes it (a deleted step is
moved aside and its files rewritten by the next save), and ``new`` (orbax deletes for good, so
every save writes new files). Both save twice first, so that ``recycled`` has a deleted step.
Each round then, for both managers in alternating order: a blocking save (page cache dropped,
the last update's write-behind drained first), an update, and an asynchronous save whose stall
(the time ``save`` holds the loop) is measured, waited for before the next. Reported: medians
[min-max] of the blocking save's time and bytes moved per second (``/proc/self/io``), the
stall, and their ratios recycled / new.

    python -m experiments.bench.recycle_ab --params-mi 344 --rounds 3 \
        --json experiments/results/recycle_ab.json
"""

from __future__ import annotations

import logging
import os
import shutil
import time

from experiments.bench.checkpoint_job import ab_parser, offloaded_job, run_in
from experiments.bench.harness import spread, write_json

logger = logging.getLogger("bench.recycle_ab")


def run(params_mi: int, rounds: int, root: str) -> dict:
    import jax

    import jax_mlpo
    from experiments.bench import sysio
    from jax_mlpo import checkpoint

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    params, opt_state, step = offloaded_job(params_mi, root)
    engine = jax_mlpo.engine_of(opt_state)
    managers = {
        "recycled": checkpoint.manager(os.path.join(root, "recycled"), max_to_keep=1),
        "new": checkpoint.manager(os.path.join(root, "new"), max_to_keep=1, todelete_subdir=None),
    }
    figures: dict[str, dict[str, list[float]]] = {
        name: {"seconds": [], "moved_gb_s": [], "stall_seconds": []} for name in managers
    }
    n, k = 0, 3.0

    def update() -> None:
        nonlocal params, opt_state, k
        params, opt_state = step(params, opt_state, k)
        jax.block_until_ready(params)
        k += 0.5

    def moved() -> int:
        io = sysio.proc_io()
        return io["read"] + io["write"]

    for name, mngr in managers.items():  # a deleted step for "recycled" to rewrite
        for _ in range(2):
            n += 1
            checkpoint.save(mngr, n, params, opt_state, blocking=True)
            logger.info("warm-up save %d of %s", n, name)
    for r in range(rounds):
        order = list(managers) if r % 2 == 0 else list(reversed(managers))
        for name in order:
            mngr = managers[name]
            update()
            engine.drain()  # the update's write-behind is not the save's
            sysio.drop_page_cache()
            n += 1
            m0, t0 = moved(), time.perf_counter()
            checkpoint.save(mngr, n, params, opt_state, blocking=True)
            seconds = time.perf_counter() - t0
            figures[name]["seconds"].append(seconds)
            figures[name]["moved_gb_s"].append((moved() - m0) / seconds / 1e9)
            update()
            engine.drain()
            sysio.drop_page_cache()
            n += 1
            t0 = time.perf_counter()
            checkpoint.save(mngr, n, params, opt_state, blocking=False)
            figures[name]["stall_seconds"].append(time.perf_counter() - t0)
            mngr.wait_until_finished()
            logger.info(
                "round %d %s: blocking %.2f s, stall %.3f s", r, name, seconds,
                figures[name]["stall_seconds"][-1],
            )  # fmt: skip
    for mngr in managers.values():
        mngr.close()
    jax_mlpo.close(opt_state)
    out = {name: {key: spread(v) for key, v in f.items()} for name, f in figures.items()}
    out["rounds"] = figures
    out["recycled_over_new"] = {
        key: out["recycled"][key]["median"] / out["new"][key]["median"]
        for key in ("seconds", "moved_gb_s", "stall_seconds")
    }
    return out


def main() -> None:
    args = ab_parser(__doc__, 3, "/var/tmp/jax_mlpo_recycle_ab").parse_args()
    out = run_in(args.dir, lambda: run(args.params_mi, args.rounds, args.dir))
    for name in ("recycled", "new"):
        f = out[name]
        logger.info(
            "%-8s blocking save %.2f s [%.2f-%.2f], %.2f GB/s moved; stall %.3f s [%.3f-%.3f]",
            name, f["seconds"]["median"], f["seconds"]["min"], f["seconds"]["max"],
            f["moved_gb_s"]["median"], f["stall_seconds"]["median"],
            f["stall_seconds"]["min"], f["stall_seconds"]["max"],
        )  # fmt: skip
    logger.info("recycled / new: %s", {k: round(v, 3) for k, v in out["recycled_over_new"].items()})
    write_json(args.json, out)


if __name__ == "__main__":
    main()
