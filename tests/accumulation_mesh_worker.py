"""jax_mlpo.MultiSteps beside optax.MultiSteps on a (2, 2) mesh of four CPU devices, with the
mesh's axes Explicit (the sharding in the array types) or Auto.

Run by tests/test_optax_idioms.py in its own interpreter (this needs four devices):
``python accumulation_mesh_worker.py explicit|auto TIER_DIR``. Prints one JSON line: the
largest difference of the params from optax's, whether ``jax.eval_shape(tx.init)`` has
init's shapes, whether the params, the accumulator
and the updates keep the params' shardings, and the bytes written to the tier.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_mlpo  # noqa: E402

SUB = 4096
K = 2  # micro-steps per applied update
STEPS = 6


def main(kind: str, tier_dir: str) -> None:
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(axis, axis))
    config = jax_mlpo.OffloadConfig(
        host_cache=3 * 8 * SUB, subgroup_size=SUB, prefetch_depth=1, placement="even",
        tiers=[jax_mlpo.FileTier(tier_dir, sync=False)],
    )  # fmt: skip
    shardings = {"w": NamedSharding(mesh, P("tensor", "fsdp")), "b": NamedSharding(mesh, P())}
    out: dict = {"devices": jax.device_count()}
    with jax.set_mesh(mesh):
        params0 = {
            "w": jax.device_put(jnp.linspace(-1, 1, 8 * SUB).reshape(256, 128), shardings["w"]),
            "b": jax.device_put(jnp.linspace(1, -1, 128), shardings["b"]),
        }
        # the restore target's shapes on a mesh: eval_shape's template is init's shape
        inner = jax_mlpo.adamw(1e-2, weight_decay=0.1, offload=config)
        abstract = jax.eval_shape(inner.init, params0)
        state = inner.init(params0)
        out["eval_shape_matches_init"] = jax.tree.map(jnp.shape, abstract) == jax.tree.map(
            jnp.shape, state
        )
        jax_mlpo.close(state)
        results = {}
        for name, tx in (
            ("optax", optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), K)),
            ("mlpo", jax_mlpo.MultiSteps(jax_mlpo.adamw(1e-2, weight_decay=0.1, offload=config),
                                         K)),
        ):  # fmt: skip
            state = tx.init(params0)

            @jax.jit
            def step(params, state, i, tx=tx):
                grads = jax.tree.map(lambda p: jnp.cos(p * (i + 1)), params)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state, updates

            params = params0
            for i in range(STEPS):
                params, state, updates = step(params, state, i)
            results[name] = (params, state, updates)
        params, state, updates = results["mlpo"]
        expected = results["optax"][0]
        out["max_abs_diff"] = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(e))))
            for a, e in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True)
        )

        def kept(tree):
            return {k: tree[k].sharding.is_equivalent_to(shardings[k], tree[k].ndim)
                    for k in shardings}  # fmt: skip

        out["params_keep_shardings"] = kept(params)
        out["accumulator_keep_shardings"] = kept(state.acc_grads)
        out["updates_keep_shardings"] = kept(updates)
        engine = jax_mlpo.engine_of(state)
        engine.drain()
        out["tier_bytes"] = sum(t.bytes_written for t in engine.tiers)
        jax_mlpo.close(state)
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
