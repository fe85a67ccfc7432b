"""What updating a scanned stack row by row inside the scan would cost in memory, compiled.

``jax_mlpo.overlapped_step`` updates a stacked leaf (``[layers, ...]``, consumed by one
``lax.scan``) as one group before the scan starts. Updating layer i's row when the scan reaches
it means the row's update comes from a host call inside the scan body. This compares the two
forms of the same step, each compiled by XLA for the CPU (``memory_analysis``, nothing run), on a
bfloat16 stack of ``--layers`` matrices of ``--width`` x ``--width``:

- ``whole_stack``: the update added to the whole stack before the scan (what the overlapped
  step does today): the new params are the scan's ``xs``;
- ``row_in_body``: the row's update from a host call (``jax_mlpo_host_update``) inside the body,
  the new row ``old + update`` computed there and returned as the scan's ``ys``.

Both are differentiated (``jax.value_and_grad``) with the stack's inputs donated. The figure is
the program's temporary bytes per stacked param: what the scan's residuals and outputs add.

    python -m experiments.bench.mlpo.scan_update_memory --layers 8 --width 256
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from experiments.bench.harness import provenance
from jax_mlpo.native.host_update import CallGroup, host_update_call


def _row_update(grad: jax.Array, param: jax.Array, row: jax.Array) -> jax.Array:
    """A row's update from one host call (compiled, never run: no engine is needed)."""
    scalars = jnp.zeros(12, jnp.float32)
    _, (update,) = host_update_call(jnp.int32(1), row, scalars, [grad], [param], [param.dtype],
                                    CallGroup(0, 2, (0,)))  # fmt: skip
    return update


def whole_stack(update: jax.Array, old: jax.Array, x: jax.Array):
    new = (old + update).astype(old.dtype)
    out, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, new)
    return jnp.sum(out), new


def row_in_body(grads: jax.Array, old: jax.Array, x: jax.Array):
    def body(c, xs):
        w_old, g, i = xs
        u = _row_update(jax.lax.stop_gradient(g), jax.lax.stop_gradient(w_old), i)
        w = (w_old + u).astype(w_old.dtype)
        return jnp.tanh(c @ w), w

    rows = jnp.arange(old.shape[0], dtype=jnp.int32)
    out, new = jax.lax.scan(body, x, (old, grads, rows))
    return jnp.sum(out), new


def temp_bytes_per_param(fn, layers: int, width: int) -> float:
    stack = jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((4, width), jnp.bfloat16)
    step = jax.jit(jax.value_and_grad(fn, has_aux=True), donate_argnums=(0, 1))
    stats = step.lower(stack, stack, x).compile().memory_analysis()
    return stats.temp_size_in_bytes / (layers * width * width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    print(provenance())
    for fn in (whole_stack, row_in_body):
        per_param = temp_bytes_per_param(fn, args.layers, args.width)
        print(f"{fn.__name__:12s} temporaries {per_param:6.2f} B per stacked param")


if __name__ == "__main__":
    main()
