"""Host kernel bandwidth: fused AdamW, Lion and Muon's host passes (native) beside STREAM triad,
memcpy, XLA, numpy.

Effective bandwidth is the bytes the algorithm must move / time (STREAM convention: no
write-allocate traffic counted). AdamW reads m, v, g, p and writes m, v and u (or p in place):
7 x 4 bytes per element with fp32 gradients (3 x 4 + 4 x 2 with bfloat16 m and v, 3 x 4 + 4 x 1
+ 4 x 4 / 256 with q8 m and v and their block scales); Lion reads m, g, p and writes m and u:
5 x 4; Muon's momentum pass reads m, g and writes m and the momentum: 4 x 4; its master pass
(bfloat16 params) reads the direction, the master and the bf16 params and writes the master and
the bf16 update: 3 x 4 + 2 x 2; triad
a = b + s * c moves 3 x 4; memcpy 2 x 4.
All kernels run in one process, interleaved round-robin (the machines are shared and their
bandwidth drifts; interleaving exposes every kernel to the same conditions), one warm-up each,
and each figure is the median of ``--repeats`` rounds.

    python -m experiments.bench.mlpo.kernels --n 67108864 --repeats 7 \\
        --json experiments/results/kernels.json
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.bench.harness import round_robin, write_json
from jax_mlpo import native
from jax_mlpo.engine.quantize import BLOCK, Quantized, num_blocks
from jax_mlpo.native.kernels import q8_encode
from jax_mlpo.optimizers.adamw import adamw_step_reference
from jax_mlpo.types import BF16, F32, AdamWHyper, ApplyHyper, LionHyper, MomentumHyper

log = logging.getLogger("bench.kernels")

HYPER = AdamWHyper(bc1=0.19, bc2=0.002, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
LION = LionHyper(lr=1e-4, b1=0.9, b2=0.99, weight_decay=0.1)
NESTEROV = HYPER._replace(nesterov=True, bc1_next=0.271)
MOMENTUM = MomentumHyper(beta=0.95, bc=0.1426, bc_next=0.1855, nesterov=True)
APPLY = ApplyHyper(lr=0.02, weight_decay=0.1)


class Case(NamedTuple):
    key: str
    label: str
    bytes_per_elem: float
    fn: Callable[[], object]
    # Cases that allocate (numpy temporaries, a fresh XLA output each call) fault in pages and
    # disturb whatever runs beside them: they are measured in a second, separate round-robin.
    allocates: bool = False


def native_cases(n: int) -> list[Case]:
    rng = np.random.default_rng(0)
    m, v, u, a = (np.zeros(n, F32) for _ in range(4))
    g = rng.standard_normal(n, dtype=np.float32)
    p = rng.standard_normal(n, dtype=np.float32)
    g16 = g.astype(BF16)
    h16 = np.empty(n, BF16)
    m16, v16 = np.zeros(n, BF16), np.zeros(n, BF16)
    # q8 moments of a running AdamW (small m, v = m^2 scale), not zeros: an all-zero block
    # takes the encoder's short path.
    m8 = Quantized(np.empty(n, np.uint8), np.empty(num_blocks(n), F32))
    v8 = Quantized(np.empty(n, np.uint8), np.empty(num_blocks(n), F32))
    q8_encode(g * 1e-3, m8, signed=True)
    q8_encode(np.square(g * 1e-3), v8, signed=False)
    q8_bytes = 3 * 4 + 4 * 1 + 4 * 4 / BLOCK

    def numpy_reference():
        with np.errstate(all="ignore"):
            adamw_step_reference(m, v, g, p, u, HYPER)

    return [
        Case("adamw_gbps", "native AdamW (r m,v,g,p; w m,v,u)", 28,
             lambda: native.adamw_step(m, v, g, p, u, HYPER)),
        Case("adamw_inplace_gbps", "native AdamW, p in place (w m,v,p)", 28,
             lambda: native.adamw_step(m, v, g, p, None, HYPER, update_param=True)),
        Case("adamw_bf16_grad_gbps", "native AdamW, bf16 grad", 26,
             lambda: native.adamw_step(m, v, g16, p, u, HYPER)),
        Case("adamw_bf16_moments_gbps", "native AdamW, bf16 m, v (r m,v,g,p; w m,v,u)", 20,
             lambda: native.adamw_step(m16, v16, g, p, u, HYPER)),
        Case("adamw_q8_moments_gbps", "native AdamW, q8 m, v, nearest", q8_bytes,
             lambda: native.adamw_step(m8, v8, g, p, u, HYPER)),
        Case("adamw_q8_stochastic_gbps", "native AdamW, q8 m, v, stochastic", q8_bytes,
             lambda: native.adamw_step(m8, v8, g, p, u, HYPER, seed=1)),
        Case("lion_gbps", "native Lion (r m,g,p; w m,u)", 20,
             lambda: native.lion_step(m, g, p, u, LION)),
        Case("lion_bf16_moment_gbps", "native Lion, bf16 m (r m,g,p; w m,u)", 16,
             lambda: native.lion_step(m16, g, p, u, LION)),
        Case("adamw_nesterov_gbps", "native AdamW, nesterov", 28,
             lambda: native.adamw_step(m, v, g, p, u, NESTEROV)),
        Case("muon_momentum_gbps", "native Muon momentum (r m,g; w m,m_hat)", 16,
             lambda: native.momentum_step(m, g, u, MOMENTUM)),
        Case("muon_master_gbps", "native Muon master, bf16 (r d,p,p16; w p,u16)", 16,
             lambda: native.apply_step(g, p, h16, APPLY, update_param=True, delta_base=g16)),
        Case("triad_gbps", "STREAM triad a=b+s*c (native)", 12,
             lambda: native.stream_triad(a, p, g, 3.0)),
        Case("memcpy_gbps", "memcpy (native, threaded)", 8, lambda: native.parallel_copy(a, p)),
        Case("bf16_to_f32_gbps", "bf16 -> f32 (native)", 6, lambda: native.bf16_to_f32(g16, a)),
        Case("f32_to_bf16_gbps", "f32 -> bf16 (native)", 6, lambda: native.f32_to_bf16(p, h16)),
        Case("numpy_adamw_gbps", "numpy reference (kernels.py)", 28, numpy_reference, True),
    ]  # fmt: skip


def xla_cases(n: int) -> list[Case]:
    """Jitted optax.adamw (the update XLA fuses itself) and the native FFI call, donated.

    Without a donated buffer for the update, XLA allocates a fresh one every step and the page
    faults of its first touch dominate; both variants are measured.
    """
    opt = optax.adamw(
        HYPER.lr, b1=HYPER.b1, b2=HYPER.b2, eps=HYPER.eps, weight_decay=HYPER.weight_decay
    )
    key = jax.random.key(0)
    g = jax.random.normal(jax.random.fold_in(key, 1), (n,), jnp.float32)
    p = jax.random.normal(key, (n,), jnp.float32)
    zeros = functools.partial(jnp.zeros, n, jnp.float32)

    # The update returned (reads m, v, g, p; writes m, v, u); state and last update donated.
    @functools.partial(jax.jit, donate_argnums=(1, 3), keep_unused=True)
    def step_update(p, state, g, u_prev):
        del u_prev  # donated: XLA writes the new update into its buffer
        return opt.update(g, state, p)

    # Params in place (writes m, v, p); params and state donated.
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_inplace(p, state, g):
        u, state = opt.update(g, state, p)
        return optax.apply_updates(p, u), state

    # The update returned, no buffer donated for it.
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step_fresh(p, state, g):
        return opt.update(g, state, p)

    box = {"upd": (zeros(), opt.init(p)), "inpl": (p + 0, opt.init(p)), "fresh": opt.init(p)}

    def xla_update():
        u, state = box["upd"]
        box["upd"] = step_update(p, state, g, u)
        jax.block_until_ready(box["upd"])

    def xla_inplace():
        box["inpl"] = step_inplace(*box["inpl"], g)
        jax.block_until_ready(box["inpl"])

    def xla_fresh():
        u, box["fresh"] = step_fresh(p, box["fresh"], g)
        jax.block_until_ready(u)

    scalars = [jnp.float32(x) for x in (HYPER.lr, HYPER.bc1, HYPER.bc2)]

    # Reads m, v, g, p; writes m, v, u. p is an argument (a captured array would be a constant)
    # and is not returned (returning an input copies it).
    @functools.partial(jax.jit, donate_argnums=(0, 1, 4))
    def ffi_step(m, v, g, p, u_prev, lr, bc1, bc2):
        hyper = HYPER._replace(lr=lr, bc1=bc1, bc2=bc2)
        m, v, _, u = native.adamw_update(m, v, g, p, hyper, update_buffer=u_prev)
        return m, v, u

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def ffi_fresh_step(m, v, g, p, lr, bc1, bc2):
        hyper = HYPER._replace(lr=lr, bc1=bc1, bc2=bc2)
        m, v, _, u = native.adamw_update(m, v, g, p, hyper)
        return m, v, u

    box["ffi"] = (zeros(), zeros(), zeros())
    box["ffi_fresh"] = (zeros(), zeros())

    def ffi():
        m, v, u = box["ffi"]
        box["ffi"] = ffi_step(m, v, g, p, u, *scalars)
        jax.block_until_ready(box["ffi"])

    def ffi_fresh():
        m, v, u = ffi_fresh_step(*box["ffi_fresh"], g, p, *scalars)
        box["ffi_fresh"] = (m, v)
        jax.block_until_ready(u)

    return [
        Case("ffi_adamw_gbps", "native AdamW, XLA FFI in jit, u donated", 28, ffi),
        Case(
            "ffi_adamw_fresh_update_gbps",
            "native AdamW, XLA FFI in jit, fresh u",
            28,
            ffi_fresh,
            True,
        ),
        Case("xla_adamw_gbps", "XLA jit optax.adamw update, u donated", 28, xla_update),
        Case("xla_adamw_inplace_gbps", "XLA jit optax.adamw, p in place", 28, xla_inplace),
        Case(
            "xla_adamw_fresh_update_gbps",
            "XLA jit optax.adamw update, fresh u",
            28,
            xla_fresh,
            True,
        ),
    ]


def measure(cases: list[Case], n: int, repeats: int) -> dict[str, float]:
    """Medians over `repeats` round-robin rounds, after one warm-up run of each case.

    The steady-state cases are measured together first, then the allocating ones.
    """
    times: dict[str, list[float]] = {}
    for group in ([c for c in cases if not c.allocates], [c for c in cases if c.allocates]):
        times |= round_robin({c.key: c.fn for c in group}, repeats)
    for key, ts in times.items():
        log.debug("%s: %s", key, [f"{t:.4f}" for t in ts])
    return {c.key: c.bytes_per_elem * n / statistics.median(times[c.key]) / 1e9 for c in cases}


TARGETS = {
    "ratio_adamw_over_triad": 0.7,
    "ratio_adamw_bf16_moments_over_triad": 0.6,
    "ratio_adamw_q8_moments_over_triad": 0.6,
    "ratio_adamw_q8_stochastic_over_triad": 0.6,
    "ratio_lion_over_triad": 0.8,
    "ratio_muon_momentum_over_triad": 0.8,
    "ratio_muon_master_over_triad": 0.8,
    "ratio_adamw_over_xla": 1.3,
    "ratio_adamw_inplace_over_xla_inplace": 1.3,
    "ratio_adamw_over_numpy": 5.0,
}


def table(cases: list[Case], figures: dict[str, float]) -> str:
    rows = [
        f"| {'kernel':<42} | {'B/elem':>6} | {'GB/s':>6} |",
        f"|{'-' * 44}|{'-' * 8}|{'-' * 8}|",
    ]
    order = ["adamw", "lion", "muon", "ffi", "xla", "numpy", "triad", "memcpy", "bf16", "f32"]
    for c in sorted(cases, key=lambda c: order.index(c.key.split("_")[0])):
        rows.append(f"| {c.label:<42} | {c.bytes_per_elem:>6.4g} | {figures[c.key]:>6.1f} |")
    rows += ["", f"| {'ratio':<42} | {'value':>6} | {'target':>6} |", rows[1]]
    for key, target in TARGETS.items():
        if key in figures:
            rows.append(f"| {key:<42} | {figures[key]:>6.2f} | {'>= ' + str(target):>6} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=64 * 2**20, help="elements per array")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median; >= 5)")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: all)")
    parser.add_argument("--skip-xla", action="store_true", help="skip the XLA and FFI figures")
    parser.add_argument("--json", type=str, default=None, help="write the figures to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every timing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    threads = native.set_num_threads(args.threads)
    log.info("n=%d repeats=%d threads=%d isa=%s", args.n, args.repeats, threads, native.isa())

    load_before = os.getloadavg()
    if load_before[0] > (os.cpu_count() or 1) * 0.5:
        log.warning("load average %.1f: other processes compete for the memory bus", load_before[0])
    cases = native_cases(args.n) + ([] if args.skip_xla else xla_cases(args.n))
    figures = measure(cases, args.n, args.repeats)
    adamw = figures["adamw_gbps"]
    figures["ratio_adamw_over_triad"] = adamw / figures["triad_gbps"]
    figures["ratio_adamw_bf16_moments_over_triad"] = (
        figures["adamw_bf16_moments_gbps"] / figures["triad_gbps"]
    )
    figures["ratio_lion_over_triad"] = figures["lion_gbps"] / figures["triad_gbps"]
    for kind in ("muon_momentum", "muon_master", "adamw_nesterov"):
        figures[f"ratio_{kind}_over_triad"] = figures[f"{kind}_gbps"] / figures["triad_gbps"]
    for kind in ("q8_moments", "q8_stochastic"):
        figures[f"ratio_adamw_{kind}_over_triad"] = (
            figures[f"adamw_{kind}_gbps"] / figures["triad_gbps"]
        )
    if "xla_adamw_gbps" in figures:  # like for like: the same arrays read and written
        figures["ratio_adamw_over_xla"] = adamw / figures["xla_adamw_gbps"]
        figures["ratio_adamw_inplace_over_xla_inplace"] = (
            figures["adamw_inplace_gbps"] / figures["xla_adamw_inplace_gbps"]
        )
    figures["ratio_adamw_over_numpy"] = adamw / figures["numpy_adamw_gbps"]
    result = {
        "figures": figures,
        "n": args.n,
        "repeats": args.repeats,
        "threads": threads,
        "isa": native.isa(),
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(table(cases, figures))
    write_json(args.json, result)
    if args.json:
        log.info("wrote %s", args.json)
    return result


if __name__ == "__main__":
    main()
