"""A blocking save under several I/O settings, interleaved in one process (stop 32).

The disk here swings by a third from one save to the next (3.5-5.6 s for the same code and
state, stop 32), so settings are compared within one process, alternating save by save, not
across processes started minutes apart. One process builds ``--params-mi`` bf16 params with all
state on one disk tier (256 MiB host cache; ``checkpoint_job.offloaded_job``) and one checkpoint
manager (``max_to_keep=1``: every measured save rewrites the files of the step deleted before
it). After two warm-up saves, each round makes one blocking save per setting (the order
reversed every other round; an update before each, its write-behind drained and the page cache
dropped). A setting (JSON) may set:

* ``threads`` / ``in_flight``: the state writer's I/O threads and pieces in flight
  (``stream.IO_THREADS``, ``stream.MAX_IN_FLIGHT``; defaults 4 and 8, of 8 MiB);
* ``read_ahead``: tier blobs read ahead of the one being written (``snapshot.READ_AHEAD``,
  default 2, of 48 MiB here);
* ``page_cache``: write the checkpoint's files through the page cache instead of O_DIRECT.

Reported per setting: medians [min-max] of the save's time, bytes moved per second
(``/proc/self/io``), CPU seconds (user + system) and peak RSS growth over the RSS before the
first save (``VmHWM``, reset before each save).

    python -m experiments.bench.save_settings_ab --params-mi 344 --rounds 4 --settings \
        '[{}, {"threads": 8, "in_flight": 16, "read_ahead": 4}]' \
        --json experiments/results/save_settings_ab.json
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from experiments.bench.checkpoint import reset_peak
from experiments.bench.checkpoint_job import ab_parser, offloaded_job, run_in
from experiments.bench.harness import spread, write_json

logger = logging.getLogger("bench.save_settings_ab")


def run(params_mi: int, rounds: int, settings: list[dict], root: str) -> dict:
    import jax

    import jax_mlpo
    from experiments.bench import sysio
    from experiments.host_memory import process_memory
    from jax_mlpo import checkpoint, snapshot
    from jax_mlpo.checkpoint import shard_file, stream

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    params, opt_state, step = offloaded_job(params_mi, root)
    engine = jax_mlpo.engine_of(opt_state)
    mngr = checkpoint.manager(os.path.join(root, "ckpt"), max_to_keep=1)
    defaults = (stream.IO_THREADS, stream.MAX_IN_FLIGHT, snapshot.READ_AHEAD)
    open_direct = shard_file.open_direct
    start_rss = process_memory()["rss_bytes"]
    names = [json.dumps(s, sort_keys=True) for s in settings]
    figures = {name: {"seconds": [], "moved_gb_s": [], "cpu_seconds": [], "rss_growth_mib": []}
               for name in names}  # fmt: skip
    n = 0

    def save(setting: dict) -> dict[str, float]:
        nonlocal params, opt_state, n
        n += 1
        params, opt_state = step(params, opt_state, 2.0 + n / 2)
        jax.block_until_ready(params)
        engine.drain()  # the update's write-behind is not the save's
        stream.IO_THREADS = setting.get("threads", defaults[0])
        stream.MAX_IN_FLIGHT = setting.get("in_flight", defaults[1])
        snapshot.READ_AHEAD = setting.get("read_ahead", defaults[2])
        shard_file.open_direct = (
            (lambda path, flags: os.open(path, flags, 0o600))
            if setting.get("page_cache") else open_direct
        )  # fmt: skip
        sysio.drop_page_cache()
        reset_peak()
        io0, cpu0, t0 = sysio.proc_io(), os.times(), time.perf_counter()
        checkpoint.save(mngr, n, params, opt_state, blocking=True)
        seconds, io1, cpu1 = time.perf_counter() - t0, sysio.proc_io(), os.times()
        moved = io1["read"] + io1["write"] - io0["read"] - io0["write"]
        return {
            "seconds": seconds, "moved_gb_s": moved / seconds / 1e9,
            "cpu_seconds": cpu1.user + cpu1.system - cpu0.user - cpu0.system,
            "rss_growth_mib": (process_memory()["peak_rss_bytes"] - start_rss) / 2**20,
        }  # fmt: skip

    try:
        for _ in range(2):
            logger.info("warm-up save: %.2f s", save({})["seconds"])
        for r in range(rounds):
            order = list(range(len(settings)))
            for k in order if r % 2 == 0 else order[::-1]:
                got = save(settings[k])
                for key, value in got.items():
                    figures[names[k]][key].append(value)
                logger.info("round %d %s: %s", r, names[k],
                            {key: round(v, 2) for key, v in got.items()})  # fmt: skip
    finally:
        stream.IO_THREADS, stream.MAX_IN_FLIGHT, snapshot.READ_AHEAD = defaults
        shard_file.open_direct = open_direct
        mngr.close()
        jax_mlpo.close(opt_state)
    out = {name: {key: spread(v) for key, v in f.items()} for name, f in figures.items()}
    out["rounds"] = figures
    base = out[names[0]]["seconds"]["median"]
    out["seconds_over_first"] = {name: out[name]["seconds"]["median"] / base for name in names}
    return out


def main() -> None:
    parser = ab_parser(__doc__, 4, "/var/tmp/jax_mlpo_save_settings_ab")
    parser.add_argument(
        "--settings", default='[{}, {"threads": 8, "in_flight": 16, "read_ahead": 4}]'
    )
    args = parser.parse_args()
    settings = json.loads(args.settings)
    out = run_in(args.dir, lambda: run(args.params_mi, args.rounds, settings, args.dir))
    for name, ratio in out["seconds_over_first"].items():
        f = out[name]
        logger.info(
            "%s: save %.2f s [%.2f-%.2f] (%.2fx the first), %.2f GB/s moved, CPU %.2f s, "
            "RSS growth %.0f MiB", name, f["seconds"]["median"], f["seconds"]["min"],
            f["seconds"]["max"], ratio, f["moved_gb_s"]["median"], f["cpu_seconds"]["median"],
            f["rss_growth_mib"]["max"],
        )  # fmt: skip
    write_json(args.json, {"args": vars(args), **out})


if __name__ == "__main__":
    main()
