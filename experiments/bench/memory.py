"""Peak RSS of a jitted, donated bf16 train step: no optimizer, optax in memory, jax_mlpo on disk.

Each (system, size) runs in a fresh process, so each peak (``ru_maxrss``; ``VmHWM`` beside it) is
that system's alone. The params are bf16 leaves of 16Mi elements; the loss is elementwise
(``sum(sin(p))``), so the gradient is a bf16 intermediate of the params' size, as a model's
backward pass gives it, and nothing else of that size. The step is jitted with the params (and
optax's state) donated:

* ``none``: ``p - 1e-3 * g``: params + gradients, the floor any optimizer sits on;
* ``optax``: ``optax.adamw`` on an fp32 master copy in memory (master, m, v: 12 B/param), the
  bf16 params its rounding, as mixed-precision training keeps them;
* ``jax_mlpo``: ``jax_mlpo.adamw``, all state on a disk tier, ``--cache`` of host cache;
* ``jax_mlpo_q8``: the same with q8 m and v (``mu_dtype="q8"``, ``nu_dtype="q8"``);
* ``jax_mlpo_accum4``: ``jax_mlpo.MultiSteps(jax_mlpo.adamw(...), every_k_schedule=4)``, four
  micro-steps per step: the bf16 accumulator on top of params + gradients (its floor is
  6 B/param), the host update on every fourth micro-step.
* ``jax_mlpo_overlap``: ``jax_mlpo.adamw`` in ``jax_mlpo.overlapped_step``: the update of the
  gradients carried from the last step beside this step's forward pass; params, state and the
  carried gradients donated (the update is written over the carried gradients, and the new
  gradients take their buffer).

Then a least-squares line per system over the sizes: its slope (bytes per param) and intercept.
The targets: jax_mlpo's slope <= 4.5 B/param (params + gradients and nothing else of the
model's size) and its intercept within host_cache + 256 MiB of the no-optimizer intercept;
under ``MultiSteps`` the slope <= 6.5 B/param (the accumulator's 2 more) with the same
intercept.

    python -m experiments.bench.memory --sizes-mi 128,256,512 --cache 512MiB \
        --json experiments/results/memory.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

from experiments.job.host_memory import peak_rss_bytes, process_memory

logger = logging.getLogger("bench.memory")

LEAF = 16 * 2**20  # elements per param leaf
SYSTEMS = ("none", "optax", "jax_mlpo", "jax_mlpo_q8", "jax_mlpo_accum4", "jax_mlpo_overlap")
MICRO_STEPS = {"jax_mlpo_accum4": 4}  # micro-steps per step, per system (1 where absent)


def child(system: str, params_mi: int, cache: str, tier: str, steps: int) -> dict:
    """One system's train steps at one size, in this process; returns its figures."""
    import jax
    import jax.numpy as jnp
    import optax

    import jax_mlpo

    jax.block_until_ready(jnp.zeros(8) + 1)  # the runtime's own memory is in the baseline
    rss_start = process_memory()["rss_bytes"]
    n = params_mi * 2**20
    sizes = [LEAF] * (n // LEAF) + ([n % LEAF] if n % LEAF else [])
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes))
    make = jax.jit(lambda k, size: jax.random.normal(k, (size,), jnp.bfloat16), static_argnums=1)
    params = {f"w{i:03d}": make(k, s) for i, (k, s) in enumerate(zip(keys, sizes, strict=True))}

    def grads_of(p, step):
        # cos(p) * scale: elementwise in the params, so the gradient is XLA's intermediate of
        # the params' size and dtype, and nothing else of that size is needed to compute it
        scale = 1.0 + 1e-3 * step

        def loss(p):
            return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(p))

        return jax.tree.map(lambda g: g * jnp.asarray(scale, g.dtype), jax.grad(loss)(p))

    # Python's allocations from here on (numpy arrays included; the pool's page-aligned buffers
    # and XLA's are not): what the optimizer allocates of its own beside its pool
    tracemalloc.start()
    if system == "none":
        state = None

        @functools.partial(jax.jit, donate_argnums=(0,))
        def step(p, state, i):
            g = grads_of(p, i)
            return jax.tree.map(lambda x, y: x - 1e-3 * y, p, g), state

    elif system == "optax":
        tx = optax.adamw(1e-3, weight_decay=0.1)
        master = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.float32), p))(params)
        state = (master, tx.init(master))

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p, state, i):
            master, opt_state = state
            g = jax.tree.map(lambda x: x.astype(jnp.float32), grads_of(p, i))
            updates, opt_state = tx.update(g, opt_state, master)
            master = optax.apply_updates(master, updates)
            return jax.tree.map(lambda x: x.astype(jnp.bfloat16), master), (master, opt_state)

    elif system == "jax_mlpo_overlap":
        config = jax_mlpo.OffloadConfig(host_cache=cache, tiers=[tier], subgroup_size=LEAF // 4)
        tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)

        def scaled_loss(p, i):  # grads_of's gradient
            total = sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(p))
            return total * (1.0 + 1e-3 * i)

        state = (tx.init(params), jax.jit(grads_of)(params, 0))

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p, state, i):
            opt_state, pending = state
            p, opt_state, pending, _ = jax_mlpo.overlapped_step(
                scaled_loss, tx, p, opt_state, pending, i, groups=8
            )
            return p, (opt_state, pending)

    else:
        config = jax_mlpo.OffloadConfig(host_cache=cache, tiers=[tier], subgroup_size=LEAF // 4)
        moments = dict(mu_dtype="q8", nu_dtype="q8") if system == "jax_mlpo_q8" else {}
        tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config, **moments)
        if system in MICRO_STEPS:  # the accumulator in the params' dtype (bf16)
            tx = jax_mlpo.MultiSteps(tx, every_k_schedule=MICRO_STEPS[system])
        state = tx.init(params)

        # params and optimizer state donated, as nnx.jit(donate_argnames=("model",
        # "optimizer")) and a TrainState step do (the state is two scalars, or MultiSteps's
        # accumulator of the params' size)
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p, state, i):
            updates, state = tx.update(grads_of(p, i), state, p)
            return optax.apply_updates(p, updates), state

    times = []
    for i in range(steps * MICRO_STEPS.get(system, 1)):
        t0 = time.perf_counter()
        params, state = step(params, state, i)
        jax.block_until_ready((params, state))
        times.append(time.perf_counter() - t0)
    engine_host = None
    if system.startswith("jax_mlpo"):
        engine = jax_mlpo.engine_of(state[0] if system == "jax_mlpo_overlap" else state)
        engine_host = engine.host_bytes
        jax_mlpo.close(state[0] if system == "jax_mlpo_overlap" else state)
    _, traced_peak = tracemalloc.get_traced_memory()
    return {
        "system": system, "params": n, "rss_start": rss_start, "peak_rss": peak_rss_bytes(),
        "vm_hwm": process_memory()["peak_rss_bytes"], "traced_peak": traced_peak,
        "engine_host_bytes": engine_host, "step_s": times,
    }  # fmt: skip


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept of ``(x, y)`` points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx


def run_child(system: str, params_mi: int, cache: str, tier: str, steps: int) -> dict:
    cmd = [sys.executable, "-m", "experiments.bench.memory", "--child", system,
           "--params-mi", str(params_mi), "--cache", cache, "--tier", tier,
           "--steps", str(steps)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mi", default="128,256,512", help="params per run, in Mi")
    parser.add_argument("--cache", default="512MiB", help="jax_mlpo's host cache")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tier", default=None, help="directory for the disk tier (a temp dir)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--params-mi", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.params_mi, args.cache, args.tier, args.steps)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from jax_mlpo.tiers.settings import parse_size

    sizes = [int(s) for s in args.sizes_mi.split(",")]
    systems = args.systems.split(",")
    root = args.tier or tempfile.mkdtemp(prefix="jax_mlpo-memory-")
    rows = []
    try:
        for mi in sizes:
            for system in systems:
                tier = os.path.join(root, f"{system}-{mi}")
                row = run_child(system, mi, args.cache, tier, args.steps)
                shutil.rmtree(tier, ignore_errors=True)
                rows.append(row)
                if args.json:
                    from experiments.bench.harness import write_json

                    write_json(args.json, {"rows": rows, "partial": True})
                logger.info(
                    "%-11s %4d Mi params: peak RSS %.2f GiB (%.2f B/param), Python allocs %.0f MiB",
                    system, mi, row["peak_rss"] / 2**30, row["peak_rss"] / row["params"],
                    row["traced_peak"] / 2**20,
                )  # fmt: skip
    finally:
        if args.tier is None:
            shutil.rmtree(root, ignore_errors=True)
    lines = {
        s: fit([(r["params"], r["peak_rss"]) for r in rows if r["system"] == s]) for s in systems
    }
    cache = parse_size(args.cache, "--cache")
    print(f"\n{'system':<11} " + " ".join(f"{m:>5d}Mi" for m in sizes) + "   slope B/param  "
          "intercept GiB")  # fmt: skip
    for s in systems:
        peaks = [r["peak_rss"] / 2**30 for r in rows if r["system"] == s]
        slope, icpt = lines[s]
        print(f"{s:<11} " + " ".join(f"{p:6.2f}G" for p in peaks)
              + f"   {slope:13.2f}  {icpt / 2**30:13.2f}")  # fmt: skip
    verdict = {}
    for system, target in (("jax_mlpo", 4.5), ("jax_mlpo_accum4", 6.5), ("jax_mlpo_overlap", 4.5)):
        if system not in lines or "none" not in lines:
            continue
        slope, icpt = lines[system]
        over = icpt - lines["none"][1]
        verdict[system] = {
            "slope_B_per_param": slope,
            "intercept_over_none_bytes": over,
            "slope_ok": slope <= target,
            "intercept_ok": over <= cache + 256 * 2**20,
        }
        print(f"\n{system}: slope {slope:.2f} B/param (target <= {target}), intercept "
              f"{over / 2**20:+.0f} MiB over no optimizer (target <= host_cache + 256 MiB = "
              f"{(cache + 256 * 2**20) / 2**20:.0f} MiB)")  # fmt: skip
    if args.json:
        from experiments.bench.harness import write_json

        write_json(args.json, {"rows": rows, "fits": lines, "cache": cache, "targets": verdict})


if __name__ == "__main__":
    main()
