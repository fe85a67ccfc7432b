"""File tier throughput against the disk's raw bandwidth, measured in the same run.

Writes then reads N subgroup blobs through :class:`jax_mlpo.tiers.file.FileTierStore` with all
requests submitted at once (the tier's ``max_concurrency`` bounds the blobs in flight), from
page-aligned buffers as the engine's, dropping the page cache before each read pass when
permitted (root), so reads come from the disk. Each configuration (I/O engine and mode) runs
``--repeats`` times, interleaved with fio (O_DIRECT, 1 MiB requests, queue depth 8: the raw
sequential bandwidth, as DeepSpeed's aio config uses it) on the same directory; the table gives
medians and ``tier_efficiency`` = tier GB/s / fio GB/s of the same repeat (median over repeats).
A mixed pass reads half the blobs while writing the other half (an update's pattern); its
efficiency is against fio's 50/50 random mix at 32 MiB x 32 in flight (the best point of
``experiments.bench.disk_limit``'s sweep on the disk measured).

Usage:
  python -m experiments.bench.mlpo.tiers --dir /tmp/jax_mlpo-tierbench --blob-mib 96 \
      --blobs 16 --repeats 5 [--json experiments/results/tiers.json]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time

from experiments.bench.harness import interleave, medians, spread, write_json
from experiments.bench.sysio import drop_page_cache, fio_bandwidth, fio_mixed
from jax_mlpo.config import FileTier, TierLimits
from jax_mlpo.tiers.file import FileTierStore, TierPermits
from jax_mlpo.tiers.posix import aligned_empty

logger = logging.getLogger("bench.tiers")


def run_once(directory: str, config: str, args: argparse.Namespace) -> dict:
    """GB/s of writing, reading, then reading half the blobs while writing the other half
    (the update's pattern) with one tier configuration: ``engine:mode[:submit[:nosync]]``."""
    engine, mode, *rest = config.split(":")
    submit = rest[0] if rest else "aio"
    sync = "nosync" not in rest
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    tier = FileTier(
        directory,
        io_engine=engine,
        io_mode=mode,
        io_submit=submit,
        sync=sync,
        limits=TierLimits(max_concurrency=args.concurrency),
        queue_depth=args.queue_depth,
        chunk_bytes=args.chunk_mib * 2**20,
    )
    blob_elems = args.blob_mib * 2**20 // 4
    store = FileTierStore(
        tier,
        {"state": [blob_elems] * args.blobs},
        TierPermits(directory, args.concurrency, args.concurrency),
    )
    try:
        bufs = [aligned_empty(blob_elems) for _ in range(min(args.blobs, 4))]
        for i, b in enumerate(bufs):
            b.fill(i)
        total = blob_elems * 4 * args.blobs
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        for f in [store.write(i, bufs[i % len(bufs)]) for i in range(args.blobs)]:
            f.result()
        write_s = time.perf_counter() - t0
        cold = drop_page_cache()
        t0 = time.perf_counter()
        for f in [store.read(i, bufs[i % len(bufs)]) for i in range(args.blobs)]:
            f.result()
        read_s = time.perf_counter() - t0
        cold = drop_page_cache() and cold
        half = args.blobs // 2
        t0 = time.perf_counter()
        futures = [
            f
            for i in range(half)
            for f in (
                store.read(i, bufs[i % len(bufs)]),
                store.write(half + i, bufs[(half + i) % len(bufs)]),
            )
        ]
        for f in futures:
            f.result()
        mixed_s = time.perf_counter() - t0
        cpu_s = _cpu_s() - cpu0  # page-cache drops included: a few ms
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    mixed_bytes = blob_elems * 4 * 2 * (args.blobs // 2)
    return {
        "w": total / write_s / 1e9,
        "r": total / read_s / 1e9,
        "m": mixed_bytes / mixed_s / 1e9,
        "cpu_s_per_gb": cpu_s / ((2 * total + mixed_bytes) / 1e9),
        "cold": cold,
    }


def _cpu_s() -> float:
    """This process's CPU seconds, all threads, user and system (the I/O's own cost: the
    submission, copies and checksums, not the device's time)."""
    t = os.times()
    return t.user + t.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/jax_mlpo-tierbench")
    parser.add_argument("--blob-mib", type=int, default=96, help="one blob (a subgroup's p, m, v)")
    parser.add_argument("--blobs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--configs",
        default="posix:direct:aio,posix:direct:threads,posix:direct:aio:nosync,tensorstore:direct",
        help="io_engine:io_mode[:io_submit[:nosync]] configurations to compare",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="FileTier.max_concurrency")
    parser.add_argument("--queue-depth", type=int, default=8, help="FileTier.queue_depth")
    parser.add_argument("--chunk-mib", type=int, default=8, help="FileTier.chunk_bytes in MiB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    configs = args.configs.split(",")
    disk: list[dict[str, float]] = []

    def measure_disk(rep: int) -> None:
        raw = fio_bandwidth(os.path.join(args.dir, "fio"))
        if "error" in raw:
            raise SystemExit(raw["error"])
        # the mixed limit: fio's 50/50 random mix at the sweep's best point
        raw["mixed_gbps"] = fio_mixed(os.path.join(args.dir, "fio"), block="32M", depth=32)[
            "mixed_gbps"
        ]
        disk.append(raw)
        logger.info("repeat %d/%d: fio %s", rep + 1, args.repeats, raw)

    def run(config: str, rep: int) -> dict[str, float]:
        out = run_once(os.path.join(args.dir, "tier"), config, args)
        raw = disk[rep]
        return out | {"w_eff": out["w"] / raw["write_gbps"], "r_eff": out["r"] / raw["read_gbps"],
                      "m_eff": out["m"] / raw["mixed_gbps"]}  # fmt: skip

    # interleaved with fio and each other: slow phases of the disk hit every config
    results = interleave(configs, args.repeats, run, before_round=measure_disk)
    cold_reads = all(r["cold"] for rows in results.values() for r in rows)
    table = {}
    for c, rows in results.items():
        w, r = spread(x["w"] for x in rows), spread(x["r"] for x in rows)
        m = spread(x["m"] for x in rows)
        eff = medians(rows, ("w_eff", "r_eff", "m_eff", "cpu_s_per_gb"))
        table[c] = {
            "write_gbps": w["median"],
            "read_gbps": r["median"],
            "write_range": [w["min"], w["max"]],
            "read_range": [r["min"], r["max"]],
            "mixed_gbps": m["median"],
            "mixed_range": [m["min"], m["max"]],
            "write_efficiency": eff["w_eff"],
            "read_efficiency": eff["r_eff"],
            "mixed_efficiency": eff["m_eff"],
            "cpu_s_per_gb": eff["cpu_s_per_gb"],
        }
    fio = {k: spread(d[k] for d in disk) for k in ("write_gbps", "read_gbps", "mixed_gbps")}
    limits = {k: v["median"] for k, v in fio.items()} | {
        f"{k}_range": [v["min"], v["max"]] for k, v in fio.items()
    }
    print(
        f"{args.blobs} blobs of {args.blob_mib} MiB, {args.chunk_mib} MiB requests, "
        f"max_concurrency {args.concurrency}, queue_depth {args.queue_depth}, "
        f"{'cold' if cold_reads else 'page-cache'} reads; medians of {args.repeats} interleaved "
        "repeats"
    )
    print(
        f"raw (fio O_DIRECT 1 MiB QD8): write {limits['write_gbps']:.2f} GB/s "
        f"[{fio['write_gbps']['min']:.2f}-{fio['write_gbps']['max']:.2f}], "
        f"read {limits['read_gbps']:.2f} GB/s "
        f"[{fio['read_gbps']['min']:.2f}-{fio['read_gbps']['max']:.2f}]; "
        f"mixed limit (fio 50/50 randrw, 32 MiB x 32) {limits['mixed_gbps']:.2f} GB/s "
        f"[{fio['mixed_gbps']['min']:.2f}-{fio['mixed_gbps']['max']:.2f}]"
    )
    print(
        f"{'config':<30}{'write GB/s':>11}{'eff':>6}{'read GB/s':>11}{'eff':>6}"  # fmt: skip
        f"{'mixed GB/s':>12}{'eff':>6}{'CPU s/GB':>10}"
    )
    for c, v in table.items():
        print(
            f"{c:<30}{v['write_gbps']:>11.2f}{v['write_efficiency']:>6.2f}"
            f"{v['read_gbps']:>11.2f}{v['read_efficiency']:>6.2f}{v['mixed_gbps']:>12.2f}"
            f"{v['mixed_efficiency']:>6.2f}{v['cpu_s_per_gb']:>10.3f}"
        )
    result = {"args": vars(args), "cold_reads": cold_reads, "fio": limits, "results": table}
    write_json(args.json, result)


if __name__ == "__main__":
    main()
