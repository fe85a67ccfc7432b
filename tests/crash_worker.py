"""A small training job with jax_mlpo checkpoints, run by tests/test_checkpoint.py.

Imported, it defines the job (an MLP of 263K params, its loss, the optimizer chain and the
offload configs). Run, it trains one spec given as JSON and exits:

  python tests/crash_worker.py '{"dtype": "bfloat16", "tiers": [...], "ckpt": ..., ...}'

(or a JSON list of specs, run one after the other).

It prints ``init`` after ``tx.init``, restores the latest checkpoint in ``ckpt`` if there is
one and prints ``start <step>``, trains up to ``steps`` updates (saving a checkpoint every
``save_every``), printing ``step <n>`` after each update (before its checkpoint), and writes
the losses and final params to ``out`` (``.npz``). ``slow_writes`` (seconds) delays every tier
write after init by a random time up to that (a fault plan of :mod:`jax_mlpo.testing`), so that
a kill lands inside the update phase; ``slow_stream``
(seconds) a sleep after each subgroup a checkpoint streams, so that updates run while a save is
in flight (it prints ``saving <step>`` once ``save`` has returned).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax_mlpo  # noqa: E402
import jax_mlpo.testing  # noqa: E402
from jax_mlpo import checkpoint  # noqa: E402

REWRITTEN = [0]  # files of deleted checkpoints a save took (with "recycle_bytes")
SHAPES = {"b1": (1024,), "scale": (128,), "w1": (128, 1024), "w2": (1024, 128)}
NUM_PARAMS = sum(int(np.prod(s)) for s in SHAPES.values())  # 263,296
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 100, 1e-3)


def make_params(dtype: Any) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)  # numpy: no compilation for the first eager jax ops
    return {
        k: jnp.asarray(rng.normal(0.0, 0.05 if len(shape) > 1 else 1.0, shape), dtype)
        for k, shape in SHAPES.items()
    }


def loss_fn(params: dict[str, jax.Array], step: jax.Array) -> jax.Array:
    """A regression whose gradients depend on the params (a one-ulp error would propagate)."""
    x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(1), step), (32, 128))
    dtype = params["w1"].dtype
    h = jnp.tanh(x.astype(dtype) @ params["w1"] + params["b1"])
    y = (h @ params["w2"]) * params["scale"]
    return jnp.mean((y.astype(jnp.float32) - jnp.sin(x)) ** 2)


def offload_config(spec: dict[str, Any]) -> jax_mlpo.OffloadConfig:
    """``spec``: tiers (paths), subgroup_size, cache ('all', 'part' or 'none'), retain, dtype,
    io_engine."""
    per_elem = 12 if spec["dtype"] == "bfloat16" else 8
    size = spec.get("subgroup_size", 32768)
    blob = per_elem * min(size, NUM_PARAMS)
    pipeline = (2 * max(len(spec["tiers"]), 1) + 2) * blob
    cache = {"all": per_elem * NUM_PARAMS, "part": pipeline + 2 * blob, "none": pipeline}
    return jax_mlpo.OffloadConfig(
        host_cache=cache[spec.get("cache", "part")],
        tiers=[
            jax_mlpo.FileTier(t, io_engine=spec.get("io_engine", "posix")) for t in spec["tiers"]
        ],
        subgroup_size=size,
        retain=spec.get("retain", True),
        placement="even",  # no bandwidth probe: faster, and the same plan every run
    )


def make_tx(config: jax_mlpo.OffloadConfig, **adamw_kwargs: Any) -> optax.GradientTransformation:
    """``adamw_kwargs``: more of jax_mlpo.adamw's arguments (mu_dtype, nu_dtype)."""
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.add_noise(1e-4, 0.55, key=0),  # state: a count and a PRNG key, both checkpointed
        jax_mlpo.adamw(
            SCHEDULE, b2=0.95, weight_decay=0.1, mask=mask, offload=config, **adamw_kwargs
        ),
    )


grad_step = jax.jit(jax.value_and_grad(loss_fn))


def make_update(tx: optax.GradientTransformation):
    @jax.jit
    def update(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def train(update, params, opt_state, start: int, end: int, after_step=None):
    """Steps ``start..end-1``; returns params, opt_state and the losses."""
    losses = []
    for step in range(start, end):
        loss, grads = grad_step(params, step)
        params, opt_state = jax.block_until_ready(update(grads, opt_state, params))
        losses.append(float(loss))
        if after_step is not None:
            after_step(step + 1, params, opt_state)
    return params, opt_state, losses


def as_bits(tree: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Params as unsigned ints of their width, for bitwise comparison (and .npz files)."""
    bits = {2: np.uint16, 4: np.uint32}
    return {k: np.asarray(v).view(bits[np.dtype(v.dtype).itemsize]) for k, v in tree.items()}


def _slow_stream(delay_s: float) -> None:
    from jax_mlpo.engine.snapshot import StateSnapshot

    blobs = StateSnapshot.blobs

    def slow_blobs(self):
        for item in blobs(self):
            yield item
            time.sleep(delay_s)

    StateSnapshot.blobs = slow_blobs


def main(spec: dict[str, Any]) -> None:
    if spec.get("slow_stream"):
        _slow_stream(spec["slow_stream"])
    if spec.get("direct_bytes"):  # params this large are written (and read) by jax_mlpo
        from jax_mlpo.checkpoint import host_reads

        host_reads.DIRECT_BYTES = spec["direct_bytes"]
    if spec.get("recycle_bytes"):  # arrays this large rewrite a deleted checkpoint's files
        from jax_mlpo.checkpoint import recycle

        recycle.MIN_BYTES = spec["recycle_bytes"]
        take = recycle.SpareFiles.take

        def counted_take(self, path, nbytes):
            taken = take(self, path, nbytes)
            REWRITTEN[0] += taken
            return taken

        recycle.SpareFiles.take = counted_take
    dtype = jnp.dtype(spec["dtype"])
    tx = make_tx(offload_config(spec))
    params = make_params(dtype)
    opt_state = tx.init(params)
    print("init", flush=True)
    with contextlib.ExitStack() as stack:
        if spec.get("slow_writes"):
            rng = random.Random(os.getpid())
            plan = stack.enter_context(jax_mlpo.testing.tier_faults(opt_state, tier=None))
            plan.delay("write", lambda: rng.uniform(0.0, spec["slow_writes"]), count=None)
        _train_and_save(spec, tx, params, opt_state)


def _train_and_save(spec: dict[str, Any], tx, params, opt_state) -> None:
    """Restores the latest checkpoint if any, trains, saves, writes ``out``."""
    mngr = checkpoint.manager(spec["ckpt"], max_to_keep=2)
    start = 0
    if mngr.latest_step() is not None:
        start, params, opt_state, _ = checkpoint.restore(mngr, params, opt_state)
    print(f"start {start}", flush=True)
    every = spec.get("save_every", 0)

    def after_step(step, params, opt_state):
        print(f"step {step}", flush=True)
        if every and step % every == 0:
            checkpoint.save(mngr, step, params, opt_state, {"step": step})
            print(f"saving {step}", flush=True)

    params, opt_state, losses = train(
        make_update(tx), params, opt_state, start, spec["steps"], after_step
    )
    mngr.wait_until_finished()
    mngr.close()
    jax_mlpo.close(opt_state)
    np.savez(spec["out"], start=start, losses=np.asarray(losses, np.float64), **as_bits(params))
    print(f"done, {REWRITTEN[0]} files of deleted checkpoints rewritten", flush=True)


if __name__ == "__main__":
    specs = json.loads(sys.argv[1])
    for spec in specs if isinstance(specs, list) else [specs]:
        main(spec)
