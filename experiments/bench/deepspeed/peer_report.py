"""The update-phase comparison's table: rows per system, ratios, and the printed report.

Split from :mod:`experiments.bench.deepspeed.deepspeed_peer`, which runs the systems; this
module only turns their runs and the rounds' disk figures into the table.
"""

from __future__ import annotations

import json
import statistics

from experiments.bench.harness import format_spread, medians, ratio_spread, spread

LABELS = {
    "ds-partitioned": "deepspeed partitioned",
    "ds-pipelined": "deepspeed pipelined",
    "jax-baseline": "jax_mlpo baseline",
    "jax-all-2dirs": "jax_mlpo all (2 dirs)",
    "jax-all-1dir": "jax_mlpo all (1 dir)",
    "jax-bf16-moments": "jax_mlpo all (1 dir), bf16 m and v",
    "jax-q8-moments": "jax_mlpo all (1 dir), q8 m and v",
    "jax-all-1dir-threads": "jax_mlpo all (1 dir), threads",
}


def summarize(runs: dict[str, list[dict]], limits: dict) -> tuple[dict, dict]:
    """``(rows, ratios)``: per system, medians [min-max] over the rounds, and the speedups."""
    rows = {}
    for system, outs in runs.items():
        row = {"label": LABELS[system]}
        for key in ("update_s", "engine_s", "grad_write_s", "adam_s", "compute_s", "read_wait_s"):
            if key in outs[0]:
                row[key] = spread(o[key] for o in outs)
        steps = [s for o in outs for s in o["steps"]]
        per_step = medians(steps, ("bytes_read", "bytes_written", "cache_hits"))
        row["bytes_read_per_step"] = per_step["bytes_read"]
        row["bytes_written_per_step"] = per_step["bytes_written"]
        if "cache_hits" in steps[0]:
            row["cache_hits"] = per_step["cache_hits"]
        for key in (
            "subgroups",
            "pinned_bytes",
            "host_cache",
            "disk_bytes",
            "files",
            "subgroups_per_tier",
            "retained",
            "dtype",
            "deepspeed",
            "torch",
        ):
            if key in outs[0]:
                row[key] = outs[0][key]
        rows[system] = row

    # tier_efficiency: the time the disk needs at fio's rates of the same round for the bytes a
    # step moved, over the time the step's tier(s) were busy (DeepSpeed: update + grad write)
    for system, outs in runs.items():
        per_round = []
        for o in outs:
            disk = limits["disk"][o["round"]]
            if "error" in disk:
                continue
            effs = []
            for st in o["steps"]:
                if system.startswith("ds-"):
                    busy = st["update_s"] + st.get("grad_write_s", 0.0)
                    read, written = st["bytes_read"], st["bytes_written"]
                else:
                    busy = max(st["tier_busy_s"].values())
                    read, written = st["tier_bytes_read"], st["tier_bytes_written"]
                need = read / (disk["read_gbps"] * 1e9) + written / (disk["write_gbps"] * 1e9)
                effs.append(need / busy if busy > 0 else float("nan"))
            per_round.append(statistics.median(effs))
        if per_round:
            rows[system]["tier_efficiency"] = spread(per_round)

    # the disk throughput of a step (bytes read + written / the step's time: DeepSpeed's
    # optimizer step, jax_mlpo's whole jitted update) against the round's mixed limit, sustained
    # (10 s) and over a burst as long as a step
    for system, outs in runs.items():
        gbps = [
            statistics.median(_step_bytes(system, st) / st["update_s"] for st in o["steps"]) / 1e9
            for o in outs
        ]
        rows[system]["disk_gbps"] = spread(gbps)
        for kind, key in (("mixed", "of_mixed_limit"), ("mixed_burst", "of_burst_limit")):
            per_round = limits.get(kind, [])  # results without a burst figure have none
            of_limit = [
                moved / limit
                for moved, o in zip(gbps, outs, strict=True)
                if per_round and (limit := per_round[o["round"]].get("mixed_gbps"))
            ]
            if of_limit:
                rows[system][key] = spread(of_limit)

    ratios = {}
    for narrow in ("bf16", "q8"):  # the same system, narrower state
        if f"jax-{narrow}-moments" in runs and "jax-all-1dir" in runs:
            ratios[f"{narrow}_moments_speedup_full"] = ratio_spread(
                [a["update_s"] for a in runs["jax-all-1dir"]],
                [b["update_s"] for b in runs[f"jax-{narrow}-moments"]],
            )

    def ratio(name: str, num: str, num_key: str, den: str, den_key: str, add_grad=False):
        if num not in runs or den not in runs:
            return
        tops = [a[num_key] + (a["grad_write_s"] if add_grad else 0.0) for a in runs[num]]
        ratios[name] = ratio_spread(tops, [b[den_key] for b in runs[den]])

    for jax_sys, tag in (
        ("jax-all-2dirs", ""),
        ("jax-all-1dir", "_1dir"),
        ("jax-all-1dir-threads", "_1dir_threads"),
        ("jax-baseline", "_baseline"),
        ("jax-bf16-moments", "_bf16_moments"),
        ("jax-q8-moments", "_q8_moments"),
    ):
        ratio(
            f"speedup_vs_deepspeed_pipelined{tag}_host",
            "ds-pipelined",
            "update_s",
            jax_sys,
            "engine_s",
        )
        ratio(
            f"speedup_vs_deepspeed_pipelined{tag}_full",
            "ds-pipelined",
            "update_s",
            jax_sys,
            "update_s",
        )
        ratio(
            f"speedup_vs_deepspeed_pipelined{tag}_host_with_grad_write",
            "ds-pipelined",
            "update_s",
            jax_sys,
            "engine_s",
            add_grad=True,
        )
        ratio(
            f"speedup_vs_deepspeed_pipelined{tag}_full_with_grad_write",
            "ds-pipelined",
            "update_s",
            jax_sys,
            "update_s",
            add_grad=True,
        )
        ratio(
            f"speedup_vs_deepspeed_partitioned{tag}_host",
            "ds-partitioned",
            "update_s",
            jax_sys,
            "engine_s",
        )
    ratio(
        "deepspeed_partitioned_over_pipelined",
        "ds-partitioned",
        "update_s",
        "ds-pipelined",
        "update_s",
    )

    return rows, ratios


def print_report(rows: dict, ratios: dict, limits: dict, args) -> None:
    """Prints the table, the disk's figures and the ratios."""
    print(
        f"\nstate: {args.elems} fp32 params ({args.state} of m, v; p, m, v on disk = "
        f"{12 * args.elems / 2**30:.2f} GiB), subgroup {args.subgroup} elements, pinned host "
        f"budget {args.cache_bytes / 2**20:.0f} MiB, {args.rounds} interleaved rounds x "
        f"{args.steps} steps; medians over rounds [min-max]"
    )
    print(
        f"{'system':<26}{'update s (host)':>22}{'tx.update s':>20}{'grad write s':>20}"
        f"{'read GB':>9}{'write GB':>9}"
    )
    for row in rows.values():
        host = row.get("engine_s", row["update_s"])
        full = row["update_s"] if "engine_s" in row else None
        grad = row["grad_write_s"]
        print(
            f"{row['label']:<26}{format_spread(host):>22}{format_spread(full):>20}"
            f"{format_spread(grad):>20}"
            f"{row['bytes_read_per_step'] / 1e9:>9.2f}{row['bytes_written_per_step'] / 1e9:>9.2f}"
        )
    print("disk (fio O_DIRECT 1 MiB QD8):", json.dumps(limits["disk_summary"]))
    mixed = [d["mixed_gbps"] for d in limits["mixed"] if "mixed_gbps" in d]
    if mixed:
        print(
            f"mixed limit (fio 50/50 randrw, {args.limit_block} x {args.limit_depth}): "
            f"{format_spread(spread(mixed))} GB/s"
        )
    burst = [d["mixed_gbps"] for d in limits.get("mixed_burst", []) if "mixed_gbps" in d]
    if burst:
        print(f"the same over {args.burst_runtime} s: {format_spread(spread(burst))} GB/s")
    for row in rows.values():
        print(
            f"disk GB/s during the step {row['label']}: {format_spread(row['disk_gbps'])}"
            + (f", of the mixed limit {format_spread(row['of_mixed_limit'])}"
               if "of_mixed_limit" in row else "")
            + (f", of its burst figure {format_spread(row['of_burst_limit'])}"
               if "of_burst_limit" in row else "")
        )  # fmt: skip
    for row in rows.values():
        if "tier_efficiency" in row:
            print(f"tier_efficiency {row['label']}: {format_spread(row['tier_efficiency'])}")
    print("memory:", json.dumps(limits["memory_start"]), json.dumps(limits["memory_end"]))
    for k, v in ratios.items():
        print(f"{k} = {format_spread(v)}")


def _step_bytes(system: str, step: dict) -> int:
    """Bytes a step moved to and from the disk: the tiers' own count for jax_mlpo, the
    process's I/O during its optimizer step for DeepSpeed (its swapper's reads and writes; the
    gradients its backward swapped out before the step are timed apart, ``grad_write_s``, and
    so are not counted against the step's time)."""
    if system.startswith("ds-"):
        return step["step_bytes_read"] + step["step_bytes_written"]
    return step["tier_bytes_read"] + step["tier_bytes_written"]
