"""The model's bfloat16 matmuls: XLA's plain dot beside models.matmul.dot_general.

Two measurements, each interleaved A B A B ... in one process (the machine is shared), with the
median of ``--repeats`` rounds:

1. every distinct dense-layer shape of the config's model at its ``batch_size x seq_len`` tokens:
   the forward product and both backward products (``jax.vjp``), GFLOP/s of the three;
2. the whole forward + backward pass (``jax.value_and_grad`` of the loss, as
   ``experiments/pretrain.py``'s ``grad_step``) of the model built with each contraction from
   the same params, with the loss and gradient differences between the two.

    python -m experiments.bench.mlpo.matmul --config experiments/configs/e2e-125m.yaml \\
        --repeats 7 --json experiments/results/matmul.json
"""

from __future__ import annotations

import argparse
import functools
import logging
import platform
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from experiments.bench.harness import ratio_spread, round_robin, write_json
from experiments.job.run_config import RunConfig, load_config, resolve_model
from models import Llama, loss_fn, matmul, param_count

log = logging.getLogger("bench.matmul")

SYSTEMS = {"xla": lax.dot_general, "models.matmul": matmul.dot_general}


def _round_robin(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """:func:`experiments.bench.harness.round_robin` of the cases, each waiting for its result."""

    def waited(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: jax.block_until_ready(fn())

    return round_robin({k: waited(fn) for k, fn in cases.items()}, repeats)


def _fwd_bwd(dot, x: jax.Array, w: jax.Array, g: jax.Array):
    """A dense layer's product and both of its backward products."""
    y, vjp = jax.vjp(lambda x, w: dot(x, w, (((1,), (0,)), ((), ()))), x, w)
    return y, vjp(g)


def layer_shapes(model: nnx.Module) -> list[tuple[int, int]]:
    """The distinct ``(in, out)`` kernel shapes of the model's dense layers."""
    linears = (m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear))
    return sorted({tuple(m.kernel.shape) for m in linears})


def _speedup(times: dict[str, list[float]]) -> float:
    """The median over rounds of xla's time / models.matmul's time."""
    return ratio_spread(times["xla"], times["models.matmul"])["median"]


def bench_layers(shapes, tokens: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for d_in, d_out in shapes:
        x = jnp.asarray(rng.standard_normal((tokens, d_in)), jnp.bfloat16)  # [batch x seq, in]
        w = jnp.asarray(rng.standard_normal((d_in, d_out)) * 0.02, jnp.bfloat16)
        g = jnp.asarray(rng.standard_normal((tokens, d_out)), jnp.bfloat16)
        cases = {
            name: functools.partial(jax.jit(functools.partial(_fwd_bwd, dot)), x, w, g)
            for name, dot in SYSTEMS.items()
        }
        times = _round_robin(cases, repeats)
        flops = 3 * 2 * tokens * d_in * d_out
        row = {"shape": [tokens, d_in, d_out]}
        for name, ts in times.items():
            row[name] = {
                "median_s": statistics.median(ts),
                "gflops": flops / statistics.median(ts) / 1e9,
            }
        row["speedup"] = _speedup(times)
        rows.append(row)
        log.info(
            "layer %s: %s",
            row["shape"],
            {k: round(v["gflops"]) for k, v in row.items() if isinstance(v, dict)},
        )
    return rows


def bench_model(cfg: RunConfig, repeats: int) -> dict:
    model_cfg = resolve_model(cfg)
    steps, grads = {}, {}
    rng = np.random.default_rng(cfg.seed)
    tokens = jnp.asarray(
        rng.integers(0, model_cfg.vocab_size, (cfg.batch_size, cfg.seq_len)), jnp.int32
    )
    for name, dot in SYSTEMS.items():
        model = Llama(model_cfg, rngs=nnx.Rngs(cfg.seed))  # the same params for both
        for _, m in nnx.iter_modules(model):
            if isinstance(m, nnx.Linear):
                m.dot_general = dot
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def grad_step(params, rest, tokens, graphdef=graphdef):
            return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), tokens))(
                params
            )

        steps[name] = lambda f=grad_step, p=params, r=rest: f(p, r, tokens)
        grads[name] = steps[name]()
    times = _round_robin(steps, repeats)
    (loss_a, g_a), (loss_b, g_b) = grads["xla"], grads["models.matmul"]
    diffs = [
        float(
            jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
            / (jnp.max(jnp.abs(a.astype(jnp.float32))) + 1e-30)
        )
        for a, b in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b), strict=True)
    ]
    return {
        "params": param_count(model_cfg),
        "fwd_bwd_s": {k: statistics.median(v) for k, v in times.items()},
        "fwd_bwd_s_all": times,
        "speedup": _speedup(times),
        "loss": {"xla": float(loss_a), "models.matmul": float(loss_b)},
        "grad_max_rel_diff": max(diffs),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="experiments/configs/e2e-125m.yaml")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    cfg = load_config(args.config)
    model_cfg = resolve_model(cfg)
    tokens = cfg.batch_size * cfg.seq_len
    out = {
        "args": vars(args),
        "machine": {
            "platform": platform.platform(),
            "cpus": jax.local_device_count(),
            "jax": jax.__version__,
        },
        "model": {"name": cfg.model, "dtype": model_cfg.dtype, "tokens": tokens},
        "layers": bench_layers(
            layer_shapes(Llama(model_cfg, rngs=nnx.Rngs(0))), tokens, args.repeats
        ),
        "model_fwd_bwd": bench_model(cfg, args.repeats),
    }
    m = out["model_fwd_bwd"]
    for row in out["layers"]:
        log.info(
            "dense %-18s xla %6.0f GFLOP/s   models.matmul %6.0f GFLOP/s   speedup %.2f",
            "x".join(map(str, row["shape"])),
            row["xla"]["gflops"],
            row["models.matmul"]["gflops"],
            row["speedup"],
        )
    log.info(
        "model %s fwd+bwd: xla %.3f s, models.matmul %.3f s (medians of %d), speedup %.2f; "
        "loss %s; largest gradient difference %.2e of the leaf's largest value",
        cfg.model,
        m["fwd_bwd_s"]["xla"],
        m["fwd_bwd_s"]["models.matmul"],
        args.repeats,
        m["speedup"],
        m["loss"],
        m["grad_max_rel_diff"],
    )
    write_json(args.json, out, indent=1)
    return out


if __name__ == "__main__":
    main()
