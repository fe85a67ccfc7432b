"""The object-store tier on a local S3 server: its throughput in the update, and what it adds.

Two questions, on one moto_server (127.0.0.1) and one disk, systems interleaved per round:

1. **Tier against raw tensorstore.** ``raw kvstore``: the PUTs and then the GETs of as many
   blob-sized values as the update moves, all issued at once (``request_concurrency`` HTTP
   requests in flight), straight through tensorstore's ``s3`` driver. ``s3 tier``: the update
   with all state on the object tier; its bytes read + written over the update's time, and
   per direction over the time that direction had a request in flight (from the tier's
   trace). The pipeline keeps only ``prefetch_depth`` reads ahead per tier, so it has fewer
   requests in flight than the raw figure's; and its reads share the server with its
   write-backs, so the fair limit is ``raw mixed``: the GETs and PUTs issued together.
2. **A second path.** ``disk``: the update with the state on one disk tier; ``disk + s3``: the
   same plus the object tier, with the measured placement (the probe sees how slow it is).

    python -m experiments.bench.mlpo.object_tier --state 256MiB --cache 64MiB --rounds 3 \\
        --json experiments/results/object_tier.json
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

import jax_mlpo
from experiments.bench.harness import format_spread, interleave, spread, write_json
from jax_mlpo.config import parse_size
from jax_mlpo.testing.s3_server import S3Server, dummy_credentials

logger = logging.getLogger("bench.object_tier")
SYSTEMS = ("raw kvstore", "s3 tier", "disk", "disk + s3")


def busy_span(trace: list, direction: str) -> float:
    """Seconds during which at least one request of ``direction`` was in flight."""
    spans = sorted((t0, t1) for kind, _, t0, t1 in trace if kind == direction)
    total, end = 0.0, -1.0
    for t0, t1 in spans:
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


class Offloaded:
    """An optimizer over ``tiers``; ``step()`` times one update with its drain."""

    def __init__(self, tiers, args, params, grads) -> None:
        config = jax_mlpo.OffloadConfig(
            host_cache=args.cache_bytes, tiers=tiers, subgroup_size=args.subgroup,
            prefetch_depth=args.prefetch_depth,
        )  # fmt: skip
        self.tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)
        self.state = self.tx.init(params)
        self.engine = jax_mlpo.engine_of(self.state)
        self.update = jax.jit(self.tx.update)
        self.params, self.grads = params, grads
        for _ in range(args.warmup):  # compilation, the first reads, a re-plan after 3 steps
            self.step()

    def step(self) -> dict:
        for store in self.engine.tiers:
            store.trace = []
        t0 = time.perf_counter()
        updates, self.state = self.update(self.grads, self.state, self.params)
        jax.block_until_ready(updates)
        self.engine.drain()
        out = {"update_s": time.perf_counter() - t0}
        m = self.engine.metrics[-1]
        for store in self.engine.tiers:
            path = store.tier.path
            name = "s3" if path.startswith("s3://") else "disk"
            out[f"{name}_read_B"] = m.bytes_read[path]
            out[f"{name}_write_B"] = m.bytes_written[path]
            out[f"{name}_read_busy_s"] = busy_span(store.trace, "read")
            out[f"{name}_write_busy_s"] = busy_span(store.trace, "write")
            out[f"{name}_subgroups"] = self.engine.tier_of.count(self.engine.tiers.index(store))
        return out

    def close(self) -> None:
        jax_mlpo.close(self.state)


def raw_kvstore(server: S3Server, bucket: str, blob_bytes: int, count: int, concurrency: int):
    """PUT then GET ``count`` values of ``blob_bytes``, ``concurrency`` in flight."""
    kv = ts.KvStore.open(
        {"driver": "s3", "bucket": bucket, "path": "raw/", "endpoint": server.endpoint,
         "aws_region": "us-east-1", "aws_credentials": {"type": "environment"}},
        context=ts.Context({"s3_request_concurrency": {"limit": concurrency}}),
    ).result()  # fmt: skip
    value = np.random.default_rng(0).integers(0, 255, blob_bytes, np.uint8).tobytes()
    t0 = time.perf_counter()
    for f in [kv.write(f"v{i}", value) for i in range(count)]:
        f.result()
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for f in [kv.read(f"v{i}") for i in range(count)]:
        assert len(f.result().value) == blob_bytes
    get_s = time.perf_counter() - t0
    # GETs and PUTs at once, as the update's reads and write-backs overlap
    t0 = time.perf_counter()
    mixed = [kv.read(f"v{i}") for i in range(count)] + [
        kv.write(f"w{i}", value) for i in range(count)
    ]
    for f in mixed:
        f.result()
    mixed_s = time.perf_counter() - t0
    return {"put_s": put_s, "get_s": get_s, "mixed_s": mixed_s, "bytes": blob_bytes * count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", default="256MiB", help="optimizer state (fp32 m, v)")
    parser.add_argument("--cache", default="64MiB", help="host cache of every system")
    parser.add_argument("--subgroup", type=int, default=1 << 20)
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=4, help="steps before the rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/jax_mlpo-object-bench", help="the disk tier")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.cache_bytes = parse_size(args.cache, "--cache")
    n = parse_size(args.state, "--state") // 8
    params = {"w": jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)}
    grads = {"w": jnp.full((n,), 1e-3, jnp.float32)}
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    with dummy_credentials():
        server = S3Server().start()
        try:
            bucket = server.bucket()

            def s3(prefix: str) -> jax_mlpo.ObjectTier:
                return jax_mlpo.ObjectTier(
                    f"s3://{bucket}/{prefix}/", endpoint=server.endpoint, region="us-east-1"
                )

            def disk(name: str) -> jax_mlpo.FileTier:
                return jax_mlpo.FileTier(os.path.join(args.dir, name))

            opts = {
                "s3 tier": Offloaded([s3("alone")], args, params, grads),
                "disk": Offloaded([disk("alone")], args, params, grads),
                "disk + s3": Offloaded([disk("pair"), s3("pair")], args, params, grads),
            }
            blob = 8 * args.subgroup
            moved = opts["s3 tier"].step()
            count = max(1, moved["s3_read_B"] // blob)

            def run(system: str, rnd: int) -> dict:
                if system == "raw kvstore":
                    return raw_kvstore(server, bucket, blob, count, s3("x").request_concurrency)
                return opts[system].step()

            results = interleave(SYSTEMS, args.rounds, run, rotate=True)
            for o in opts.values():
                o.close()
        finally:
            server.kill()
            shutil.rmtree(args.dir, ignore_errors=True)

    raw = results["raw kvstore"]
    tier = results["s3 tier"]
    moved = [(r["s3_read_B"] + r["s3_write_B"]) / r["update_s"] for r in tier]
    raw_mixed = [2 * r["bytes"] / r["mixed_s"] for r in raw]
    summary = {
        "raw_put_gbps": spread(r["bytes"] / r["put_s"] / 1e9 for r in raw),
        "raw_get_gbps": spread(r["bytes"] / r["get_s"] / 1e9 for r in raw),
        "raw_mixed_gbps": spread(x / 1e9 for x in raw_mixed),
        "tier_moved_over_raw_mixed": spread(a / b for a, b in zip(moved, raw_mixed, strict=True)),
        "tier_write_gbps": spread(r["s3_write_B"] / r["s3_write_busy_s"] / 1e9 for r in tier),
        "tier_read_gbps": spread(r["s3_read_B"] / r["s3_read_busy_s"] / 1e9 for r in tier),
        "tier_moved_over_update_gbps": spread(x / 1e9 for x in moved),
        "update_s": {s: spread(r["update_s"] for r in results[s]) for s in opts},
        "disk_plus_s3_subgroups": {
            "disk": results["disk + s3"][0]["disk_subgroups"],
            "s3": results["disk + s3"][0]["s3_subgroups"],
        },
        "speedup_disk_plus_s3_over_disk": spread(
            a["update_s"] / b["update_s"]
            for a, b in zip(results["disk"], results["disk + s3"], strict=True)
        ),
    }
    print(f"state {args.state}, cache {args.cache}, subgroup {args.subgroup}, "
          f"{args.rounds} rounds (median [min-max])")  # fmt: skip
    for key in ("raw_put_gbps", "raw_get_gbps", "raw_mixed_gbps", "tier_write_gbps",
                "tier_read_gbps", "tier_moved_over_update_gbps", "tier_moved_over_raw_mixed",
                "speedup_disk_plus_s3_over_disk"):  # fmt: skip
        print(f"{key:<32} {format_spread(summary[key])}")
    for system, s in summary["update_s"].items():
        print(f"update_s {system:<23} {format_spread(s)}")
    print(f"disk + s3 placement (subgroups)  {summary['disk_plus_s3_subgroups']}")
    write_json(args.json, {"args": vars(args), "results": results, "summary": summary})


if __name__ == "__main__":
    main()
