"""Where an asynchronous save's stall goes: a timeline of what ``save`` does before it returns.

One process builds ``--params-mi`` bf16 params with all state on one disk tier
(``checkpoint_job.offloaded_job``) and one checkpoint manager (``max_to_keep=1``: from the third
save on, each rewrites the files of the step deleted before it). Each round: an update, its
write-behind drained, the page cache dropped, then the time the first thread started after the
drop takes (a drop evicts the process's code too), then an asynchronous save, timed, with the
start and end of each of its parts (offsets from the call, in seconds): ``spare_files`` (the
deleted checkpoint's files found), ``check_space``, the engine's ``flush`` (the retained
subgroups written to their tiers) and the params' ``write_all``; then the save is waited for.

    python -m experiments.bench.stall_breakdown --params-mi 344 --rounds 5 \\
        --json experiments/results/stall_breakdown.json
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable

from experiments.bench.checkpoint_job import ab_parser, offloaded_job, run_in, spanned
from experiments.bench.harness import spread, write_json

logger = logging.getLogger("bench.stall_breakdown")


def run(params_mi: int, rounds: int, root: str) -> dict:
    import jax

    import jax_mlpo
    from experiments.bench import sysio
    from jax_mlpo import checkpoint
    from jax_mlpo.checkpoint import host_arrays, training
    from jax_mlpo.engine import Engine

    events: list[tuple[str, float, float]] = []
    start = [0.0]

    def traced(label: str, f: Callable) -> Callable:
        return spanned(f, lambda a, b: events.append((label, a - start[0], b - start[0])))

    parts = [
        (host_arrays.ArrayWriter, "write_all"), (Engine, "flush"),
        (training, "spare_files"), (training, "check_space"),
    ]  # fmt: skip
    originals = [(owner, name, getattr(owner, name)) for owner, name in parts]
    for owner, name, f in originals:
        setattr(owner, name, traced(name, f))
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    params, opt_state, step = offloaded_job(params_mi, root)
    engine = jax_mlpo.engine_of(opt_state)
    mngr = checkpoint.manager(os.path.join(root, "ckpt"), max_to_keep=1)
    out: dict = {"stall_s": [], "cold_thread_start_s": [], "timelines": []}
    try:
        for n in range(1, rounds + 1):
            params, opt_state = step(params, opt_state, 2.0 + n / 2)
            jax.block_until_ready(params)
            engine.drain()
            sysio.drop_page_cache()
            t = time.perf_counter()
            thread = threading.Thread(target=lambda: None)
            thread.start()
            thread.join()
            out["cold_thread_start_s"].append(time.perf_counter() - t)
            events.clear()
            start[0] = time.perf_counter()
            checkpoint.save(mngr, n, params, opt_state, blocking=False)
            out["stall_s"].append(time.perf_counter() - start[0])
            out["timelines"].append(sorted(events, key=lambda e: e[1]))
            mngr.wait_until_finished()
            logger.info(
                "save %d: stall %.3f s (a thread started after the drop: %.1f ms): %s", n,
                out["stall_s"][-1], 1e3 * out["cold_thread_start_s"][-1],
                "; ".join(f"{label} {a:.3f}-{b:.3f}" for label, a, b in out["timelines"][-1]),
            )  # fmt: skip
    finally:
        for owner, name, f in originals:
            setattr(owner, name, f)
        mngr.close()
        jax_mlpo.close(opt_state)
    later = slice(2, None)  # from the third save on, each rewrites a deleted checkpoint's files
    out["summary"] = {
        "stall_s_from_third": spread(out["stall_s"][later]),
        "cold_thread_start_s": spread(out["cold_thread_start_s"]),
    }
    return out


def main() -> None:
    parser = ab_parser(__doc__, 5, "/var/tmp/jax_mlpo_stall_breakdown")
    args = parser.parse_args()
    out = run_in(args.dir, lambda: run(args.params_mi, args.rounds, args.dir))
    s = out["summary"]
    logger.info(
        "stall from the third save on: %.3f s [%.3f-%.3f]; a thread started after a page "
        "cache drop: %.1f ms [%.1f-%.1f]", s["stall_s_from_third"]["median"],
        s["stall_s_from_third"]["min"], s["stall_s_from_third"]["max"],
        1e3 * s["cold_thread_start_s"]["median"], 1e3 * s["cold_thread_start_s"]["min"],
        1e3 * s["cold_thread_start_s"]["max"],
    )  # fmt: skip
    write_json(args.json, {"args": vars(args), **out})


if __name__ == "__main__":
    main()
