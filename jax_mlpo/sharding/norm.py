"""The global norm of the gradients, summed in one order whatever program computes it.

``optax.tree.norm`` is a reduction XLA compiles with the program around it: fused with the
backward pass that makes the gradients in a plain step, over an input in
:func:`jax_mlpo.overlapped_step`, over a transposed layout where the backward pass left one,
and with the devices' partial sums combined where the partitioner puts them. The sums differ in
the last bit, and a clipped update with them. :func:`global_norm` fixes the order: each
device's block of each leaf in row-major order (a reshape behind an ``optimization_barrier``,
which nothing fuses across), summed, then the devices' sums of each leaf over the mesh axes it
is split along, then the leaves in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

__all__ = ["global_norm"]


def _squares(x: jax.Array) -> jax.Array:
    """The sum of ``x``'s squares in float32, over its elements in row-major order."""
    x = x.astype(jnp.float32)
    # a leaf typed on a one-device mesh with Explicit axes (jax.set_mesh) needs the flat
    # array's sharding named: the same single device
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    out = P(None) if mesh is not None and not mesh.empty else None
    flat = jax.lax.optimization_barrier(jax.lax.reshape(x, (x.size,), out_sharding=out))
    return jnp.sum(flat * flat)


def _axes(spec: P) -> tuple[str, ...]:
    names: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        names.extend(entry if isinstance(entry, tuple) else (entry,))
    return tuple(names)


def global_norm(
    leaves: Sequence[jax.Array], mesh: Mesh | None = None, specs: Sequence[P] | None = None
) -> jax.Array:
    """The L2 norm of ``leaves`` taken together, in float32 (``optax.tree.norm``'s value).

    Args:
      leaves: the gradient leaves (traced).
      mesh: the mesh they are split over (None: each on one device).
      specs: each leaf's partition over ``mesh``.

    Returns:
      A float32 scalar (replicated over ``mesh``).
    """
    leaves = list(leaves)
    if not leaves:
        return jnp.float32(0.0)
    if mesh is None:
        sums = [_squares(x) for x in leaves]
    else:
        assert specs is not None
        specs = list(specs)

        def local(*blocks: jax.Array) -> tuple[jax.Array, ...]:
            # each leaf's devices' sums added over the axes it is split along; a replicated
            # block is the whole leaf already
            return tuple(
                jax.lax.psum(_squares(b), _axes(s)) if _axes(s) else _squares(b)
                for b, s in zip(blocks, specs, strict=True)
            )

        sums = jax.shard_map(
            local, mesh=mesh, in_specs=tuple(specs), out_specs=tuple(P() for _ in specs),
            check_vma=False,
        )(*leaves)  # fmt: skip
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return jnp.sqrt(total)
