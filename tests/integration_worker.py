"""A user's training loop with jax_mlpo swapped in, run in its own interpreter (four CPU devices).

The loop is written the way Flax's own examples write theirs: a Flax NNX model (or a linen
``TrainState``) on a ``("fsdp", "tensor")`` mesh, a jitted train step that donates model and
optimizer, and the loop's own orbax ``CheckpointManager`` (a preservation policy, orbax's
commit-file temporary paths, async saves), with only the optimizer and the checkpoint args
swapped for jax_mlpo's.

Usage: ``python integration_worker.py KIND OPTIMIZER PHASE WORKDIR [KIND OPTIMIZER PHASE
WORKDIR ...]``: each loop in turn, in this interpreter (tests/loops.py runs them).

- KIND: ``nnx`` (``nnx.Optimizer``, saving ``{"model", "optimizer", "step"}`` of
  ``nnx.state``) or ``linen`` (a ``flax.training.train_state.TrainState``).
- OPTIMIZER: ``optax`` (``optax.adamw``, ``StandardSave``) or ``mlpo`` (``jax_mlpo.adamw``,
  ``OffloadSave``) or ``mlpo-plain`` (``jax_mlpo.adamw`` saved with orbax's ``StandardSave``);
  ``optax-inject`` and ``mlpo-inject``: each wrapped in ``optax.inject_hyperparams``;
  ``optax-lion`` and ``mlpo-lion``: ``optax.lion`` and ``jax_mlpo.lion`` instead of AdamW;
  ``optax-muon`` and ``mlpo-muon``: ``optax.contrib.muon`` and ``jax_mlpo.muon``.
- PHASE: ``all`` (STEPS steps), ``first`` (SAVE_AT steps, saving every step), ``resume``
  (restores the latest checkpoint into a fresh model and optimizer, then runs to STEPS).

Prints one JSON line per loop: the params after the last step (as lists) and what the phase
saw.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import linen, nnx  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_mlpo  # noqa: E402

STEPS, SAVE_AT = 6, 3
WIDTH, HIDDEN = 16, 32
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, STEPS, 3e-3)


def make_optimizer(name: str, workdir: str) -> optax.GradientTransformation:
    kwargs = dict(b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    if name.endswith("lion"):
        kwargs.pop("eps")
    if name.endswith("muon"):
        kwargs = dict(beta=0.9, eps=1e-9, weight_decay=0.1, adam_b2=0.98, adam_weight_decay=0.1)
    if name == "optax":
        inner = optax.adamw(SCHEDULE, **kwargs)
    elif name == "optax-lion":
        inner = optax.lion(SCHEDULE, **kwargs)
    elif name == "optax-muon":
        inner = optax.contrib.muon(SCHEDULE, **kwargs)
    elif name == "optax-inject":
        inner = optax.inject_hyperparams(optax.adamw)(SCHEDULE, **kwargs)
    else:
        config = jax_mlpo.OffloadConfig(
            host_cache=3 * 8 * 256, subgroup_size=256, prefetch_depth=1,
            tiers=[jax_mlpo.FileTier(os.path.join(workdir, f"tier-{os.getpid()}"))],
        )  # fmt: skip
        factory = {"mlpo-lion": jax_mlpo.lion, "mlpo-muon": jax_mlpo.muon}.get(name, jax_mlpo.adamw)
        if name == "mlpo-inject":  # the schedule and the floats as per-step arrays
            factory = optax.inject_hyperparams(jax_mlpo.adamw)
        inner = factory(SCHEDULE, offload=config, **kwargs)
    return optax.chain(optax.clip_by_global_norm(1.0), inner)


def batch(step: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((8, WIDTH)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.tanh(x[:, ::-1] * 1.5))


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class LinenMlp(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(WIDTH)(jax.nn.gelu(linen.Dense(HIDDEN)(x)))


def spec(x: jax.Array) -> P:
    """fsdp x tensor sharding, as Flax's examples shard an MLP: the first layer's kernel
    (fsdp, tensor), the second's (tensor, fsdp), each bias as its layer's output."""
    first = x.shape[-1] == HIDDEN
    axes = ("fsdp", "tensor") if first else ("tensor", "fsdp")
    return P(*axes) if x.ndim == 2 else P(axes[1])


def shard(tree, mesh):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), tree)


def manager(workdir: str) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(n=2),
        temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath,
        enable_async_checkpointing=True,
    )
    return ocp.CheckpointManager(os.path.join(workdir, "ckpt"), options=options)


def save_args(item, optimizer: str):
    if optimizer.startswith("mlpo") and optimizer != "mlpo-plain":
        return jax_mlpo.checkpoint.OffloadSave(item)
    return ocp.args.StandardSave(item)


def restore_args(target, optimizer: str):
    if optimizer.startswith("mlpo") and optimizer != "mlpo-plain":
        return jax_mlpo.checkpoint.OffloadRestore(target)
    return ocp.args.StandardRestore(target)


def run_nnx(optimizer_name: str, phase: str, workdir: str, mesh) -> dict:
    # the engines open before this loop (held, so that no new engine takes one's id)
    opened = list(jax_mlpo.transforms.runtime.RUNTIME.open_engines())
    tx = make_optimizer(optimizer_name, workdir)
    model = Mlp(nnx.Rngs(0))
    nnx.update(model, shard(nnx.state(model), mesh))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    mngr = manager(workdir)
    start = 0
    if phase == "resume":
        start = mngr.latest_step()
        target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "step": 0}
        restored = mngr.restore(start, args=restore_args(target, optimizer_name))
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["optimizer"])
        start = int(restored["step"])

    @nnx.jit(donate_argnames=("model", "optimizer"))
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    end = SAVE_AT if phase == "first" else STEPS
    losses = []
    for step in range(start, end):
        losses.append(float(train_step(model, optimizer, *batch(step))))
        if phase == "first":
            item = {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "step": step + 1}
            mngr.save(step + 1, args=save_args(item, optimizer_name))
    mngr.wait_until_finished()
    params = nnx.state(model, nnx.Param)
    out = {"params": _flat(params), "losses": losses, "steps": mngr.all_steps()}
    if optimizer_name.startswith("mlpo"):  # the host updates and engines of this loop
        out["updates_run"] = len(jax_mlpo.metrics(optimizer.opt_state))
        engines = {id(e) for e in jax_mlpo.transforms.runtime.RUNTIME.open_engines()}
        out["engines"] = len(engines - {id(e) for e in opened})  # opened by this loop
    mngr.close()
    return out


def run_linen(optimizer_name: str, phase: str, workdir: str, mesh) -> dict:
    tx = make_optimizer(optimizer_name, workdir)
    module = LinenMlp()
    params = shard(module.init(jax.random.key(0), batch(0)[0])["params"], mesh)
    state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)
    mngr = manager(workdir)
    if phase == "resume":
        state = mngr.restore(mngr.latest_step(), args=restore_args(state, optimizer_name))

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    train_step = jax.jit(train_step, donate_argnums=0)
    end = SAVE_AT if phase == "first" else STEPS
    losses = []
    for step in range(int(state.step), end):
        state, loss = train_step(state, *batch(step))
        losses.append(float(loss))
        if phase == "first":
            mngr.save(step + 1, args=save_args(state, optimizer_name))
    mngr.wait_until_finished()
    out = {"params": _flat(state.params), "losses": losses, "steps": mngr.all_steps()}
    if optimizer_name.startswith("mlpo"):  # the host updates this process ran
        out["updates_run"] = len(jax_mlpo.metrics(state.opt_state))
    mngr.close()
    return out


def _flat(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(x).ravel().tolist() for p, x in leaves}


def main(argv: list[str]) -> None:
    if not argv or len(argv) % 4:
        raise SystemExit(f"usage: KIND OPTIMIZER PHASE WORKDIR, once per loop; got {argv}")
    auto = (jax.sharding.AxisType.Auto,) * 2  # XLA propagates the activations' shardings
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=auto, devices=jax.devices())
    for at in range(0, len(argv), 4):
        kind, optimizer_name, phase, workdir = argv[at : at + 4]
        run = run_nnx if kind == "nnx" else run_linen
        with jax.set_mesh(mesh):  # as Flax's examples build and train their models
            out = run(optimizer_name, phase, workdir, mesh)
        out["devices"] = jax.device_count()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
