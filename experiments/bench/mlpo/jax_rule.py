"""Host bandwidth of an update rule written in jax.numpy (jax_mlpo.extend), beside the built-in
AdamW kernel and the same rule in NumPy, on one segment of the same size, in one run.

The rule is experiments/optimizers/adabelief.py's AdaBelief (reads m, s, g; writes m, s, u:
6 x 4 bytes per element; AdamW's kernel moves 7 x 4). The ways a jax.numpy rule could run are
measured side by side:

- ``jax_rule``: what jax_mlpo.extend does (:mod:`jax_mlpo.optimizers.rule_program`): the
  rule's jaxpr as a tile program, one pass over the segment on the kernels' threads;
- ``jax_rule_xla``: the rule through XLA (what extend falls back to for a rule a tile program
  cannot run): chunks of ``--chunk`` elements, each one call of the jitted rule on a synchronous
  XLA:CPU client, its inputs taken by dlpack without a copy, its outputs copied into the state,
  the chunks spread over the kernels' threads;
- ``jax_whole_segment``: one XLA call over the whole segment, its fresh outputs then copied
  into the state;
- ``numpy``: the rule in NumPy (extend.ElementwiseOptimizer).

Every case runs interleaved, one warm-up each; a figure is the median of ``--repeats`` rounds,
and a ratio the median of its per-round ratios, with their min and max. Where each call's time
goes, and why the other ways a chunk could reach XLA lose, is
``experiments/bench/mlpo/jax_rule_costs.py``.

    python -m experiments.bench.mlpo.jax_rule --n 8388608 --repeats 7 --chunk 262144 \
        --json experiments/results/jax_rule.json
"""

from __future__ import annotations

import argparse
import os
import statistics
from types import SimpleNamespace

import jax
import numpy as np

from experiments.bench.harness import format_spread, ratio_spread, round_robin, write_json
from experiments.optimizers.adabelief import AdaBelief
from jax_mlpo import native
from jax_mlpo.optimizers.jax_rule import CHUNK, RuleRunner, _store, _view
from jax_mlpo.types import F32, AdamWHyper

ADAMW = AdamWHyper(bc1=0.19, bc2=0.002, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
HYPER = {"lr": 1e-3, "bc1": 0.19, "bc2": 0.002, "c1": 0.1, "c2": 0.001, "b1": 0.9,
         "b2": 0.999, "eps": 1e-16, "eps_root": 1e-16}  # fmt: skip
TARGETS = {"ratio_jax_rule_over_adamw": 0.6, "ratio_jax_rule_over_numpy": 5.0}


def aligned(n: int) -> np.ndarray:
    """float32[n] at a page boundary, as the engine's buffers are."""
    raw = np.empty(n + 1024, F32)
    start = (-raw.ctypes.data % 4096) // 4
    return raw[start : start + n]


def numpy_adabelief(m, s, g, u, h) -> None:
    """The same rule in NumPy, as an extend.ElementwiseOptimizer would write it."""
    f = {k: np.float32(v) for k, v in h.items()}
    m[...] = f["c1"] * g + f["b1"] * m
    s[...] = f["c2"] * np.square(g - m) + f["b2"] * s + f["eps_root"]
    u[...] = -f["lr"] * ((m / f["bc1"]) / (np.sqrt(s / f["bc2"]) + f["eps"]))


def cases(n: int, threads: int, chunk: int) -> dict:
    rng = np.random.default_rng(0)
    m, s, v, u, p, g = (aligned(n) for _ in range(6))
    for x in (m, s, v, u):
        x.fill(0.0)
    g[...] = rng.standard_normal(n, dtype=np.float32)
    p[...] = rng.standard_normal(n, dtype=np.float32)
    segment = [(SimpleNamespace(decay=False), (m, s), g, p, u, None)]
    rule = AdaBelief()
    tile = RuleRunner(rule.step, "adabelief", threads, chunk)
    xla = RuleRunner(rule.step, "adabelief", threads, chunk, tile=False)
    device = jax.devices("cpu")[0]

    @jax.jit
    def whole_program(m, s, g, hyper):
        (m, s), u = rule.step((m, s), g, None, hyper, decay=False)
        return m, s, u

    hyper32 = jax.device_put({k: np.float32(x) for k, x in HYPER.items()}, device)

    def whole_segment():
        views = [_view(x, device) for x in (m, s, g)]  # aligned: no copy
        outs = whole_program(*views, hyper32)
        for dst, out in zip((m, s, u), outs, strict=True):
            _store(dst, out)

    return {
        "adamw_gbps": (28, lambda: native.adamw_step(m, v, g, p, u, ADAMW)),
        "jax_rule_gbps": (24, lambda: tile.run(segment, HYPER)),
        "jax_rule_xla_gbps": (24, lambda: xla.run(segment, HYPER)),
        "jax_whole_segment_gbps": (24, whole_segment),
        "numpy_gbps": (24, lambda: numpy_adabelief(m, s, g, u, HYPER)),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=2**24, help="elements of the segment")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median)")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: all)")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="elements per XLA call")
    parser.add_argument("--json", type=str, default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    threads = native.set_num_threads(args.threads)
    load_before = os.getloadavg()
    table = cases(args.n, threads, args.chunk)
    times = round_robin({k: fn for k, (_, fn) in table.items()}, args.repeats)
    figures = {k: b * args.n / statistics.median(times[k]) / 1e9 for k, (b, _) in table.items()}
    # a round's ratio compares the cases under the same load: a time ratio, scaled by the bytes
    jax_key, spreads = "jax_rule_gbps", {}
    for other in ("adamw", "numpy"):
        scale = table[jax_key][0] / table[f"{other}_gbps"][0]
        per_round = ratio_spread(times[f"{other}_gbps"], times[jax_key])
        spreads[f"ratio_jax_rule_over_{other}"] = {k: v * scale for k, v in per_round.items()}
    figures |= {k: v["median"] for k, v in spreads.items()}
    print(f"n={args.n} chunk={args.chunk} threads={threads} load before {load_before[0]:.1f}, "
          f"after {os.getloadavg()[0]:.1f}")  # fmt: skip
    for key, value in figures.items():
        target = TARGETS.get(key)
        shown = format_spread(spreads[key]) if key in spreads else f"{value:8.2f}"
        print(f"  {key:<28} {shown}" + (f"   (target >= {target})" if target else ""))
    result = {
        "figures": figures, "ratio_spreads": spreads, "n": args.n, "chunk": args.chunk,
        "repeats": args.repeats, "threads": threads, "jax": jax.__version__,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }  # fmt: skip
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
