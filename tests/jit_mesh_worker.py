"""One process with four CPU devices: optimizer states made under ``jax.jit`` / ``nnx.jit`` on a
(2, 2) ``data`` x ``fsdp`` mesh, against the eager init and optax (spawned by
tests/test_jit_mesh.py: the device count is fixed when JAX starts).

Usage: jit_mesh_worker.py TIER_ROOT SCENARIO...

Each SCENARIO is ``linen`` or ``nnx``, a dash, and the mesh's axis types, ``explicit``
(``jax.make_mesh``'s default) or ``auto``; or ``refusals``. The params are sharded over
``fsdp`` (the kernel's columns) and replicated over ``data``, the bias replicated.

- ``linen-*``: a ``flax.training.train_state.TrainState`` made by ``jax.jit(create,
  out_shardings=...)`` under ``jax.set_mesh``, the params placed on the mesh inside ``create``
  before ``TrainState.create``; trained a few steps beside the same TrainState made eagerly on
  the placed params (the same optimizer) and one with ``optax.adamw``. Then a second run of the
  same compiled init: a new engine with tier files of its own, the first state refused.
- ``nnx-*``: an ``nnx.Optimizer`` made under ``nnx.jit`` with Flax's sharded-init idiom
  (``nnx.with_partitioning``, ``nnx.get_partition_spec``, a sharding constraint), against the
  same made eagerly and optax.
- ``refusals``: a jitted init traced with no mesh in sight of params on the mesh; a TrainState
  placed by ``out_shardings`` alone with Explicit axes, whose init saw the params replicated.

Prints one JSON line: per scenario, the params' largest difference from the eager run's and
from optax's, whether the state's arrays have the shardings asked for, the specs the engine is
laid out by, and the two runs' handles and tier files; for refusals, the error messages.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
os.environ.setdefault("PJRT_NPROC", "16")  # tests/mesh_worker.py says why
faulthandler.dump_traceback_later(240, exit=True)  # a hang prints its stacks before the kill

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_mlpo  # noqa: E402
from jax_mlpo.transforms import runtime  # noqa: E402
from jax_mlpo.transforms.opt_state import find_offloaded, handle_of  # noqa: E402

SUB = 2048  # elements per subgroup: the kernel's shards are several subgroups each
LR = 1e-2
STEPS = 3
SPECS = {"kernel": P(None, "fsdp"), "bias": P()}
X = jnp.linspace(-1.0, 1.0, 4 * 64, dtype=jnp.float32).reshape(4, 64)


def make_mesh(types: str) -> jax.sharding.Mesh:
    axis = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[types]
    return jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(axis, axis))


def config(root: Path) -> jax_mlpo.OffloadConfig:
    """A host cache of about three blobs of AdamW's, so the state's subgroups live on the tier."""
    return jax_mlpo.OffloadConfig(
        host_cache=3 * 8 * SUB, subgroup_size=SUB, prefetch_depth=1,
        tiers=[jax_mlpo.FileTier(str(root), sync=False)],
    )  # fmt: skip


def constrain(tree, specs, mesh):
    """The params on the mesh inside a jitted function: ``reshard`` with Explicit axes (their
    types), a sharding constraint with Auto axes."""
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    if mesh.axis_types[0] == AxisType.Explicit:
        return jax.sharding.reshard(tree, shardings)
    return jax.lax.with_sharding_constraint(tree, shardings)


def largest_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))  # fmt: skip


def blobs(root: Path) -> list[Path]:
    return sorted(root.rglob("state-*.blob"))


def layout_as_asked(opt_state, mesh) -> bool:
    """Whether the engine behind ``opt_state`` is laid out by the shards of :data:`SPECS`."""
    plan = runtime.mesh_plan_of(find_offloaded(opt_state)[0])
    asked = [SPECS[k] for k in sorted(SPECS)]  # the params' flattened order
    return plan is not None and all(
        NamedSharding(plan.mesh, s).is_equivalent_to(NamedSharding(mesh, a), len(shape))
        for s, a, shape in zip(plan.specs, asked, plan.shapes, strict=True)
    )


def handle_of_state(opt_state) -> jax.Array:
    return handle_of(find_offloaded(opt_state)[0])


# -- linen ---------------------------------------------------------------------------------------

MODEL = nn.Dense(128)


def linen_loss(params, batch):
    return jnp.mean(jnp.square(MODEL.apply({"params": params}, batch) - 0.5))


@jax.jit
def linen_step(state, batch):
    return state.apply_gradients(grads=jax.grad(linen_loss)(state.params, batch))


def linen_create(tx, mesh, place: bool = True):
    params = MODEL.init(jax.random.key(0), X)["params"]
    if place:  # on the mesh before the optimizer's init sees them
        params = constrain(params, SPECS, mesh)
    return train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)


def out_shardings(create, mesh):
    """The params' shardings where the specs name them, every other array replicated."""
    abstract = jax.eval_shape(create)
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
    params = jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS)
    return replicated.replace(params=params)


def linen_train(state):
    for i in range(STEPS):
        state = linen_step(state, X * (i + 1))
    return jax.block_until_ready(state)


def linen(root: Path, types: str) -> dict:
    mesh = make_mesh(types)
    tx = jax_mlpo.adamw(LR, weight_decay=0.1, offload=config(root / "tier"))
    out = {}
    with jax.set_mesh(mesh):
        create = functools.partial(linen_create, tx, mesh)
        shardings = out_shardings(create, mesh)
        init = jax.jit(create, out_shardings=shardings)
        state = init()
        asked = zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True)
        out["shardings_as_asked"] = all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in asked)
        out["handle_shape"] = list(handle_of_state(state.opt_state).shape)
        out["layout_as_asked"] = layout_as_asked(state.opt_state, mesh)
        jitted = linen_train(state)
        kept = [root / f"kept-{k}" for k in range(len(blobs(root / "tier")))]
        for blob, link in zip(blobs(root / "tier"), kept, strict=True):
            link.hardlink_to(blob)  # the first engine's files stay reachable (and their inodes)
        jax_mlpo.close(jitted.opt_state)
        # a second run of the same compiled init: an engine and tier files of its own
        again = init()
        second = linen_train(again)
        out["second_run"] = {
            "new_handle": runtime.key_of(handle_of_state(again.opt_state))
            != runtime.key_of(handle_of_state(state.opt_state)),
            "first_files": len(kept),
            "new_files": bool(blobs(root / "tier"))
            and not any(b.samefile(k) for b in blobs(root / "tier") for k in kept),
            "same_params": largest_difference(second.params, jitted.params) == 0.0,
        }
        try:
            jax_mlpo.engine_of(state.opt_state)
        except jax_mlpo.NoEngineError as e:
            out["second_run"]["first_refused"] = "was closed" in str(e) or "replaced" in str(e)
        jax_mlpo.close(second.opt_state)
        placed = jax.device_put(MODEL.init(jax.random.key(0), X)["params"], shardings.params)
        eager = linen_train(train_state.TrainState.create(apply_fn=MODEL.apply, params=placed,
                                                          tx=tx))  # fmt: skip
        jax_mlpo.close(eager.opt_state)
        reference = optax.adamw(LR, weight_decay=0.1)
        make = functools.partial(linen_create, reference, mesh)
        theirs = linen_train(jax.jit(make, out_shardings=out_shardings(make, mesh))())
    out["from_eager"] = largest_difference(jitted.params, eager.params)
    out["from_optax"] = largest_difference(jitted.params, theirs.params)
    out["params_keep_shardings"] = all(
        jitted.params[k].sharding.is_equivalent_to(shardings.params[k], jitted.params[k].ndim)
        for k in SPECS
    )
    return out


# -- nnx -----------------------------------------------------------------------------------------


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.linear = nnx.Linear(64, 128, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, SPECS["kernel"]),
                                 bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                                 SPECS["bias"]))  # fmt: skip

    def __call__(self, x):
        return self.linear(x)


@nnx.jit
def nnx_step(model, optimizer, batch):
    def loss(model):
        return jnp.mean(jnp.square(model(batch) - 0.5))

    optimizer.update(model, nnx.grad(loss)(model))


def nnx_create(tx, mesh):
    """Flax's sharded init: the state constrained to its variables' partition specs."""
    model = Model(nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, constrain(state, nnx.get_partition_spec(state), mesh))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def nnx_train(tx, mesh, jitted: bool):
    make = functools.partial(nnx_create, tx, mesh)
    model, optimizer = nnx.jit(make)() if jitted else make()
    for i in range(STEPS):
        nnx_step(model, optimizer, X * (i + 1))
    return model, optimizer


def nnx_scenario(root: Path, types: str) -> dict:
    mesh = make_mesh(types)
    tx = jax_mlpo.adamw(LR, weight_decay=0.1, offload=config(root / "tier"))
    with jax.set_mesh(mesh):
        jitted, optimizer = nnx_train(tx, mesh, jitted=True)
        out = {"handle_shape": list(handle_of_state(optimizer.opt_state).shape),
               "layout_as_asked": layout_as_asked(optimizer.opt_state, mesh),
               "tier_files": len(blobs(root / "tier"))}  # fmt: skip
        jax_mlpo.close(optimizer.opt_state)
        eager, optimizer = nnx_train(tx, mesh, jitted=False)
        jax_mlpo.close(optimizer.opt_state)
        theirs, _ = nnx_train(optax.adamw(LR, weight_decay=0.1), mesh, jitted=True)
    got = nnx.state(jitted, nnx.Param)
    out["from_eager"] = largest_difference(got, nnx.state(eager, nnx.Param))
    out["from_optax"] = largest_difference(got, nnx.state(theirs, nnx.Param))
    out["params_keep_shardings"] = all(
        x.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), x.ndim)
        for k, x in ((k, getattr(jitted.linear, k)[...]) for k in SPECS)
    )  # fmt: skip
    return out


# -- refusals ------------------------------------------------------------------------------------


def refusals(root: Path) -> dict:
    out = {}
    tx = jax_mlpo.adamw(LR, offload=config(root / "tier"))
    mesh = make_mesh("auto")
    # no jax.set_mesh, Auto axes, the params made inside: the trace cannot see the mesh
    create = functools.partial(linen_create, tx, mesh, place=False)
    # (an error raised in the program would leave the other devices in their collectives: the
    # state names it, and its first use raises it)
    state = jax.jit(create, out_shardings=out_shardings(create, mesh))()
    try:
        linen_train(state)
    except jax_mlpo.NoEngineError as e:
        out["no_mesh_at_trace"] = str(e)
    try:
        jax_mlpo.engine_of(state.opt_state)
    except jax_mlpo.NoEngineError as e:
        out["no_mesh_at_trace_engine_of"] = str(e)
    mesh = make_mesh("explicit")
    with jax.set_mesh(mesh):  # Explicit axes, placed by out_shardings only: seen replicated
        create = functools.partial(linen_create, tx, mesh, place=False)
        state = jax.jit(create, out_shardings=out_shardings(create, mesh))()
        try:
            linen_train(state)
        except ValueError as e:
            out["placed_by_out_shardings_only"] = str(e)
        jax_mlpo.close(state.opt_state)
    return out


def main(root: Path, scenarios: list[str]) -> None:
    results = {}
    for name in scenarios:
        where = root / name
        where.mkdir(parents=True, exist_ok=True)
        if name == "refusals":
            results[name] = refusals(where)
        else:
            kind, types = name.split("-")
            results[name] = {"linen": linen, "nnx": nnx_scenario}[kind](where, types)
    print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
