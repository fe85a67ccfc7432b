"""One process of a 2-process run whose process 1 dies during an asynchronous checkpoint save
(spawned by tests/test_checkpoint_distributed.py).

Usage: ckpt_kill_worker.py PROCESS_ID NUM_PROCESSES PORT SPEC_JSON

The job is tests/dist_worker.py's (a small MLP, data parallel, the state on a file tier).
SPEC_JSON holds ``mode``, ``ckpt``, ``tier`` and ``out``:

- ``"train"`` (2 processes): trains 3 steps, saves checkpoint 3 and waits for it, writes
  ``out/saved.npz`` (process 0: the gathered params at step 3), trains step 4 and starts an
  asynchronous save of checkpoint 4, during which process 1 kills itself with SIGKILL (inside
  the save's first read of its offloaded state from the tier: a ``jax_mlpo.testing`` fault
  plan). Process 0 prints ``SAVING`` and waits for the save, which needs every process: the
  test kills it, as a launcher stops a job whose process died.
- ``"restore"`` (1 process): restores the latest checkpoint into a fresh ``tx.init`` and writes
  ``out/restored.npz``: its step and params.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "1"  # one device per process

import jax  # noqa: E402
from dist_worker import batch, init_params, loss_fn, make_tx  # noqa: E402

SAVED_AT = 3


def main() -> None:
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(sys.argv[4])
    if nproc > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
            initialization_timeout=60,
        )  # fmt: skip
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import jax_mlpo
    import jax_mlpo.testing
    from jax_mlpo import checkpoint
    from jax_mlpo.sharding import processes as distributed

    os.makedirs(spec["tier"], exist_ok=True)
    offload = jax_mlpo.OffloadConfig(
        host_cache="4KiB", subgroup_size=64, replan=False,
        tiers=[jax_mlpo.FileTier(os.path.join(spec["tier"], f"proc{pid}"), sync=False)],
    )  # fmt: skip
    tx = make_tx(offload, 12)
    params = init_params()
    mesh = distributed.data_parallel_mesh() if nproc > 1 else None
    if mesh is not None:
        params = distributed.shard_params(params, mesh)
    opt_state = tx.init(params)
    mngr = checkpoint.manager(spec["ckpt"])

    if spec["mode"] == "restore":
        restored = checkpoint.restore(mngr, params, opt_state)
        np.savez(os.path.join(spec["out"], "restored.npz"), step=restored.step,
                 **jax.tree.map(np.asarray, restored.params))  # fmt: skip
        mngr.close()
        jax_mlpo.close(restored.opt_state)
        return

    @jax.jit
    def train_step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    data_sharding = distributed.batch_sharding(mesh)
    rows = 16 // nproc

    def step(params, opt_state, k):
        x, y = batch(k)
        local = slice(pid * rows, (pid + 1) * rows)
        x, y = (jax.make_array_from_process_local_data(data_sharding, a[local]) for a in (x, y))
        return train_step(params, opt_state, x, y)

    for k in range(SAVED_AT):
        params, opt_state = step(params, opt_state, k)
    checkpoint.save(mngr, SAVED_AT, params, opt_state, {"step": SAVED_AT})
    mngr.wait_until_finished()
    gathered = multihost_utils.process_allgather(params, tiled=True)
    if pid == 0:
        np.savez(os.path.join(spec["out"], "saved.npz"), **jax.tree.map(np.asarray, gathered))
    params, opt_state = step(params, opt_state, SAVED_AT)
    faults = contextlib.ExitStack()  # open until the process ends
    if pid == 1:  # dies inside the save's first read of its state from the tier
        plan = faults.enter_context(jax_mlpo.testing.tier_faults(opt_state, tier=0))
        plan.on("read", lambda: os.kill(os.getpid(), signal.SIGKILL), kind="state")
    checkpoint.save(mngr, SAVED_AT + 1, params, opt_state, {"step": SAVED_AT + 1})
    print("SAVING", flush=True)
    mngr.wait_until_finished()  # never returns: process 1's part of the save never comes
    print("SAVED", flush=True)


if __name__ == "__main__":
    main()
