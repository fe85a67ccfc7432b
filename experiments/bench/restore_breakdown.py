"""Where a restore's time goes (stop 31): the state's stream waiting for checkpoint reads.

One process builds ``--params-mi`` bf16 params with all state on one disk tier
(``checkpoint_job.offloaded_job``), saves a blocking checkpoint, then ``--rounds`` times
restores it into a fresh ``tx.init`` on a second tier (page cache dropped first) with each of
``--settings`` in turn (``[state_reader.READ_THREADS, state_reader.READ_AHEAD]``: pieces read
at once, subgroups read ahead), with the restoring thread timed: ``fill`` (the state reader
filling each subgroup's blob), within it the wait for checkpoint pieces being read
(``_chunk``), and the wait for the tier's write-behind (``HostBufferPool.wait``). Beside it,
fio's sequential O_DIRECT reads of a laid-out file at 8 MiB x 4 and 32 MiB x 32.

    python -m experiments.bench.restore_breakdown --params-mi 344 --rounds 3 \
        --settings '[[4, 1], [32, 5]]' --json experiments/results/restore_breakdown.json
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time

from experiments.bench.checkpoint_job import ab_parser, offloaded_tx, run_in, saved_job
from experiments.bench.checkpoint_job import timed as timed_into

logger = logging.getLogger("bench.restore_breakdown")


def fio_read(directory: str, block: str, depth: int) -> float:
    """GB/s of fio's sequential O_DIRECT reads of a 4 GiB file laid out first (3 s)."""
    import subprocess

    path = os.path.join(directory, "fio-read")
    common = ["--filename=" + path, "--size=4GiB", "--direct=1", "--ioengine=libaio"]
    subprocess.run(["fio", "--name=lay", "--rw=write", "--bs=32M", "--iodepth=8", *common],
                   capture_output=True, check=True)  # fmt: skip
    out = subprocess.run(["fio", "--name=r", "--rw=read", f"--bs={block}", f"--iodepth={depth}",
                          "--time_based", "--runtime=3", "--output-format=json", *common],
                         capture_output=True, text=True, check=True)  # fmt: skip
    os.remove(path)
    return json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9


def run(params_mi: int, rounds: int, root: str, settings: list[list[int]]) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_mlpo
    from experiments.bench import sysio
    from jax_mlpo import checkpoint
    from jax_mlpo.checkpoint import state_reader
    from jax_mlpo.tiers import host

    waits: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        setattr(owner, name, timed_into(waits, label, getattr(owner, name)))

    timed(state_reader.StateReader, "fill", "fill_s")
    timed(state_reader.StateReader, "_chunk", "read_wait_s")
    timed(host.HostBufferPool, "wait", "tier_write_wait_s")
    mngr, target = saved_job(params_mi, root)
    out: dict = {"restores": []}
    for r in range(rounds * len(settings)):
        setting = settings[r % len(settings)]
        state_reader.READ_THREADS, state_reader.READ_AHEAD = setting
        tx = offloaded_tx(os.path.join(root, "restored"))
        fresh = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), target)
        opt_state = tx.init(fresh)
        del fresh
        sysio.drop_page_cache()
        waits.clear()
        t0 = time.perf_counter()
        restored = checkpoint.restore(mngr, target, opt_state)
        seconds = time.perf_counter() - t0
        out["restores"].append({"setting": setting, "seconds": seconds, **waits})
        jax_mlpo.close(restored.opt_state)
        del restored, opt_state
        logger.info("restore %d, %s: %.2f s; read wait %.2f s, fill %.2f s, tier write wait %.2f s",
                    r, setting, seconds, waits["read_wait_s"], waits["fill_s"],
                    waits["tier_write_wait_s"])  # fmt: skip
    mngr.close()
    out["fio_read_8m_x4_gbps"] = fio_read(root, "8M", 4)
    out["fio_read_32m_x32_gbps"] = fio_read(root, "32M", 32)
    return out


def main() -> None:
    parser = ab_parser(__doc__, 3, "/var/tmp/jax_mlpo_restore_breakdown")
    parser.add_argument("--settings", default="[[4, 1]]", help="[[read threads, ahead], ...]")
    args = parser.parse_args()
    settings = json.loads(args.settings)
    out = run_in(args.dir, lambda: run(args.params_mi, args.rounds, args.dir, settings))
    for setting in settings:
        times = sorted(x["seconds"] for x in out["restores"] if x["setting"] == setting)
        logger.info("%s: restore %.2f s median [%.2f-%.2f]", setting, times[len(times) // 2],
                    times[0], times[-1])  # fmt: skip
    logger.info("fio sequential reads: 8 MiB x 4 %.2f GB/s, 32 MiB x 32 %.2f GB/s",
                out["fio_read_8m_x4_gbps"], out["fio_read_32m_x32_gbps"])  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)


if __name__ == "__main__":
    main()
