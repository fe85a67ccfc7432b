"""The proof run: experiments/configs/beyond-ram.yaml, with the disk's mixed limit measured in
the same run and the figures docs/beyond-ram.md reports.

1. fio on the tier's file system, 50/50 random reads and writes at once (O_DIRECT, libaio),
   at 1 and 8 MiB requests, 8 and 32 in flight: the best combined bandwidth is the limit;
2. ``pretrain.py --config experiments/configs/beyond-ram.yaml`` (a subprocess: its own peak
   RSS), then ``--optimizer optax`` on the same config, which its memory plan must refuse;
3. fio again (the disk drifts); the tier files are deleted.

Then per measured step: the update's tier bytes (read + written) over the host update's time,
against the limit; peak RSS against MemTotal and against the memory plan; the state on disk
against MemTotal.

    python -m experiments.bench.beyond_ram --json experiments/results/beyond_ram.json
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from experiments.bench.harness import write_json
from experiments.bench.sysio import filesystem, fio_mixed
from experiments.job.dry_run import memory_plan
from experiments.job.host_memory import meminfo, training_memory
from experiments.job.run_config import load_config

logger = logging.getLogger("bench.beyond_ram")
CONFIG = "experiments/configs/beyond-ram.yaml"
FIO_POINTS = [("1M", 8), ("8M", 8), ("1M", 32), ("8M", 32)]


def disk_limit(directory: str, runtime_s: int) -> dict:
    """The best mixed read + write bandwidth over :data:`FIO_POINTS`."""
    points = [fio_mixed(directory, block=b, depth=d, runtime_s=runtime_s) for b, d in FIO_POINTS]
    best = max(points, key=lambda p: p.get("mixed_gbps", 0.0))
    return {"points": points, "limit_gbps": best.get("mixed_gbps"), "best": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--run-dir", default="runs/beyond-ram")
    parser.add_argument("--json", default=None)
    parser.add_argument("--keep-tiers", action="store_true", help="leave the tier files")
    parser.add_argument("--fio-runtime", type=int, default=10, help="seconds per fio point")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more config overrides (e.g. a smaller model to try the driver)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    run_dir = Path(args.run_dir)
    tier_dir = run_dir / "tiers"
    tier_dir.mkdir(parents=True, exist_ok=True)
    before = disk_limit(str(tier_dir), args.fio_runtime)
    logger.info("disk mixed limit before: %.2f GB/s (%s)", before["limit_gbps"], before["best"])
    cmd = [sys.executable, "experiments/pretrain.py", "--config", CONFIG,
           "--set", f"run_dir={run_dir}", "--set", f"steps={args.steps}",
           "--set", f"offload.tiers=[{{path: {tier_dir / 't0'}}}]"]  # fmt: skip
    for override in args.set:
        cmd += ["--set", override]
    logger.info("running %s", " ".join(cmd))
    run = subprocess.run(cmd, capture_output=True, text=True)
    (run_dir / "pretrain.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise SystemExit(f"pretrain.py failed ({run.returncode}):\n{run.stderr[-4000:]}")
    optax_run = subprocess.run([*cmd, "--optimizer", "optax"], capture_output=True, text=True)
    refusal = (optax_run.stdout + optax_run.stderr).strip().splitlines()[-1:]
    if not args.keep_tiers:
        shutil.rmtree(tier_dir / "t0", ignore_errors=True)
    after = disk_limit(str(tier_dir), args.fio_runtime)
    logger.info("disk mixed limit after: %.2f GB/s", after["limit_gbps"])
    records = [json.loads(line) for line in (run_dir / "metrics-offload.jsonl").open()]
    skip = 2
    measured = records[skip:]
    limit = statistics.median([before["limit_gbps"], after["limit_gbps"]])
    rates = []
    for r in measured:
        moved = sum(t["read_bytes"] + t["write_bytes"] for t in r["tiers"].values())
        rates.append(moved / r["host_update_s"] / 1e9)
    total = meminfo("MemTotal")
    cfg = load_config(CONFIG, args.set)
    plan = training_memory(cfg, memory_plan(cfg, 1))
    out = {
        "filesystem": filesystem(str(tier_dir)),
        "mem_total": total,
        "fio_before": before,
        "fio_after": after,
        "limit_gbps": limit,
        "steps": len(records),
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in records),
        "update_gbps": statistics.median(rates),
        "update_gbps_per_step": rates,
        "update_vs_limit": statistics.median(rates) / limit,
        "step_s": statistics.median(r["step_s"] for r in measured),
        "fwd_bwd_s": statistics.median(r["fwd_bwd_s"] for r in measured),
        "update_s": statistics.median(r["update_s"] for r in measured),
        "host_update_s": statistics.median(r["host_update_s"] for r in measured),
        "state_bytes": plan.state_bytes,
        "state_vs_mem_total": plan.state_bytes / total,
        "planned_host_bytes": plan.host_total,
        "plan_vs_peak": plan.host_total / max(r["peak_rss_bytes"] for r in records),
        "optax_refusal": refusal,
        "optax_returncode": optax_run.returncode,
    }
    print(json.dumps({k: v for k, v in out.items() if "fio" not in k}, indent=1))
    print(f"peak RSS {out['peak_rss_bytes'] / total:.2f}x MemTotal; update moved its bytes at "
          f"{out['update_gbps']:.2f} GB/s = {out['update_vs_limit']:.2f}x the mixed limit "
          f"{limit:.2f} GB/s; memory plan {out['plan_vs_peak']:.3f}x the peak")  # fmt: skip
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
