"""An init traced by ``jax.jit`` that makes its engines when the compiled program runs.

``jax.jit(tx.init)``, a linen ``TrainState`` made under ``jit`` and an ``nnx.Optimizer`` made
under ``nnx.jit`` trace ``init`` with abstract params. The engine is laid out by the params'
shapes and dtypes alone (the fp32 master of bfloat16 params is set from their values by the
first update), so the traced init puts the making of its engines into the program as one host
call (:func:`handles_at_run_time`) on stand-ins of the params (:func:`stand_ins_of`), which
returns their handles: every run of the compiled init makes its engines, and
``jax.eval_shape``, which never runs the program, makes nothing and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jax_mlpo.sharding import processes as distributed


def made_at_run_time(params: Any) -> bool:
    """Whether a traced ``init`` of ``params`` makes its engines when the compiled program runs
    (:func:`handles_at_run_time`): params of one device in one process. On a mesh or across
    processes the engine is laid out by the params' shards, which a traced init does not see:
    it returns a template (:func:`~jax_mlpo.transforms.offloaded.template_state`), whose use
    names the fix."""
    if distributed.is_multiprocess():
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return False
    for leaf in jax.tree.leaves(params):  # params on a mesh in their types (explicit sharding)
        leaf_mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
        if leaf_mesh is not None and not leaf_mesh.empty and leaf_mesh.size > 1:
            return False
    return True


def stand_ins_of(params: Any) -> Any:
    """Traced ``params`` as ``ShapeDtypeStruct``s: what an engine is laid out by (the fp32
    master of bfloat16 params is set from their values by the first update)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)


def handles_at_run_time(make: Callable[[], list[int]], count: int) -> list[jax.Array]:
    """``count`` int32 handles that ``make`` returns when the compiled program runs.

    A traced ``init`` (``jax.jit(tx.init)``, a linen ``TrainState`` made under ``jit``, an
    ``nnx.Optimizer`` made under ``nnx.jit``) puts the making of its engines into the program
    as a host call: every run of it makes new engines (each replacing the engine at its place,
    as a second eager init does), and ``jax.eval_shape``, which never runs the program, makes
    nothing and writes nothing.
    """

    def call() -> np.ndarray:
        return np.asarray(make(), np.int32).reshape(count)

    out = io_callback(call, jax.ShapeDtypeStruct((count,), jnp.int32))
    return [out[k] for k in range(count)]
