"""How a restore reads the params: through orbax, or by jax_mlpo over huge or 4 KiB pages (stop 33).

The params' large arrays are zarr3 arrays of one raw chunk that jax_mlpo wrote itself
(``checkpoint.host_arrays``). A restore reads them with ``host_reads.read_all`` (O_DIRECT
pieces straight into the new arrays; from stop 33's last change on, started by
``host_reads.prefetch`` while the offloaded state streams in), or leaves them to orbax's
``NumpyHandler`` (tensorstore, through the page cache). One process builds ``--params-mi``
bf16 params with all state on one disk tier (``checkpoint_job.offloaded_job``) and saves one
blocking checkpoint; then each round
restores it once per mode, into a fresh ``tx.init`` on a new tier (page cache dropped first, the
restored state closed and its tier deleted after):

* ``orbax``: every array read by orbax;
* ``direct_huge``: ``read_all``, its arrays over transparent huge pages;
* ``direct_4k``: ``read_all``, its arrays over 4 KiB pages (``host_reads.READ_HUGE_PAGES``).

Reported per mode: medians [min-max] of the restore's time, of the time in orbax's tree restores
(the params item, which reads the params, and the small rest) and of the offloaded state's
stream into the engine (``load``).

    python -m experiments.bench.params_read_ab --params-mi 344 --rounds 3 \\
        --json experiments/results/params_read_ab.json
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import time

from experiments.bench.checkpoint_job import ab_parser, offloaded_tx, run_in, saved_job
from experiments.bench.checkpoint_job import timed as timed_into
from experiments.bench.harness import spread, write_json

logger = logging.getLogger("bench.params_read_ab")
MODES = ("orbax", "direct_huge", "direct_4k")


def run(params_mi: int, rounds: int, root: str) -> dict:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    import jax_mlpo
    from experiments.bench import sysio
    from jax_mlpo import checkpoint
    from jax_mlpo.checkpoint import handler, host_reads

    mngr, target = saved_job(params_mi, root)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), target)
    waits: collections.Counter = collections.Counter()
    originals = (
        host_reads.one_raw_chunk, host_reads.READ_HUGE_PAGES,
        ocp.PyTreeCheckpointHandler.restore, handler.load,
    )  # fmt: skip
    ocp.PyTreeCheckpointHandler.restore = timed_into(waits, "orbax_tree", originals[2])
    handler.load = timed_into(waits, "state_stream", originals[3])
    figures = {m: collections.defaultdict(list) for m in MODES}
    try:
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                host_reads.one_raw_chunk = (
                    (lambda *a, **k: None) if mode == "orbax" else originals[0]
                )  # fmt: skip
                host_reads.READ_HUGE_PAGES = mode == "direct_huge"
                tier = os.path.join(root, "restored_tier")
                fresh = offloaded_tx(tier).init(zeros)
                sysio.drop_page_cache()
                waits.clear()
                t0 = time.perf_counter()
                restored = checkpoint.restore(mngr, target, fresh, step=1)
                figures[mode]["restore_s"].append(time.perf_counter() - t0)
                for key in ("orbax_tree", "state_stream"):
                    figures[mode][f"{key}_s"].append(waits[key])
                jax_mlpo.close(restored.opt_state)
                del restored, fresh
                shutil.rmtree(tier, ignore_errors=True)
                logger.info("round %d %s: %s", r, mode,
                            {k: round(v[-1], 2) for k, v in figures[mode].items()})  # fmt: skip
    finally:
        host_reads.one_raw_chunk, host_reads.READ_HUGE_PAGES = originals[:2]
        ocp.PyTreeCheckpointHandler.restore, handler.load = originals[2:]
        mngr.close()
    out: dict = {m: {k: spread(v) for k, v in figures[m].items()} for m in MODES}
    out["rounds"] = {m: dict(f) for m, f in figures.items()}
    return out


def main() -> None:
    parser = ab_parser(__doc__, 3, "/var/tmp/jax_mlpo_params_read_ab")
    args = parser.parse_args()
    out = run_in(args.dir, lambda: run(args.params_mi, args.rounds, args.dir))
    for mode in MODES:
        f = out[mode]
        logger.info(
            "%s: restore %.2f s [%.2f-%.2f], orbax tree restores %.2f s [%.2f-%.2f], state "
            "stream %.2f s", mode, f["restore_s"]["median"], f["restore_s"]["min"],
            f["restore_s"]["max"], f["orbax_tree_s"]["median"], f["orbax_tree_s"]["min"],
            f["orbax_tree_s"]["max"], f["state_stream_s"]["median"],
        )  # fmt: skip
    write_json(args.json, {"args": vars(args), **out})


if __name__ == "__main__":
    main()
