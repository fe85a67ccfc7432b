"""The overlapped step on a mesh, in a process of its own (the device count is fixed at start).

``python overlap_mesh_worker.py DIR SCENARIO...`` runs, for each scenario, on its mesh, the
plain loop and the overlapped loop with ``jax_mlpo.adamw`` (unclipped, with its fused
``max_grad_norm``, and after ``optax.clip_by_global_norm`` in a chain) and the plain loop with
``optax.adamw``, then one overlapped step with a
tier read held until the forward pass's first layer has run, and prints one JSON line (by
scenario):

- ``bit_for_bit``: per clipping setting (``none``, ``fused``: ``max_grad_norm``, ``chain``:
  ``optax.clip_by_global_norm`` in a chain), whether the overlapped params equal the plain loop's;
- ``plain_err``: per clipping setting, the largest difference from the plain loop's params;
- ``optax_err``: per clipping setting, the largest difference from optax's params;
- ``beside``: each overlapped update's ``beside_s`` (> 0: it was split into groups);
- ``first_layer_before_last_read``: at each run of the first layer's forward pass in one
  overlapped step, whether the read of the last subgroup in forward order (held) had not ended
  yet (all true: the forward pass ran beside the update, not after it);
- ``shardings``: whether the params kept their shardings.

Scenarios: ``explicit2x2`` (4 devices, Explicit axes, ``jax.set_mesh``, einsums with
``out_sharding``), ``explicit1x1`` (1 device), ``auto2x2`` (4 devices, Auto axes, no context
mesh), ``nnx2x2`` (an ``nnx.Optimizer`` over an NNX model on an Explicit 2x2 mesh). The
1-device scenario runs in a process of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading

ROOT, SCENARIOS = sys.argv[1], sys.argv[2:]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "1" if SCENARIOS == ["explicit1x1"] else "4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_mlpo  # noqa: E402
from jax_mlpo.testing import tier_faults  # noqa: E402
from jax_mlpo.transforms.overlap import read_shardings, tree_sharded_as_read  # noqa: E402

SUB = 512
LR, WD, CLIP = 1e-2, 0.1, 0.05
STEPS = 5
# the scenario being run: whether its axes are Explicit, and its mesh
EXPLICIT = True
MESH: jax.sharding.Mesh


def use_scenario(name: str) -> None:
    global EXPLICIT, MESH
    EXPLICIT = name != "auto2x2"
    shape = (1, 1) if name == "explicit1x1" else (2, 2)
    axis = AxisType.Explicit if EXPLICIT else AxisType.Auto
    MESH = jax.make_mesh(shape, ("fsdp", "tensor"), axis_types=(axis,) * 2)


# the leaves' pytree order (a_out first) is against the forward order (b_in first)
SPECS = {"b_in": P("fsdp", "tensor"), "c_mid": P(None, "tensor"), "a_out": P("tensor", None)}
SHAPES = {"b_in": (32, 64), "c_mid": (64, 64), "a_out": (64, 32)}


def config(tier: str, **switches) -> jax_mlpo.OffloadConfig:
    # the host cache holds 3 of the state's subgroups: the others stream through the tier
    return jax_mlpo.OffloadConfig(
        host_cache=3 * 8 * SUB, subgroup_size=SUB, prefetch_depth=1, placement="even",
        read_ahead=False, tiers=[jax_mlpo.FileTier(tier, sync=False)], **switches,
    )  # fmt: skip


def mesh_context():
    return jax.set_mesh(MESH) if EXPLICIT else contextlib.nullcontext()


def batch(i: int) -> tuple[jax.Array, jax.Array]:
    key = jax.random.key(100 + i)
    x, y = jax.random.normal(key, (16, 32)), jax.random.normal(jax.random.fold_in(key, 1), (16, 32))
    put = functools.partial(jax.device_put, device=NamedSharding(MESH, P("fsdp", None)))
    return put(x), put(y)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    if EXPLICIT:
        return jnp.einsum("bi,io->bo", x, w, out_sharding=P("fsdp", None))
    return x @ w


def forward(params, x, probe=None):
    h = jnp.tanh(dense(x, params["b_in"]))
    if probe is not None:
        jax.debug.callback(probe, h, partitioned=True)
    h = jnp.tanh(dense(h, params["c_mid"]))
    return dense(h, params["a_out"])


def loss_fn(params, b, probe=None):
    x, y = b
    return jnp.mean((forward(params, x, probe) - y) ** 2)


def init_params():
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    return {
        k: jax.device_put(jax.random.normal(key, SHAPES[k]) * 0.2, NamedSharding(MESH, SPECS[k]))
        for key, k in zip(keys, SHAPES, strict=True)
    }


def adamw(tier: str | None, clip: str):
    """``clip``: ``"none"``, ``"fused"`` (``max_grad_norm``) or ``"chain"``
    (``optax.clip_by_global_norm`` before it); ``tier`` None: optax's own AdamW."""
    if tier is None:
        tx = optax.adamw(LR, weight_decay=WD)
        return tx if clip == "none" else optax.chain(optax.clip_by_global_norm(CLIP), tx)
    fused = CLIP if clip == "fused" else None
    tx = jax_mlpo.adamw(LR, weight_decay=WD, max_grad_norm=fused, offload=config(tier))
    return optax.chain(optax.clip_by_global_norm(CLIP), tx) if clip == "chain" else tx


def plain(tx):
    params = init_params()
    state = tx.init(params)

    @jax.jit
    def step(params, state, b):
        grads = jax.grad(loss_fn)(params, b)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(STEPS):
        params, state = step(params, state, batch(i))
    return params, state


def overlapped(tx, probe_steps=()):
    """The overlapped loop; also whether the gradients it carried between steps were sharded
    as their params, where the update reads them (the first step's are constrained so)."""
    params = init_params()
    state = tx.init(params)
    read_as = read_shardings(params)
    step = jax.jit(
        lambda p, s, g, b, probe: jax_mlpo.overlapped_step(
            functools.partial(loss_fn, probe=probe), tx, p, s, g, b, groups=3
        ),
        static_argnums=4,
    )
    first = jax.jit(lambda p, b: tree_sharded_as_read(jax.grad(loss_fn)(p, b), read_as))
    pending = first(params, batch(0))
    as_params = True
    for i in range(1, STEPS):
        probe = probe_steps[i] if i < len(probe_steps) else None
        params, state, pending, _ = step(params, state, pending, batch(i), probe)
        jax.block_until_ready(pending)
        as_params &= all(
            g.sharding.is_equivalent_to(p.sharding, g.ndim)
            for g, p in zip(jax.tree.leaves(pending), jax.tree.leaves(params), strict=True)
        )
    updates, state = jax.jit(tx.update)(pending, state, params)
    return optax.apply_updates(params, updates), state, as_params


def bits_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))  # fmt: skip


def max_err(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))  # fmt: skip


def held_order(tier: str) -> list[bool]:
    """One overlapped step with the read of the last subgroup its update reads held until the
    forward pass's first layer has run on every device (or 60 s): at each run of that layer
    (one per device where the callback is partitioned), whether that read was still to
    finish. Had the forward pass waited for the whole update, the read would have ended at its
    limit first."""
    # every update in the forward order (the engine could choose to alternate it)
    tx = jax_mlpo.adamw(LR, weight_decay=WD, offload=config(tier, overlap_order="forward"))
    params = init_params()
    state = tx.init(params)
    engine = jax_mlpo.engine_of(state)
    last = -1  # set once the first update gave the engine its order
    unfinished: list[bool] = []
    armed: dict[str, object] = {"plan": None}

    seen = threading.Lock()  # the devices' callbacks may run at once

    def first_layer_ran(_):
        plan = armed["plan"]
        if plan is None:
            return
        with seen:
            started = any(e.op == "read" and e.slot == last for e in plan.trace)
            unfinished.append(plan.hanging > 0 or not started)
            every_device = len(unfinished) == MESH.size
        if every_device:  # released before, a later device would find the read done
            plan.release()

    step = jax.jit(lambda p, s, g, b: jax_mlpo.overlapped_step(
        functools.partial(loss_fn, probe=first_layer_ran), tx, p, s, g, b, groups=3))  # fmt: skip
    pending = jax.jit(jax.grad(loss_fn))(params, batch(0))
    params, state, pending, _ = step(params, state, pending, batch(1))  # the order learned
    jax.block_until_ready(pending)
    order = engine.order.of_step(engine.step_count)  # what the last update kept comes first
    last = order[-1]
    assert last not in engine.order.kept
    with tier_faults(state) as plan:
        plan.hang("read", slot=last, limit_s=60)
        armed["plan"] = plan
        params, state, pending, _ = step(params, state, pending, batch(2))
        jax.block_until_ready((params, pending))
        armed["plan"] = None
        read = [e.outcome for e in plan.trace if e.op == "read" and e.slot == last]
    jax_mlpo.close(state)
    assert read, "the last subgroup was not read from the tier: nothing was held"
    return unfinished


def fault_and_resume(root: str) -> dict[str, bool]:
    """A tier write failing in an overlapped step on the mesh: whether the step raised the
    tier's typed error, the engine refused to go on, and the last checkpoint (an orbax
    ``CheckpointManager`` with ``OffloadSave``) resumed to the uninterrupted plain loop's
    params, bit for bit."""
    import errno

    import orbax.checkpoint as ocp

    def step_fn(tx):
        return jax.jit(lambda p, s, g, b: jax_mlpo.overlapped_step(loss_fn, tx, p, s, g, b,
                                                                   groups=3))  # fmt: skip

    def overlapped_from(tx, params, state, start: int, stop: int):
        step = step_fn(tx)
        pending = jax.jit(jax.grad(loss_fn))(params, batch(start))
        for i in range(start + 1, stop):
            params, state, pending, _ = step(params, state, pending, batch(i))
        updates, state = jax.jit(tx.update)(pending, state, params)
        return optax.apply_updates(params, updates), state

    os.makedirs(root)
    tx = jax_mlpo.adamw(LR, weight_decay=WD, offload=config(f"{root}/run", write_behind=False))
    params, state = overlapped_from(tx, init_params(), tx.init(init_params()), 0, 2)
    mngr = ocp.CheckpointManager(f"{root}/ckpt")
    mngr.save(2, args=jax_mlpo.checkpoint.OffloadSave({"params": params, "opt": state}))
    mngr.wait_until_finished()
    engine = jax_mlpo.engine_of(state)
    pending = jax.jit(jax.grad(loss_fn))(params, batch(2))
    typed = False
    with tier_faults(state) as plan:
        plan.fail("write", nth=2, errno=errno.EIO)
        try:
            with jax_mlpo.errors.typed():
                jax.block_until_ready(step_fn(tx)(params, state, pending, batch(3)))
        except jax_mlpo.TierIOError as e:
            typed = "Input/output error" in str(e)
    failed = engine.failed
    engine.close()
    tx = jax_mlpo.adamw(LR, weight_decay=WD, offload=config(f"{root}/run", write_behind=False))
    target = {"params": init_params(), "opt": tx.init(init_params())}
    restored = mngr.restore(2, args=jax_mlpo.checkpoint.OffloadRestore(target))
    mngr.close()
    params, state = overlapped_from(tx, restored["params"], restored["opt"], 2, STEPS)
    jax_mlpo.close(state)
    expected, state = plain(adamw(f"{root}/uninterrupted", clip="none"))
    jax_mlpo.close(state)
    return {"typed_error": typed, "engine_failed": failed, "resumed": bits_equal(params, expected)}


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.2)
        self.b_in = nnx.Linear(
            32,
            64,
            use_bias=False,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")),
        )
        self.c_mid = nnx.Linear(
            64,
            64,
            use_bias=False,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, (None, "tensor")),
        )
        self.a_out = nnx.Linear(
            64,
            32,
            use_bias=False,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("tensor", None)),
        )

    def __call__(self, x):
        h = jnp.tanh(dense(x, self.b_in.kernel[...]))
        h = jnp.tanh(dense(h, self.c_mid.kernel[...]))
        return dense(h, self.a_out.kernel[...])


def nnx_loss(model: Model, b) -> jax.Array:
    x, y = b
    return jnp.mean((model(x) - y) ** 2)


def nnx_run(tx, overlap: bool):
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def plain_step(model, optimizer, b):
        optimizer.update(model, nnx.grad(nnx_loss)(model, b))

    @nnx.jit
    def step(model, optimizer, pending, b):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of(pure, b):
            nnx.replace_by_pure_dict(params, pure)
            return nnx_loss(nnx.merge(graphdef, params, rest), b)

        new, opt_state, grads, _ = jax_mlpo.overlapped_step(
            loss_of, optimizer.tx, params.to_pure_dict(), nnx.as_pure(optimizer.opt_state),
            pending, b, groups=3,
        )  # fmt: skip
        nnx.replace_by_pure_dict(params, new)
        nnx.update(model, params)
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
        optimizer.step[...] += 1
        return grads

    @nnx.jit
    def flush(model, optimizer, pending):
        grads = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(grads, pending)
        optimizer.update(model, grads)

    if not overlap:
        for i in range(STEPS):
            plain_step(model, optimizer, batch(i))
    else:
        pending = nnx.jit(lambda m, b: nnx.grad(nnx_loss)(m, b).to_pure_dict())(model, batch(0))
        for i in range(1, STEPS):
            pending = step(model, optimizer, pending, batch(i))
        flush(model, optimizer, pending)
    return nnx.as_pure(nnx.state(model, nnx.Param)), optimizer.opt_state


def run_scenario(name: str) -> dict[str, object]:
    use_scenario(name)
    root = f"{ROOT}/{name}"
    out: dict[str, object] = {"bit_for_bit": {}, "plain_err": {}, "optax_err": {}, "beside": {}}
    with mesh_context():
        for kind in ("none", "fused", "chain"):
            clip = kind
            if name == "nnx2x2":
                expected, state = nnx_run(adamw(f"{root}-{kind}-a", clip), overlap=False)
                jax_mlpo.close(state)
                got, state = nnx_run(adamw(f"{root}-{kind}-b", clip), overlap=True)
                reference, _ = nnx_run(adamw(None, clip), overlap=False)
            else:
                expected, state = plain(adamw(f"{root}-{kind}-a", clip))
                jax_mlpo.close(state)
                got, state, as_params = overlapped(adamw(f"{root}-{kind}-b", clip))
                out["grads_as_params"] = out.get("grads_as_params", True) and as_params
                reference, _ = plain(adamw(None, clip))
                out["shardings"] = all(got[k].sharding.spec == SPECS[k] for k in SPECS)
            out["beside"][kind] = [m.beside_s for m in jax_mlpo.metrics(state)]
            jax_mlpo.close(state)
            out["bit_for_bit"][kind] = bits_equal(got, expected)
            out["plain_err"][kind] = max_err(got, expected)
            out["optax_err"][kind] = max_err(got, reference)
        if name != "nnx2x2":
            out["first_layer_before_last_read"] = held_order(f"{root}-held")
            out["devices"] = MESH.size
        if name == "explicit2x2":
            out["fault"] = fault_and_resume(f"{root}-fault")
    return out


def main() -> None:
    print(json.dumps({name: run_scenario(name) for name in SCENARIOS}))


if __name__ == "__main__":
    main()
