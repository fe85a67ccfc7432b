"""One-off study: the scanned model's loss with its scan rewritten as a Python loop over the
iterations (what ``loss_at_first_use`` would do to add each layer's update where that layer
runs), against the scanned program: bit for bit or not, and the compile and step time of each.

    python -m experiments.unroll_probe --layers 4 8 --rounds 5
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jex_core

from experiments.bench.harness import provenance
from jax_mlpo.transforms.overlap import _bind
from models import Llama, get_preset, loss_fn


def unrolled(closed: jex_core.ClosedJaxpr, *vals: Any) -> Any:
    """``closed``'s first output, each ``scan`` equation run as a loop over its iterations."""
    env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(closed.jaxpr.invars, vals, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in closed.jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name != "scan":
            env.update(zip(eqn.outvars, _bind(eqn, ins), strict=True))
            continue
        p = eqn.params
        nc, nk, body = p["num_consts"], p["num_carry"], p["jaxpr"]
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        order = range(p["length"])[::-1] if p["reverse"] else range(p["length"])
        ys = []
        for i in order:  # layer i's slice of every stacked input: where its update would go
            out = jax.core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *[x[i] for x in xs])
            carry, y = out[:nk], out[nk:]
            ys.append(y)
        ys = ys[::-1] if p["reverse"] else ys
        stacked = [jnp.stack(col) for col in zip(*ys, strict=True)] if ys and ys[0] else []
        env.update(zip(eqn.outvars, [*carry, *stacked], strict=True))
    return read(closed.jaxpr.outvars[0])


def probe(layers: int, rounds: int) -> dict[str, Any]:
    cfg = get_preset("small").replace(layers=layers, scan_layers=True)
    graphdef, params, rest = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 128)), jnp.int32)
    leaves, treedef = jax.tree.flatten(params)

    def scanned(*ls: Any) -> Any:
        return loss_fn(nnx.merge(graphdef, jax.tree.unflatten(treedef, ls), rest), tokens)

    closed = jax.make_jaxpr(scanned)(*leaves)
    row: dict[str, Any] = {"layers": layers}
    got = {}
    for name, fn in (("scanned", scanned), ("unrolled", lambda *ls: unrolled(closed, *ls))):
        grad = jax.jit(jax.value_and_grad(fn, argnums=tuple(range(len(leaves)))))
        t0 = time.perf_counter()
        compiled = grad.lower(*leaves).compile()
        compile_s = time.perf_counter() - t0
        got[name] = jax.block_until_ready(compiled(*leaves))
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*leaves))
            times.append(time.perf_counter() - t0)
        row[name] = {"compile_s": compile_s, "fwd_bwd_s": float(np.median(times))}
    (la, ga), (lb, gb) = got["scanned"], got["unrolled"]
    row["loss_bit_equal"] = bool(np.array_equal(np.asarray(la), np.asarray(lb)))
    row["grads_bit_equal"] = all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(ga, gb, strict=True)
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(provenance())
    for n in args.layers:
        print(probe(n, args.rounds))


if __name__ == "__main__":
    main()
