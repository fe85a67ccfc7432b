"""One process with four CPU devices: jax_mlpo.adamw on params sharded over a mesh, against
optax (spawned by tests/test_mesh.py, since the test process itself has one device).

Usage: mesh_worker.py MESH DTYPE MODE CLIP TIER_ROOT | mesh_worker.py refusals TIER_ROOT |
mesh_worker.py cases JSON (a list of [MESH, DTYPE, MODE, CLIP, TIER_ROOT], run one after the
other in this interpreter: one start-up, one compilation of optax's reference, a line each)

As one of several processes: ``MESH_WORKER_PROCESSES`` and ``MESH_WORKER_PORT`` in the
environment, ``JAX_NUM_CPU_DEVICES`` the devices of each (the mesh takes every device of the
job), and the process index as a sixth argument.

- MESH "data4": a (4,) mesh ``data``; "fsdp2x2": a (2, 2) mesh ``fsdp`` x ``tensor``. Each leaf
  gets a spec of :data:`SPECS`: split on the first or a later dimension, over one axis or both,
  replicated, or replicated over one axis only.
- DTYPE "float32" or "bfloat16".
- MODE "jit" (a jitted train step) or "nnx" (``nnx.Optimizer``).
- CLIP "chain" (``optax.chain(optax.clip_by_global_norm(1.0), jax_mlpo.adamw(...))``) or
  "inside" (``max_grad_norm=1.0``: the norm in float32, and the reference clips in float32
  too). A bfloat16 norm is summed in an order XLA picks for the leaves' shardings, so optax's
  own chain gives other params on a mesh than on one device: bfloat16 runs clip inside.

It runs tests/test_transform.py's 50 steps and checks the params with its
``assert_matches_reference`` (optax.adamw on one device), then prints a JSON line with the
engine's state bytes, the bytes of state in the tier's blob files, and whether the params and
the updates have the params' shardings. A failed check exits non-zero with the assertion.
"""

from __future__ import annotations

import faulthandler
import json
import os
import struct
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
# A worker that hangs prints every thread's stack before the test's 300 s timeout kills it.
faulthandler.dump_traceback_later(240, exit=True)
sys.stdout.reconfigure(line_buffering=True)  # its result line shows even if it hangs after
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")  # 2 in each of 2 processes
# 4 threads per device in XLA's pools (its default, max(cores, devices), lets a device running
# two independent collectives starve another: experiments/pretrain.py says more)
os.environ.setdefault("PJRT_NPROC", str(4 * int(os.environ["JAX_NUM_CPU_DEVICES"])))

import jax  # noqa: E402

if "MESH_WORKER_PROCESSES" in os.environ:  # one of several processes
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{os.environ['MESH_WORKER_PORT']}",
        num_processes=int(os.environ["MESH_WORKER_PROCESSES"]),
        process_id=int(sys.argv[6]),
        initialization_timeout=120,
    )
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import parity as tt  # noqa: E402

import jax_mlpo  # noqa: E402

# Leaf shapes that split over 2 and 4 on the dimensions their specs name.
SHAPES = {
    "a_w": (64, 96),
    "b_v": (96, 40),
    "c_bias": (96,),
    "d_norm": (7,),
    "e_odd": (3, 5),
    "f_row": (8, 96),
}
NUM_PARAMS = sum(int(np.prod(s)) for s in SHAPES.values())
SPECS = {
    "data4": {"a_w": P("data"), "b_v": P(None, "data"), "c_bias": P("data"), "d_norm": P(),
              "e_odd": P(), "f_row": P(None, "data")},
    "fsdp2x2": {"a_w": P("fsdp", "tensor"), "b_v": P(None, "tensor"),
                "c_bias": P(("fsdp", "tensor")), "d_norm": P(), "e_odd": P(),
                "f_row": P("fsdp")},
}  # fmt: skip
MESHES = {"data4": ((4,), ("data",)), "fsdp2x2": ((2, 2), ("fsdp", "tensor"))}


def main(mesh_name: str, dtype_name: str, mode: str, clip: str, tier_root: str) -> None:
    shape, axes = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, axes, devices=jax.devices())
    shardings = {k: NamedSharding(mesh, spec) for k, spec in SPECS[mesh_name].items()}
    dtype = jnp.dtype(dtype_name)
    per_elem = 12 if dtype == jnp.bfloat16 else 8
    config = jax_mlpo.OffloadConfig(
        host_cache=3 * per_elem * 1024, tiers=[jax_mlpo.FileTier(tier_root)],
        subgroup_size=1024, prefetch_depth=1,
    )  # fmt: skip
    if clip == "chain":
        tx = tt.offloaded_adamw(config)
    else:
        tx = jax_mlpo.adamw(tt.SCHEDULE, weight_decay=0.1, mask=tt.no_decay_on_vectors,
                            offload=config, max_grad_norm=1.0)  # fmt: skip
    params = jax_mlpo.sharding.processes.place(tt.make_params(dtype, SHAPES), shardings)
    # what this process holds of each leaf, once per distinct shard (from jax's own shards)
    held = {k: {str(s.index): s.data.size for s in x.addressable_shards} for k, x in params.items()}
    distinct = sum(sum(sizes.values()) for sizes in held.values())
    out_shardings = None
    if mode == "nnx":
        model = nnx.Dict({k: nnx.Param(v) for k, v in params.items()})
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def nnx_step(model, optimizer, i):
            grads = nnx.grad(lambda m: tt.loss_fn({k: m[k][...] for k in SHAPES}, i))(model)
            optimizer.update(model, grads)

        for i in range(tt.STEPS):
            nnx_step(model, optimizer, i)
        engine = jax_mlpo.engine_of(optimizer.opt_state)
        state_bytes = engine.layout.state_bytes
        jax_mlpo.close(optimizer.opt_state)
        params = {k: model[k][...] for k in SHAPES}
    else:
        state = tx.init(params)

        # The step returns its loss, as train steps do: the loss's reduction over the mesh is
        # a collective no input of the update needs, which XLA may run on one device before
        # the update and on another after it.
        @jax.jit
        def step(params, state, i):
            loss, grads = jax.value_and_grad(tt.loss_fn)(params, i)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, updates, loss

        for i in range(tt.STEPS):
            params, state, updates, loss = step(params, state, i)
        assert np.isfinite(float(loss))
        out_shardings = {
            k: u.sharding.is_equivalent_to(shardings[k], u.ndim) for k, u in updates.items()
        }
        engine = jax_mlpo.engine_of(state)
        state_bytes = engine.layout.state_bytes
        jax_mlpo.close(state)
    tiers = Path(tier_root)
    if jax.process_count() > 1:
        tiers = tiers / f"proc{jax.process_index()}"
    blobs = list(tiers.glob("state-*.blob"))
    on_tier = sum(struct.unpack_from("<8sQ", p.read_bytes(), -4096)[1] for p in blobs)
    kept = {k: params[k].sharding.is_equivalent_to(shardings[k], params[k].ndim) for k in SHAPES}
    gather = multihost_utils.process_allgather
    got = {k: np.asarray(gather(v, tiled=True)) for k, v in params.items()}
    tt.assert_matches_reference(got, dtype, clip_in_float32=clip == "inside", shapes=SHAPES)
    print(json.dumps({
        "state_bytes": state_bytes, "distinct_params": distinct, "per_elem": per_elem,
        "tier_bytes": on_tier, "params_keep_shardings": kept,
        "updates_keep_shardings": out_shardings, "devices": len(mesh.devices.flat),
        "processes": jax.process_count(), "all_params": NUM_PARAMS,
    }))  # fmt: skip


def refusals(tier_root: str) -> None:
    """Prints the errors for params on two meshes and a leaf on one device beside a mesh."""
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices())
    pair = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    config = jax_mlpo.OffloadConfig(host_cache="1MiB", tiers=[jax_mlpo.FileTier(tier_root)])
    tx = jax_mlpo.adamw(1e-3, offload=config)
    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    out = {}
    for name, other in [
        ("two_meshes", jax.device_put(jnp.ones(4), NamedSharding(pair, P()))),
        ("one_device_leaf", jax.device_put(jnp.ones(4), jax.devices()[1])),
    ]:
        try:
            tx.init({"a": w, "b": other})
        except ValueError as e:
            out[name] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "refusals":
        refusals(sys.argv[2])
    elif sys.argv[1] == "cases":
        for case in json.loads(sys.argv[2]):
            main(*case)
    else:
        main(*sys.argv[1:6])
