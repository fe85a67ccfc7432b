"""One process of a multi-process jax_mlpo checkpoint run (spawned by
tests/test_checkpoint_distributed.py).

Usage: ckpt_dist_worker.py PROCESS_ID NUM_PROCESSES PORT SPEC_JSON

The job is tests/dist_worker.py's: a small MLP under optax.chain(clip_by_global_norm,
jax_mlpo.adamw) with the state on file tiers, data parallel over NUM_PROCESSES processes (plain
single-process jax with NUM_PROCESSES == 1). SPEC_JSON holds:

- ``mode``: ``"train"`` trains ``steps`` data-parallel steps, saves checkpoint ``steps`` and
  takes the next two steps while it is written; ``"restore"`` restores the latest checkpoint
  into a fresh ``tx.init`` and takes the same two steps, then (with ``corrupt``) flips a byte
  of a checkpoint file and restores again, expecting every process to refuse it. A restore
  also records which rows of each leaf its process read.
- ``tiers``, ``subgroup_size``: the offload config (any, in a restore);
- ``ckpt``: the checkpoint directory; ``out``: where results go; ``steps``.

The two steps after the checkpoint: an *exact* one, whose gradients are computed on the whole
batch with gathered params in every process (so the same arithmetic for any process count),
then an ordinary data-parallel one. Process 0 writes ``out/result.npz``: the logical optimizer
state at the checkpoint (mu and nu gathered from every process's engine) and the params there
and after each of the two steps; every process writes ``out/proc<k>.json``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "1"  # one device per process

import jax  # noqa: E402

# The job of tests/dist_worker.py (an MLP whose first dimensions split over 1, 2 or 4 processes).
from dist_worker import GLOBAL_BATCH, batch, init_params, loss_fn, make_tx  # noqa: E402
from helpers import flip  # noqa: E402

TOTAL_STEPS = 12  # the schedule's length


def counting_rewrites(min_bytes: int) -> list[int]:
    """Has arrays of ``min_bytes`` or more rewrite deleted checkpoints' files; returns a counter
    of the files taken."""
    from jax_mlpo.checkpoint import recycle

    recycle.MIN_BYTES = min_bytes
    count, take = [0], recycle.SpareFiles.take

    def counted(self, path: str, nbytes: int) -> bool:
        taken = take(self, path, nbytes)
        count[0] += taken
        return taken

    recycle.SpareFiles.take = counted
    return count


def main() -> None:
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(sys.argv[4])
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
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_mlpo
    from jax_mlpo import checkpoint
    from jax_mlpo.checkpoint import restore_plan, state_reader
    from jax_mlpo.config import Bandwidth
    from jax_mlpo.sharding import processes as distributed

    def barrier(name: str) -> None:
        if nproc > 1:
            multihost_utils.sync_global_devices(name)

    offload = jax_mlpo.OffloadConfig(
        host_cache="4KiB",  # smaller than every process's state: subgroups go to the tiers
        tiers=[jax_mlpo.FileTier(path, bandwidth=Bandwidth("2GB", "2GB"), sync=False)
               for path in spec["tiers"]],
        subgroup_size=spec["subgroup_size"],
        replan=False,
    )  # fmt: skip
    tx = make_tx(offload, TOTAL_STEPS)
    mesh = distributed.data_parallel_mesh() if nproc > 1 else None

    def fresh():
        params = init_params()
        if nproc > 1:
            params = distributed.shard_params(params, mesh)
        return params, tx.init(params)

    def step_with(grad_fn):
        @jax.jit
        def train_step(params, opt_state, x, y):
            loss, grads = grad_fn(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return train_step

    def exact_grads(params, x, y):
        # The whole batch, with params gathered, in every process: the gradients and the
        # clipping norm are then computed by the same operations as in one process (no partial
        # sums reduced across processes in another order).
        if nproc > 1:
            params = jax.lax.with_sharding_constraint(params, NamedSharding(mesh, P()))
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if nproc > 1:
            grads = jax.lax.with_sharding_constraint(grads, NamedSharding(mesh, P()))
        return loss, grads

    dp_step = step_with(jax.value_and_grad(loss_fn))
    exact_step = step_with(exact_grads)

    def data(step: int, whole: bool):
        x, y = batch(step)
        if nproc == 1:
            return x, y
        if whole:
            sharding = NamedSharding(mesh, P())
        else:
            rows = GLOBAL_BATCH // nproc
            sharding = distributed.batch_sharding(mesh)
            x, y = x[pid * rows : (pid + 1) * rows], y[pid * rows : (pid + 1) * rows]
        return tuple(jax.make_array_from_process_local_data(sharding, a) for a in (x, y))

    def gathered(tree):
        if nproc > 1:
            tree = multihost_utils.process_allgather(tree, tiled=True)
        return jax.tree.map(np.asarray, tree)

    def logical_state(opt_state) -> dict:
        """mu and nu of every leaf, gathered from the engines' shards (not via checkpoint)."""
        state = jax_mlpo.engine_of(opt_state).state_dict()
        whole, split = {}, {}
        for name in ("mu", "nu"):
            for i, (local, leaf) in enumerate(
                zip(state[name], jax.tree.leaves(init_params()), strict=True)
            ):
                spec_i = distributed.leaf_spec(leaf.shape, nproc)
                if nproc == 1 or spec_i == P():  # replicated: every process holds all of it
                    whole[f"{name}/{i}"] = local
                else:
                    split[f"{name}/{i}"] = jax.make_array_from_process_local_data(
                        NamedSharding(mesh, spec_i), local, leaf.shape
                    )
        return {**whole, **gathered(split)}

    steps = spec["steps"]
    mngr = checkpoint.manager(spec["ckpt"], max_to_keep=2)
    params, opt_state = fresh()
    info: dict = {"process": pid}
    if spec["mode"] == "train":
        rewritten = counting_rewrites(spec["recycle_bytes"]) if spec.get("recycle_bytes") else None
        for step in range(steps):
            params, opt_state, _ = dp_step(params, opt_state, *data(step, whole=False))
            if rewritten is not None and steps - 3 <= step + 1 < steps:
                # two kept: the first of these is deleted before the last save, which rewrites it
                extra = {"step": step + 1, "seed": 7}
                checkpoint.save(mngr, step + 1, params, opt_state, extra, blocking=True)
        saved = {"state": logical_state(opt_state), "params": gathered(params)}
        checkpoint.save(mngr, steps, params, opt_state, {"step": steps, "seed": 7})
    else:
        # what each process reads of every leaf (restore_plan.read_sharding's choice), recorded
        reads = info["reads"] = []
        read_sharding = restore_plan.read_sharding

        def recording(want, shards):
            sharding = read_sharding(want, shards)
            rows = [0, want.shape[0]] if want.shape else []
            if sharding is not None:
                (index,) = sharding.addressable_devices_indices_map(want.shape).values()
                rows = list(index[0].indices(want.shape[0])[:2])
            reads.append({"shape": list(want.shape), "saved": len(shards), "rows": rows})
            return sharding

        # and which saved shard arrays of the offloaded state it read chunks of
        arrays = info["arrays"] = []
        chunks = state_reader.StateReader._issue

        def recording_chunks(self, pieces):
            arrays.extend(record["array"] for _, record, _, _, _ in pieces)
            return chunks(self, pieces)

        restore_plan.read_sharding = recording
        state_reader.StateReader._issue = recording_chunks
        restored = checkpoint.restore(mngr, params, opt_state)
        restore_plan.read_sharding = read_sharding
        state_reader.StateReader._issue = chunks
        params, opt_state = restored.params, restored.opt_state
        info["restored"] = {"step": restored.step, "extra": restored.extra}
        saved = {"state": logical_state(opt_state), "params": gathered(params)}
    # The next steps run while a checkpoint is written (train) or after the restore.
    params, opt_state, _ = exact_step(params, opt_state, *data(steps, whole=True))
    after_exact = gathered(params)
    params, opt_state, _ = dp_step(params, opt_state, *data(steps + 1, whole=False))
    after_dp = gathered(params)
    mngr.wait_until_finished()
    if spec["mode"] == "train" and rewritten is not None:
        info["rewritten"] = rewritten[0]
    engine = jax_mlpo.engine_of(opt_state)
    info.update(
        step_count=engine.step_count,
        shapes=[list(s) for s in engine.layout.shapes],
        subgroups=len(engine.layout.subgroups),
        tiers=[t.tier.path for t in engine.tiers],
        host_only=engine.host_only,
    )
    jax_mlpo.close(opt_state)

    if spec.get("corrupt"):
        # A byte of the largest chunk of the offloaded state that process 1 wrote, flipped:
        # every process must refuse the checkpoint, whichever of them reads that chunk.
        files = sorted(
            (os.path.join(root, f)
             for root, _, names in os.walk(os.path.join(spec["ckpt"], str(steps))) for f in names
             if os.sep + "process_1" + os.sep in root and root.endswith(os.sep + "c")),
            key=os.path.getsize,
        )  # fmt: skip
        target = files[-1]
        info["corrupted"] = os.path.relpath(target, spec["ckpt"])
        if pid == 0:
            flip(target, os.path.getsize(target) // 2)
        barrier("flipped")
        params, opt_state = fresh()
        # whatever the restore raises is recorded, for the test to check its type, and this
        # process still reaches the barrier the others wait at
        try:
            checkpoint.restore(checkpoint.manager(spec["ckpt"]), params, opt_state)
            info["corrupt_restore"] = "restored"
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            info["corrupt_restore"] = f"{type(e).__name__}: {e}"
        jax_mlpo.close(opt_state)
        barrier("refused")
        if pid == 0:
            flip(target, os.path.getsize(target) // 2)

    mngr.close()
    with open(os.path.join(spec["out"], f"proc{pid}.json"), "w") as f:
        json.dump(info, f)
    if pid == 0:
        result = {f"state/{k}": v for k, v in saved["state"].items()}
        for name, tree in (("params", saved["params"]), ("exact", after_exact), ("dp", after_dp)):
            result.update({f"{name}/{k}": v for k, v in tree.items()})
        np.savez(os.path.join(spec["out"], "result.npz"), **result)
    barrier("done")


if __name__ == "__main__":
    main()
