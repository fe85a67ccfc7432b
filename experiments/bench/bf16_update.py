"""How often the bf16 update lands off bf16(master), by how much, and whether it accumulates.

For bf16 params ``jax_mlpo.adamw`` returns the update in bf16, ``bf16(master_new) - p``
(Sterbenz: exact wherever the new and old values are within 2x). This runs ``--steps`` jitted
train steps of ``--params-mi`` Mi bf16 params whose gradients depend on the params
(``cos(p)`` times per-step noise, so a different param would change later steps) and, after
each, compares ``apply_updates(p, u)`` with ``bf16(master_new)`` read from the engine: the
fraction of elements that differ and the largest difference in bf16 ulps of
``bf16(master_new)`` and in ulps of the update. If differences accumulated, the fraction and
the distance would grow with the steps; the next update is computed from the params as they
are, so each step's difference is that step's rounding alone.

    python -m experiments.bench.bf16_update --params-mi 120 --steps 30 \
        --json experiments/results/bf16_update.json
"""

from __future__ import annotations

import argparse
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_mlpo
from experiments.bench.harness import write_json

logger = logging.getLogger("bench.bf16_update")
LEAF = 16 * 2**20


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """One bfloat16 ulp at |x| (2**(exponent - 7)), the smallest normal's below it (float64)."""
    x = np.maximum(np.abs(x.astype(np.float64)), 2.0**-126)
    return np.exp2(np.floor(np.log2(x)) - 7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-mi", type=int, default=120)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    n = args.params_mi * 2**20
    sizes = [LEAF] * (n // LEAF) + ([n % LEAF] if n % LEAF else [])
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes))
    params = {
        f"w{i:02d}": (0.02 * jax.random.normal(k, (s,))).astype(jnp.bfloat16)
        for i, (k, s) in enumerate(zip(keys, sizes, strict=True))
    }
    # all state in host memory: state_dict is then a gather, and the figures are the same
    config = jax_mlpo.OffloadConfig(host_cache=12 * n + 2**26, subgroup_size=LEAF // 4)
    tx = jax_mlpo.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 5, args.steps),
                        weight_decay=0.1, offload=config)  # fmt: skip
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)

    @jax.jit
    def step(p, state, i):
        def grad(x, leaf):
            noise = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(leaf), i), x.shape)
            return (jnp.cos(x.astype(jnp.float32) * 50.0) * noise).astype(jnp.bfloat16)

        grads = {k: grad(x, j) for j, (k, x) in enumerate(sorted(p.items()))}
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, updates

    rows = []
    for i in range(args.steps):
        params, state, updates = jax.block_until_ready(step(params, state, i))
        masters = engine.state_dict()["master"]  # the update has run: its count is ready
        differ = total = 0
        worst_ulps = worst_update_ulps = 0.0
        for k, (name, p) in enumerate(sorted(params.items())):
            want = masters[k].astype(jnp.bfloat16).astype(np.float32)
            got = np.asarray(p).astype(np.float32)
            u = np.asarray(updates[name]).astype(np.float32)
            off = got != want
            differ += int(off.sum())
            total += got.size
            if off.any():
                dist = np.abs(got.astype(np.float64) - want)[off]
                worst_ulps = max(worst_ulps, float(np.max(dist / bf16_ulp(want[off]))))
                worst_update_ulps = max(worst_update_ulps,
                                        float(np.max(dist / bf16_ulp(u[off]))))  # fmt: skip
        rows.append({
            "step": i + 1, "fraction_differ": differ / total, "elements_differ": differ,
            "max_ulps_of_master": worst_ulps, "max_ulps_of_update": worst_update_ulps,
        })  # fmt: skip
        logger.info(
            "step %2d: %.2e of elements differ (%d), max %.2f ulp of bf16(master), %.2f ulp of "
            "the update", i + 1, differ / total, differ, worst_ulps, worst_update_ulps,
        )  # fmt: skip
    jax_mlpo.close(state)
    summary = {
        "params": n,
        "steps": args.steps,
        "fraction_differ_max": max(r["fraction_differ"] for r in rows),
        "fraction_differ_last": rows[-1]["fraction_differ"],
        "max_ulps_of_master": max(r["max_ulps_of_master"] for r in rows),
        "max_ulps_of_update": max(r["max_ulps_of_update"] for r in rows),
    }
    print(summary)
    if args.json:
        write_json(args.json, {"summary": summary, "steps": rows})


if __name__ == "__main__":
    main()
