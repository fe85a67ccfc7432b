"""The params' writer (``host_arrays.ArrayWriter``) at several depths, side by side (stop 31).

Writes 21 bf16 arrays of 32 MiB (the checkpoint benchmark's 688 MiB of params) with each
setting in turn, page cache dropped before each, into the files of the previous write (moved
aside as a deleted checkpoint is: ``jax_mlpo.checkpoint.recycle``); the first write of all
goes to new files and is left out of the medians. Settings are ``[io_threads, piece_bytes,
producers]``: the writer keeps ``producers * io_threads`` buffers of ``piece_bytes``.

    python -m experiments.bench.params_write_ab --rounds 5 \
        --settings '[[4, 8388608, 2], [8, 8388608, 2], [8, 16777216, 2]]'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import time

import ml_dtypes
import numpy as np

from experiments.bench import sysio
from jax_mlpo.checkpoint import host_arrays, recycle

logger = logging.getLogger("bench.params_write_ab")


def run(settings: list[list[int]], rounds: int, base: str) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal(16 << 20, np.float32).astype(ml_dtypes.bfloat16) for _ in range(21)
    ]
    writers = {}
    for setting in settings:
        host_arrays.IO_THREADS, host_arrays.PIECE_BYTES, host_arrays.PRODUCERS = setting
        writers[json.dumps(setting)] = host_arrays.ArrayWriter()  # reads them when made
    seconds: dict[str, list[float]] = {key: [] for key in writers}
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(os.path.join(base, recycle.RECYCLED))
    n = 0
    try:
        for _ in range(rounds):
            for key, writer in writers.items():
                host_arrays.PIECE_BYTES = json.loads(key)[1]  # read per write
                spares = recycle.spare_files(base)  # the previous write's files
                n += 1
                root = os.path.join(base, str(n))
                os.makedirs(root)
                sysio.drop_page_cache()
                t0 = time.perf_counter()
                writer.write_all([f"{root}/w{i}" for i in range(len(arrays))], arrays, spares)
                seconds[key].append(time.perf_counter() - t0)
                os.rename(root, os.path.join(base, recycle.RECYCLED, str(n)))
    finally:
        for writer in writers.values():
            writer.close()
        shutil.rmtree(base, ignore_errors=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="[[4, 8388608, 2], [8, 8388608, 2]]")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/var/tmp/jax_mlpo_params_write_ab")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
    seconds = run(json.loads(args.settings), args.rounds, args.dir)
    first = next(iter(seconds))
    seconds[first] = seconds[first][1:]  # new files
    for key, values in seconds.items():
        logger.info(
            "[io_threads, piece_bytes, producers] = %s: %.3f s [%.3f-%.3f] for 672 MiB (%.2f GB/s)",
            key, statistics.median(values), min(values), max(values),
            21 * (32 << 20) / statistics.median(values) / 1e9,
        )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(seconds, f, indent=1)


if __name__ == "__main__":
    main()
