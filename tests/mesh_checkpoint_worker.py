"""A checkpoint of an optimizer state over params on a mesh, saved on one topology and
restored on another (spawned by tests/test_mesh.py).

Usage: mesh_checkpoint_worker.py save ROOT [PROCESS_ID]
       mesh_checkpoint_worker.py restore MESH ROOT [PROCESS_ID]

As one of several processes: ``CKPT_WORKER_PROCESSES`` and ``CKPT_WORKER_PORT`` in the
environment, ``JAX_NUM_CPU_DEVICES`` the devices of each, and the process index last.

- save: four CPU devices (one process, or two of two), params on tests/mesh_worker.py's (2, 2) mesh
  ``fsdp`` x ``tensor`` (leaves split on later dimensions, over both axes, replicated, and
  replicated over one axis). It runs :data:`SAVED_AT` updates, checkpoints, runs one more and
  writes the params after it to ``ROOT/reference.npz``: the uninterrupted run.
- restore: params on MESH (``fsdp2x2``, ``data4`` or ``none``: one device); a fresh
  ``tx.init`` with other subgroups and host cache; the checkpoint restored into it and the
  same next update. Prints a JSON line with whether the params equal the reference bit for bit.

The gradients are numpy arrays of each step, placed on the params' shardings: the same
elements on every mesh, so the update alone decides the params.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

if "CKPT_WORKER_PROCESSES" in os.environ:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{os.environ['CKPT_WORKER_PORT']}",
        num_processes=int(os.environ["CKPT_WORKER_PROCESSES"]),
        process_id=int(sys.argv[-1]),
        initialization_timeout=120,
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
# its leaf shapes and specs; importing it also arms the hang watchdog, line-buffers stdout and
# sizes XLA's CPU pools (before the first array)
import mesh_worker as mw  # noqa: E402
import parity as tt  # noqa: E402

import jax_mlpo  # noqa: E402

SAVED_AT = 3
DTYPE = jnp.bfloat16  # a master copy per leaf, beside mu and nu


def place(mesh_name: str, tree: dict) -> dict:
    if mesh_name == "none":
        return {k: jax.device_put(v, jax.devices()[0]) for k, v in tree.items()}
    shape, axes = mw.MESHES[mesh_name]
    mesh = jax.make_mesh(shape, axes, devices=jax.devices())
    return jax_mlpo.sharding.processes.place(
        tree, {k: NamedSharding(mesh, mw.SPECS[mesh_name][k]) for k in tree}
    )


def grads_of(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {k: (rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 0, s)).astype(DTYPE)
            for k, s in mw.SHAPES.items()}  # fmt: skip


def optimizer(root: Path, subgroup: int) -> optax.GradientTransformation:
    config = jax_mlpo.OffloadConfig(host_cache=5 * 12 * subgroup, subgroup_size=subgroup,
                                    tiers=[jax_mlpo.FileTier(root)])  # fmt: skip
    return jax_mlpo.adamw(tt.SCHEDULE, weight_decay=0.1, mask=tt.no_decay_on_vectors,
                          offload=config)  # fmt: skip


def step(mesh_name: str, tx, params: dict, state, k: int) -> tuple[dict, object]:
    grads = place(mesh_name, grads_of(k))
    updates, state = jax.jit(tx.update)(grads, state, params)
    return jax.jit(optax.apply_updates)(params, updates), state


def bits(params: dict) -> dict[str, np.ndarray]:
    gather = multihost_utils.process_allgather
    return {k: np.asarray(gather(v, tiled=True)).view(np.uint16) for k, v in params.items()}


def tier_of(root: Path, name: str) -> Path:
    if jax.process_count() == 1:
        return root / name
    (root / name).mkdir(exist_ok=True)
    return root / name / f"proc{jax.process_index()}"


def save(root: Path) -> None:
    tx = optimizer(tier_of(root, "tier"), 1024)
    params = place("fsdp2x2", tt.make_params(DTYPE, mw.SHAPES))
    state = tx.init(params)
    for k in range(SAVED_AT):
        params, state = step("fsdp2x2", tx, params, state, k)
    manager = jax_mlpo.checkpoint.manager(root / "ckpt")
    jax_mlpo.checkpoint.save(manager, SAVED_AT, params, state, blocking=True)
    manager.wait_until_finished()
    manager.close()
    params, state = step("fsdp2x2", tx, params, state, SAVED_AT)
    reference = bits(params)
    if jax.process_index() == 0:
        np.savez(root / "reference.npz", **reference)
    jax_mlpo.close(state)
    print(json.dumps({"saved": SAVED_AT}))


def restore(mesh_name: str, root: Path) -> None:
    tx = optimizer(tier_of(root, f"tier-{mesh_name}"), 700)
    params = place(mesh_name, tt.make_params(DTYPE, mw.SHAPES))
    state = tx.init(params)
    manager = jax_mlpo.checkpoint.manager(root / "ckpt")
    at, params, state, _ = jax_mlpo.checkpoint.restore(manager, params, state)
    manager.close()
    params, state = step(mesh_name, tx, params, state, SAVED_AT)
    got, want = bits(params), dict(np.load(root / "reference.npz"))
    differ = {k: int(np.sum(got[k] != want[k])) for k in want}
    jax_mlpo.close(state)
    print(json.dumps({"step": at, "devices": len(jax.devices()), "processes": jax.process_count(),
                      "differing_elements": differ}))  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(Path(sys.argv[2]))
    else:
        restore(sys.argv[2], Path(sys.argv[3]))
