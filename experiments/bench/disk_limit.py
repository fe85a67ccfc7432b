"""The disk's limit, measured the way DeepSpeed's ``ds_nvme_tune`` does: a sweep.

Request size (1-32 MiB) x requests in flight (4-64) x direction (random reads, random writes,
and 50/50 reads and writes at once), O_DIRECT, on one file laid out once in the given
directory (a tier's file system). The best mixed figure (reads + writes) is the limit an
update, which reads and writes at once, is compared with; the best read and write figures are
given beside it. Every point is the median of ``--repeats`` interleaved passes over the grid
(one 5 s point on this shared disk moved 1.17 GB/s once and 1.51 the next time); each pass's
figure is in the JSON, with the table printed.

    python -m experiments.bench.disk_limit --dir runs/disk-limit \
        --json experiments/results/disk_limit.json [--engine fio|probe]

The engine: fio with libaio where it is installed, else our own probe
(:mod:`jax_mlpo.native.disk_probe`: a thread per request in flight, blocking pread/pwrite, the
file tiers' own submission path). ``--engine probe`` forces it (the JSON says which ran).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import time
from typing import Any

from experiments.bench.harness import write_json
from experiments.bench.sysio import filesystem
from jax_mlpo.native import disk_probe
from jax_mlpo.tiers.settings import parse_size

logger = logging.getLogger("bench.disk_limit")

BLOCKS = ("1M", "2M", "4M", "8M", "16M", "32M")
DEPTHS = (4, 8, 16, 32, 64)
MODES = {"read": "randread", "write": "randwrite", "mixed": "randrw"}


def fio_point(path: str, size: str, mode: str, block: str, depth: int, runtime_s: int) -> dict:
    """One fio job on ``path``: GB/s read and written (``mixed_gbps``: their sum)."""
    cmd = [
        "fio", "--name=sweep", f"--filename={path}", f"--rw={MODES[mode]}", "--rwmixread=50",
        f"--bs={block}", f"--iodepth={depth}", "--ioengine=libaio", "--direct=1",
        f"--size={size}", "--time_based", f"--runtime={runtime_s}", "--output-format=json",
    ]  # fmt: skip
    job = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    job = job["jobs"][0]
    read, write = job["read"]["bw_bytes"] / 1e9, job["write"]["bw_bytes"] / 1e9
    return {"mode": mode, "block": block, "depth": depth, "read_gbps": read,
            "write_gbps": write, "total_gbps": read + write}  # fmt: skip


def probe_point(path: str, size: str, mode: str, block: str, depth: int, runtime_s: float) -> dict:
    """The same point with our own probe, on the file :func:`sweep` laid out."""
    got = disk_probe.probe(path, parse_size(size, "--size"), parse_size(block + "iB", "--blocks"),
                           depth, mode, runtime_s)  # fmt: skip
    return {"mode": mode, "block": block, "depth": depth, "read_gbps": got.read_gbps,
            "write_gbps": got.write_gbps, "total_gbps": got.total_gbps}  # fmt: skip


def sweep(directory: str, size: str, runtime_s: float, blocks: list[str], depths: list[int],
          modes: list[str], engine: str = "auto", repeats: int = 1) -> dict[str, Any]:  # fmt: skip
    """Every point of ``blocks x depths x modes`` and the best of each mode.

    Args:
      engine: ``"fio"``, ``"probe"``, or ``"auto"`` (fio where it is installed).
      repeats: passes over every point; a point's figure is the median of its passes. The
        passes are interleaved, so a drift of the disk's speed spreads over all points.
    """
    if engine == "auto":
        engine = "fio" if shutil.which("fio") else "probe"
    if engine == "fio" and shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install fio), or use --engine probe")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "disk-limit.dat")
    point = fio_point if engine == "fio" else probe_point
    grid = [(mode, block, depth) for mode in modes for block in blocks for depth in depths]
    runs: dict[tuple[str, str, int], list[dict]] = {key: [] for key in grid}
    try:
        if engine == "probe":
            disk_probe.lay_out(path, parse_size(size, "--size"))
        for r in range(repeats):
            for mode, block, depth in grid:
                p = point(path, size, mode, block, depth, runtime_s)
                logger.info("pass %d: %-5s %4s x %2d: %.2f GB/s", r, mode, block, depth,
                            p["total_gbps"])  # fmt: skip
                runs[(mode, block, depth)].append(p)
    finally:
        if os.path.exists(path):
            os.remove(path)
    points = []
    for key in grid:
        ranked = sorted(runs[key], key=lambda p: p["total_gbps"])
        median = ranked[len(ranked) // 2]  # an odd count: the middle pass itself
        points.append({**median, "runs_gbps": [p["total_gbps"] for p in runs[key]]})
    best = {m: max((p for p in points if p["mode"] == m), key=lambda p: p["total_gbps"])
            for m in modes}  # fmt: skip
    return {"engine": engine, "filesystem": filesystem(directory), "file_size": size,
            "runtime_s": runtime_s, "repeats": repeats, "points": points, "best": best,
            "limit_gbps": best["mixed"]["total_gbps"] if "mixed" in best else None}  # fmt: skip


def table(result: dict[str, Any], modes: list[str], blocks: list[str], depths: list[int]) -> str:
    """GB/s per request size (rows) and depth (columns), one table per mode."""
    lines = []
    for mode in modes:
        lines += [f"{mode} (GB/s, reads + writes)", "",
                  "| request | " + " | ".join(f"QD{d}" for d in depths) + " |",
                  "|---|" + "---:|" * len(depths)]  # fmt: skip
        for block in blocks:
            got = {p["depth"]: p["total_gbps"] for p in result["points"]
                   if p["mode"] == mode and p["block"] == block}  # fmt: skip
            lines.append(f"| {block} | " + " | ".join(f"{got[d]:.2f}" for d in depths) + " |")
        b = result["best"][mode]
        lines += ["", f"best {mode}: {b['total_gbps']:.2f} GB/s at {b['block']} x QD{b['depth']}",
                  ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="runs/disk-limit", help="on the tier's file system")
    parser.add_argument("--size", default="4GiB", help="the file read and written")
    parser.add_argument("--runtime", type=int, default=5, help="seconds per point")
    parser.add_argument("--blocks", default=",".join(BLOCKS))
    parser.add_argument("--depths", default=",".join(str(d) for d in DEPTHS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--engine", choices=("auto", "fio", "probe"), default="auto")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved passes; each point's figure is their median")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    blocks, modes = args.blocks.split(","), args.modes.split(",")
    depths = [int(d) for d in args.depths.split(",")]
    t0 = time.perf_counter()
    result = sweep(args.dir, args.size, args.runtime, blocks, depths, modes, args.engine,
                   args.repeats)  # fmt: skip
    result["wall_s"] = time.perf_counter() - t0
    print(table(result, modes, blocks, depths))
    if result["limit_gbps"] is not None:
        print(f"limit (best mixed): {result['limit_gbps']:.2f} GB/s")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
