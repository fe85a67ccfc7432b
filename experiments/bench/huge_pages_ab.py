"""I/O buffers over transparent huge pages or 4 KiB pages, interleaved in one process (stop 33).

``aligned_empty`` (``jax_mlpo.tiers.submit``) advises its buffers for transparent huge pages
(``submit.HUGE_PAGES``). The block layer builds one request from physically contiguous memory,
so the buffers' pages set the size of the requests that reach the disk. This benchmark builds
two jobs in one process, each ``--params-mi`` bf16 params with all state on its own disk tier
and a 256 MiB host cache (``checkpoint_job.offloaded_job``): one with every buffer made with the
advice off (its buffer pool too), one with it on. Each round times, for each job in turn (the
order reversed every other round, the page cache dropped before each): an update with its
write-behind drained, a blocking save (``max_to_keep=1``, so from the second on each rewrites
the files of the step deleted before it) and a restore of that save into a fresh ``tx.init``.

Reported per job: medians [min-max] of the seconds, the bytes moved per second
(``/proc/self/io``), the mean request size the disk saw (``/proc/diskstats``, the device
holding ``--dir``), and each save's and restore's peak RSS growth over the RSS before it
(``VmHWM``, reset before each); and the ratio of the medians, huge pages over 4 KiB pages.

    python -m experiments.bench.huge_pages_ab --params-mi 344 --rounds 4 \\
        --json experiments/results/huge_pages_ab.json
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from typing import Any

from experiments.bench.checkpoint import reset_peak
from experiments.bench.checkpoint_job import ab_parser, offloaded_job, offloaded_tx, run_in
from experiments.bench.harness import spread, write_json

logger = logging.getLogger("bench.huge_pages_ab")
JOBS = {"4k_pages": False, "huge_pages": True}
PHASES = ("update", "save", "restore")


def _device(path: str) -> str:
    """The block device (``/proc/diskstats`` name) holding ``path``."""
    dev = os.stat(path).st_dev
    return os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))


def _disk(device: str) -> tuple[int, int]:
    """``(requests completed, bytes moved)`` by ``device`` so far, reads and writes."""
    with open("/proc/diskstats") as f:
        for line in f:
            x = line.split()
            if x[2] == device:
                return int(x[3]) + int(x[7]), (int(x[5]) + int(x[9])) * 512
    raise RuntimeError(f"{device} is not in /proc/diskstats")


def run(params_mi: int, rounds: int, root: str) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_mlpo
    from experiments.bench import sysio
    from experiments.host_memory import process_memory
    from jax_mlpo import checkpoint
    from jax_mlpo.tiers import submit

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    device = _device(root)
    jobs: dict[str, dict[str, Any]] = {}
    try:
        for name, huge in JOBS.items():
            submit.HUGE_PAGES = huge  # the pool's buffers are made now, with the job
            job_root = os.path.join(root, name)
            os.makedirs(job_root)
            params, opt_state, step = offloaded_job(params_mi, job_root)
            jobs[name] = {
                "params": params, "opt_state": opt_state, "step": step, "n": 0,
                "tier": os.path.join(job_root, "tier"),
                "mngr": checkpoint.manager(os.path.join(job_root, "ckpt"), max_to_keep=1),
            }  # fmt: skip
        figures = {name: {p: [] for p in PHASES} for name in JOBS}

        def measure(name: str, phase: str, f) -> Any:
            submit.HUGE_PAGES = JOBS[name]
            sysio.drop_page_cache()
            reset_peak()
            rss0 = process_memory()["rss_bytes"]
            (req0, disk0), io0 = _disk(device), sysio.proc_io()
            t0 = time.perf_counter()
            result = f()
            seconds = time.perf_counter() - t0
            (req1, disk1), io1 = _disk(device), sysio.proc_io()
            moved = io1["read"] + io1["write"] - io0["read"] - io0["write"]
            figures[name][phase].append({
                "seconds": seconds, "moved_gb_s": moved / seconds / 1e9,
                "request_mib": (disk1 - disk0) / max(1, req1 - req0) / 2**20,
                "rss_growth_mib": (process_memory()["peak_rss_bytes"] - rss0) / 2**20,
            })  # fmt: skip
            return result

        def one_round(name: str) -> None:
            job = jobs[name]
            job["n"] += 1

            def update() -> None:
                job["params"], job["opt_state"] = job["step"](
                    job["params"], job["opt_state"], 2.0 + job["n"] / 2
                )
                jax.block_until_ready(job["params"])
                jax_mlpo.engine_of(job["opt_state"]).drain()

            measure(name, "update", update)
            measure(name, "save", lambda: checkpoint.save(
                job["mngr"], job["n"], job["params"], job["opt_state"], blocking=True
            ))  # fmt: skip
            restored_tier = os.path.join(root, name, "restored_tier")
            tx = offloaded_tx(restored_tier)
            fresh = tx.init(jax.tree.map(jnp.zeros_like, job["params"]))
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), job["params"])
            restore = functools.partial(checkpoint.restore, job["mngr"], target, fresh)
            restored = measure(name, "restore", lambda: restore(step=job["n"]))
            jax_mlpo.close(restored.opt_state)
            shutil.rmtree(restored_tier, ignore_errors=True)

        for name in JOBS:  # warm-up: each job's first save writes new files
            one_round(name)
            figures[name] = {p: [] for p in PHASES}
        for r in range(rounds):
            order = list(JOBS) if r % 2 == 0 else list(JOBS)[::-1]
            for name in order:
                one_round(name)
                logger.info("round %d %s: %s", r, name, {
                    p: {k: round(v, 2) for k, v in figures[name][p][-1].items()} for p in PHASES
                })  # fmt: skip
    finally:
        submit.HUGE_PAGES = True
        for job in jobs.values():
            job["mngr"].close()
            jax_mlpo.close(job["opt_state"])
    out: dict[str, Any] = {
        name: {
            p: {k: spread(x[k] for x in figures[name][p]) for k in figures[name][p][0]}
            for p in PHASES
        }
        for name in JOBS
    }
    out["rounds"] = figures
    out["huge_over_4k_seconds"] = {
        p: out["huge_pages"][p]["seconds"]["median"] / out["4k_pages"][p]["seconds"]["median"]
        for p in PHASES
    }
    return out


def main() -> None:
    parser = ab_parser(__doc__, 4, "/var/tmp/jax_mlpo_huge_pages_ab")
    args = parser.parse_args()
    out = run_in(args.dir, lambda: run(args.params_mi, args.rounds, args.dir))
    for p in PHASES:
        for name in JOBS:
            f = out[name][p]
            logger.info(
                "%s, %s: %.2f s [%.2f-%.2f], %.2f GB/s moved, requests of %.2f MiB, RSS growth "
                "%.0f MiB", p, name, f["seconds"]["median"], f["seconds"]["min"],
                f["seconds"]["max"], f["moved_gb_s"]["median"], f["request_mib"]["median"],
                f["rss_growth_mib"]["max"],
            )  # fmt: skip
        logger.info("%s: huge pages take %.2fx the time of 4 KiB pages", p,
                    out["huge_over_4k_seconds"][p])  # fmt: skip
    write_json(args.json, {"args": vars(args), **out})


if __name__ == "__main__":
    main()
