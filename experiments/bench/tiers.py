"""File tier throughput: tensorstore io_mode (page cache vs O_DIRECT) x in-flight requests.

Writes then reads N subgroup blobs through :class:`jax_mlpo.tiers.file.FileTierStore` with all
requests submitted at once (the tier's ``max_concurrency`` bounds those in flight), dropping the
page cache before each read pass when permitted (root), so reads come from the disk. Each
configuration runs ``--repeats`` times, interleaved, and the table gives medians.

Usage:
  python experiments/bench/tiers.py --dir /tmp/tierbench --blob-mib 32 --blobs 16 --repeats 5 \
      [--json experiments/results/tiers.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import statistics
import time

import numpy as np
from sysio import drop_page_cache

from jax_mlpo.config import FileTier
from jax_mlpo.tiers.file import FileTierStore
from jax_mlpo.tiers.permits import TierPermits

logger = logging.getLogger("bench.tiers")


def run_once(
    directory: str, mode: str, concurrency: int, chunk_mib: int, blob_elems: int, blobs: int
):
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    tier = FileTier(
        directory, max_concurrency=concurrency, io_mode=mode, chunk_bytes=chunk_mib * 2**20
    )
    store = FileTierStore(
        tier, {"state": [blob_elems] * blobs}, TierPermits(directory, concurrency, concurrency)
    )
    try:
        bufs = [np.full(blob_elems, i, np.float32) for i in range(min(blobs, 4))]
        total = blob_elems * 4 * blobs
        t0 = time.perf_counter()
        for f in [store.write(i, bufs[i % len(bufs)]) for i in range(blobs)]:
            f.result()
        write_s = time.perf_counter() - t0
        cold = drop_page_cache()
        t0 = time.perf_counter()
        for f in [store.read(i, bufs[i % len(bufs)]) for i in range(blobs)]:
            f.result()
        read_s = time.perf_counter() - t0
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    return total / write_s / 1e9, total / read_s / 1e9, cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/jax_mlpo-tierbench/tier")
    parser.add_argument("--blob-mib", type=int, default=32)
    parser.add_argument("--blobs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default="default,direct")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--chunk-mib", default="64", help="chunk sizes to compare (MiB)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    blob_elems = args.blob_mib * 2**20 // 4
    configs = list(
        itertools.product(
            args.modes.split(","),
            [int(c) for c in args.concurrency.split(",")],
            [int(c) for c in args.chunk_mib.split(",")],
        )
    )
    results: dict[str, dict[str, list[float]]] = {
        f"{m}/c{c}/{k}MiB": {"w": [], "r": []} for m, c, k in configs
    }
    cold_reads = True
    for rep in range(args.repeats):
        for mode, conc, chunk in configs:  # interleaved: slow phases of the disk hit every config
            w, r, cold = run_once(args.dir, mode, conc, chunk, blob_elems, args.blobs)
            cold_reads &= cold
            results[f"{mode}/c{conc}/{chunk}MiB"]["w"].append(w)
            results[f"{mode}/c{conc}/{chunk}MiB"]["r"].append(r)
        logger.info("repeat %d/%d done", rep + 1, args.repeats)
    table = {
        k: {
            "write_gbps": statistics.median(v["w"]),
            "read_gbps": statistics.median(v["r"]),
            "write_range": [min(v["w"]), max(v["w"])],
            "read_range": [min(v["r"]), max(v["r"])],
        }
        for k, v in results.items()
    }
    print(f"{args.blobs} blobs of {args.blob_mib} MiB, fsync'd writes, "
          f"{'cold' if cold_reads else 'page-cache'} reads, medians of {args.repeats}")  # fmt: skip
    print(f"{'config':<20}{'write GB/s':>12}{'(min-max)':>16}{'read GB/s':>12}{'(min-max)':>16}")
    for k, v in table.items():
        wr, rr = v["write_range"], v["read_range"]
        print(f"{k:<20}{v['write_gbps']:>12.2f}{f'{wr[0]:.2f}-{wr[1]:.2f}':>16}"
              f"{v['read_gbps']:>12.2f}{f'{rr[0]:.2f}-{rr[1]:.2f}':>16}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"blob_mib": args.blob_mib, "blobs": args.blobs, "cold_reads": cold_reads,
                       "results": table}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
