"""One process of a data-parallel jax_mlpo run (spawned by tests/test_distributed.py).

Usage: dist_worker.py PROCESS_ID NUM_PROCESSES PORT TIER_ROOT OUT_DIR STEPS [MODE]

Trains a small MLP for STEPS steps with optax.chain(clip_by_global_norm, jax_mlpo.adamw) on two
file tiers under TIER_ROOT, on a global batch of GLOBAL_BATCH rows split over the processes.
With NUM_PROCESSES == 1 it is the single-process reference (no jax.distributed). Process 0
writes the final params (gathered) to OUT_DIR/params.npz; every process writes
OUT_DIR/proc<k>.json with its engine's state bytes and tier directories.

MODE "overlap": jax_mlpo.overlapped_step, each step's gradients updated beside the next step's
forward pass; at step HELD_STEP every process holds its update's last read until its first
matmul has run and writes whether that read was still to finish then. MODE "fused-clip" or
"no-clip" (and "overlap-fused-clip", "overlap-no-clip"): adamw's ``max_grad_norm`` instead of
the chained clip, or no clipping.

MODE "inject": jax_mlpo.adamw wrapped in optax.inject_hyperparams (the transformation re-created
inside every update). MODE "muon": jax_mlpo.muon instead (Newton-Schulz on the momenta sharded
over the processes).

MODE "node-permits" or "process-permits": the slow tier gets max_concurrency=1 and a bandwidth
cap (so that each request lasts a few ms), with node_max_concurrency=1 (permits shared by the
processes, lock files in TIER_ROOT/../permits) or without; every process records its tiers'
request traces (time.monotonic, comparable across the processes of a machine) into its JSON.

MODE "s3": the slow tier is an ObjectTier at JAX_MLPO_TEST_S3_ENDPOINT, bucket
JAX_MLPO_TEST_S3_BUCKET (prefix dist/, per process dist/proc<k>/), credentials from the
environment.
"""

from __future__ import annotations

import functools
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "1"  # one device per process

import jax  # noqa: E402

GLOBAL_BATCH = 16
HELD_STEP = 3  # MODE "overlap": the step whose update's last read is held (see main)
# First dimensions 64, 64 and 16 split over 1, 2 or 4 processes; "odd" (3, 5) is replicated.
SHAPES = {"w1": (64, 64), "b1": (64,), "w2": (64, 16), "b2": (16,), "odd": (3, 5)}


def init_params():
    import numpy as np

    rng = np.random.RandomState(0)
    return {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in SHAPES.items()}


def batch(step: int):
    import numpy as np

    rng = np.random.RandomState(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, 64)).astype(np.float32)
    y = rng.standard_normal((GLOBAL_BATCH, 16)).astype(np.float32)
    return x, y


def loss_fn(params, x, y, probe=None):
    """``probe``: called on every process, with its rows, once the first matmul has run."""
    import jax.numpy as jnp

    z = x @ params["w1"]
    if probe is not None:
        jax.debug.callback(probe, z, partitioned=True)
    h = jnp.tanh(z + params["b1"])
    out = h @ params["w2"] + params["b2"] + jnp.sum(params["odd"] ** 2)
    return jnp.mean((out - y) ** 2)


def make_tx(offload, total_steps: int, clip_by: str = "chain", inject: bool = False):
    """The job's optimizer: clipped jax_mlpo.adamw with a linear schedule and a decay mask.

    ``clip_by``: ``"chain"`` (``optax.clip_by_global_norm`` before it), ``"fused"`` (adamw's
    ``max_grad_norm``, the norm then taken over every process's shards) or ``"none"``.
    ``inject``: adamw wrapped in ``optax.inject_hyperparams`` (the mask static).
    """
    import optax

    import jax_mlpo

    clip = 0.05  # below the gradients' norm: the clip is active
    factory = jax_mlpo.adamw
    if inject:
        factory = optax.inject_hyperparams(jax_mlpo.adamw, static_args=("mask",))
    adamw = functools.partial(
        factory,
        optax.linear_schedule(1e-2, 1e-3, total_steps),
        weight_decay=0.1,
        mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
        offload=offload,
    )
    if clip_by == "fused":
        return adamw(max_grad_norm=clip)
    if clip_by == "none":
        return adamw()
    return optax.chain(optax.clip_by_global_norm(clip), adamw())


def main() -> None:
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    tier_root, out_dir, steps = sys.argv[4], sys.argv[5], int(sys.argv[6])
    mode = sys.argv[7] if len(sys.argv) > 7 else "plain"
    modes = ("plain", "fused-clip", "no-clip", "inject", "node-permits", "process-permits", "s3",
             "muon", "overlap", "overlap-fused-clip", "overlap-no-clip")  # fmt: skip
    if mode not in modes:
        raise SystemExit(f"unknown MODE {mode!r}")
    if nproc > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=nproc,
            process_id=pid,
            initialization_timeout=60,
        )
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import jax_mlpo
    from jax_mlpo.config import Bandwidth, TierLimits
    from jax_mlpo.sharding import processes as distributed
    from jax_mlpo.testing import tier_faults

    slow = {}
    if "permits" in mode:
        # One request at a time per process, each paced to ~2.5 ms (512-byte blobs at 200 kB/s)
        # so that two processes' requests overlap unless node-level permits serialize them.
        slow = dict(max_concurrency=1, bandwidth_cap="200kB")
        if mode == "node-permits":
            slow["node_max_concurrency"] = 1
    slow_tier = jax_mlpo.FileTier(os.path.join(tier_root, "slow"), TierLimits(**slow),
                                  Bandwidth("1GB", "1GB"), sync=False)  # fmt: skip
    if mode == "s3":  # the slow tier is an object store (test_object_tier's moto_server)
        slow_tier = jax_mlpo.ObjectTier(
            f"s3://{os.environ['JAX_MLPO_TEST_S3_BUCKET']}/dist/", region="us-east-1",
            endpoint=os.environ["JAX_MLPO_TEST_S3_ENDPOINT"], bandwidth=Bandwidth("1GB", "1GB"),
        )  # fmt: skip
    offload = jax_mlpo.OffloadConfig(
        # smaller than every process's state: subgroups go to the tiers (muon: its engines'
        # pipelines need twice that)
        host_cache="8KiB" if mode == "muon" else "4KiB",
        tiers=[
            jax_mlpo.FileTier(os.path.join(tier_root, "fast"), bandwidth=Bandwidth("2GB", "2GB"),
                              sync=False),
            slow_tier,
        ],
        subgroup_size=64,
        replan=False,  # no migrations: each subgroup's blob is on one tier only
        node_permits_dir=os.path.join(os.path.dirname(tier_root), "permits"),
    )  # fmt: skip
    clip_by = {"fused-clip": "fused", "no-clip": "none"}.get(mode.removeprefix("overlap-"), "chain")
    tx = make_tx(offload, steps, clip_by, inject=mode == "inject")
    if mode == "muon":
        schedule = optax.linear_schedule(1e-2, 1e-3, steps)
        tx = optax.chain(optax.clip_by_global_norm(0.05), jax_mlpo.muon(
            schedule, weight_decay=0.1, weight_decay_mask=lambda p: jax.tree.map(
                lambda x: x.ndim > 1, p), offload=offload))  # fmt: skip
    params = init_params()
    if nproc > 1:
        mesh = distributed.data_parallel_mesh()
        params = distributed.shard_params(params, mesh)
        data_sharding = distributed.batch_sharding(mesh)
    opt_state = tx.init(params)
    traced = jax_mlpo.engine_of(opt_state).tiers if "permits" in mode else []
    for store in traced:  # the training steps' requests only (not the initial writes)
        store.trace = []

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @functools.partial(jax.jit, static_argnums=5)
    def overlapped_step(params, opt_state, pending, x, y, probe=None):
        # the update of the last step's gradients beside this step's forward pass
        loss = functools.partial(loss_fn, probe=probe)
        return jax_mlpo.overlapped_step(loss, tx, params, opt_state, pending, x, y, groups=2)

    held: dict = {"plan": None, "slot": -1, "unfinished": []}  # MODE "overlap", HELD_STEP

    def first_matmul_ran(_):
        # whether this process's held read was still to finish when the first matmul ran
        plan = held["plan"]
        if plan is not None and not held["unfinished"]:
            started = any(e.op == "read" and e.slot == held["slot"] for e in plan.trace)
            held["unfinished"].append(plan.hanging > 0 or not started)
            plan.release()

    # the first step's gradients are computed in their params' shardings, as the update
    # reads them (jax_mlpo.transforms.overlap.sharded_as_read says why)
    read_as = jax_mlpo.transforms.overlap.read_shardings(params)

    @jax.jit
    def first_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return loss, jax_mlpo.transforms.overlap.tree_sharded_as_read(grads, read_as)

    @jax.jit
    def flush(params, opt_state, pending):
        updates, opt_state = tx.update(pending, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    rows = GLOBAL_BATCH // nproc
    losses = []
    pending = None
    for step in range(steps):
        x, y = batch(step)
        if nproc > 1:
            local = slice(pid * rows, (pid + 1) * rows)
            x, y = (jax.make_array_from_process_local_data(data_sharding, a[local]) for a in (x, y))
        if not mode.startswith("overlap"):
            params, opt_state, loss = train_step(params, opt_state, x, y)
        elif pending is None:
            loss, pending = first_step(params, x, y)
        elif step != HELD_STEP:
            params, opt_state, pending, loss = overlapped_step(params, opt_state, pending, x, y)
        else:
            # the last subgroup this process's update reads (what the last update kept comes
            # first), held until the first matmul ran (or 60 s, had the forward pass waited)
            engine = jax_mlpo.engine_of(opt_state)
            held["slot"] = engine.order.of_step(engine.step_count)[-1]
            assert held["slot"] not in engine.order.kept
            with tier_faults(opt_state, tier=None) as plan:  # the slot is on either tier
                plan.hang("read", slot=held["slot"], limit_s=60)
                held["plan"] = plan
                params, opt_state, pending, loss = overlapped_step(
                    params, opt_state, pending, x, y, first_matmul_ran
                )
                jax.block_until_ready((params, pending))
                held["plan"] = None
                held["outcomes"] = [e.outcome for e in plan.trace
                                    if e.op == "read" and e.slot == held["slot"]]  # fmt: skip
        losses.append(float(np.asarray(loss.addressable_data(0))))  # replicated
    if pending is not None:
        params, opt_state = flush(params, opt_state, pending)

    engine = jax_mlpo.engine_of(opt_state)
    last = engine.metrics[-1]
    info = {
        "own": last.as_flat(),  # the same keys on every process (the tiers as configured)
        "process": pid,
        "state_bytes": engine.layout.state_bytes,
        "shapes": [list(s) for s in engine.layout.shapes],
        "tiers": [t.tier.path for t in engine.tiers],
        "tier_bytes": {t.tier.path: t.bytes_written for t in engine.tiers},
        "step_count": engine.step_count,
        "engines": len({id(e) for e in jax_mlpo.transforms.runtime.RUNTIME.open_engines()}),
        "losses": losses,
        "host_only": engine.host_only,
        "beside_s": [m.beside_s for m in engine.metrics],
        "held": {"unfinished": held["unfinished"], "outcomes": held.get("outcomes", [])},
        "traces": {
            jax_mlpo.engine.step_metrics.shared_tier_path(store.tier.path): [
                list(t) for t in store.trace
            ]
            for store in traced
        },
    }
    if nproc > 1:
        params = multihost_utils.process_allgather(params, tiled=True)
    jax_mlpo.close(opt_state)
    with open(os.path.join(out_dir, f"proc{pid}.json"), "w") as f:
        json.dump(info, f)
    if pid == 0:
        np.savez(os.path.join(out_dir, "params.npz"), **jax.tree.map(np.asarray, params))
    if nproc > 1:
        multihost_utils.sync_global_devices("jax_mlpo_test_done")


if __name__ == "__main__":
    main()
