"""Peak RSS growth of one blocking checkpoint save and one restore, for an A/B of two commits.

64Mi bf16 params (768 MiB of state, 128 MiB of params) with all state on a disk tier,
``host_cache`` 256 MiB, 2 updates, then ``checkpoint.save`` on a synchronous manager and a
restore into a fresh ``tx.init``; ``VmHWM`` is reset through ``/proc/self/clear_refs`` before
each and compared with ``VmRSS`` just before. The code comes from ``root``: another checkout
(a ``git worktree`` of an older commit with the built ``_native`` copied into its package) is
imported instead of the editable install.

    python experiments/bench/checkpoint_rss_ab.py /tmp/before /var/tmp/ckrss  # old commit
    python experiments/bench/checkpoint_rss_ab.py /work/main /var/tmp/ckrss    # this one
"""

from __future__ import annotations

import json
import os
import shutil
import sys

LEAF = 16 * 2**20


def status(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Resets ``VmHWM`` to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(root: str, work: str) -> dict:
    if root != os.getcwd():  # another checkout: not the editable install's modules
        sys.meta_path = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
        sys.path.insert(0, root)
    import jax
    import jax.numpy as jnp
    import optax

    import jax_mlpo
    from jax_mlpo import checkpoint

    assert jax_mlpo.__file__.startswith(root), jax_mlpo.__file__
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {f"w{i}": jax.random.normal(k, (LEAF,), jnp.bfloat16) for i, k in enumerate(keys)}
    config = jax_mlpo.OffloadConfig(
        host_cache="256MiB", tiers=[jax_mlpo.FileTier(work + "/tier")], subgroup_size=LEAF // 4
    )
    tx = jax_mlpo.adamw(1e-3, offload=config)

    def train_step(p, s):
        updates, s = tx.update(jax.tree.map(lambda x: jnp.sin(x).astype(x.dtype), p), s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(train_step, donate_argnums=(0,))
    opt_state = tx.init(params)
    for _ in range(2):
        params, opt_state = step(params, opt_state)
    jax.block_until_ready(params)
    jax_mlpo.engine_of(opt_state).drain()
    mngr = checkpoint.manager(work + "/ckpt", async_save=False)
    steady = status("VmRSS")
    reset_peak()
    checkpoint.save(mngr, 2, params, opt_state)
    save_growth = status("VmHWM") - steady
    jax_mlpo.close(opt_state)
    fresh = jax.tree.map(jnp.zeros_like, params)
    del params
    opt_state = tx.init(fresh)
    steady = status("VmRSS")
    reset_peak()
    restored = checkpoint.restore(mngr, fresh, opt_state)
    restore_growth = status("VmHWM") - steady
    jax_mlpo.close(restored.opt_state)
    mngr.close()
    shutil.rmtree(work, ignore_errors=True)
    return {"root": root, "state_mib": 4 * LEAF * 12 / 2**20, "params_mib": 4 * LEAF * 2 / 2**20,
            "save_growth_mib": save_growth / 2**20,
            "restore_growth_mib": restore_growth / 2**20}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
