"""The fixed training problem of the fault tests (tests/test_faults.py,
tests/test_checkpoint_faults.py and the worker they kill): an offloaded AdamW whose state is on
a file or object tier, updated and checkpointed through the public API, and the reference it
must match, ``optax.adamw``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_mlpo

SUB = 4096  # elements per subgroup
N = 8  # subgroups
BLOB = 8 * SUB  # fp32 params: m | v
LR, WD = 1e-3, 0.1


def make_params() -> dict[str, jax.Array]:
    return {"w": jnp.linspace(-1.0, 1.0, N * SUB, dtype=jnp.float32)}


def grads_for(params: dict[str, jax.Array], step: int) -> dict[str, jax.Array]:
    """Gradients that depend on the params, so a wrong state shows in every later step."""
    return {"w": jnp.cos(params["w"] * (step + 1))}


def optax_params(steps: int) -> np.ndarray:
    """The params after ``steps`` updates of ``optax.adamw`` (the reference)."""
    tx = optax.adamw(LR, weight_decay=WD)
    params = make_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(steps):
        updates, state = update(grads_for(params, step), state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params["w"])


def file_config(path: Path, tiers: int = 1, **switches) -> jax_mlpo.OffloadConfig:
    """``tiers`` file tiers under ``path`` (made); the host cache holds only the pipeline's
    buffers."""
    path.mkdir(parents=True, exist_ok=True)
    return jax_mlpo.OffloadConfig(
        host_cache=(tiers + 2) * BLOB,
        tiers=[
            jax_mlpo.FileTier(
                str(path / f"t{k}"), sync=False, io_engine=switches.pop("io_engine", "posix")
            )
            for k in range(tiers)
        ],
        subgroup_size=SUB,
        prefetch_depth=1,
        placement="even",  # no bandwidth probe: every subgroup's tier is known
        **switches,
    )


def object_config(endpoint: str, bucket: str, **switches) -> jax_mlpo.OffloadConfig:
    """One object tier at ``endpoint``; nothing retained, so every update reads and writes
    every subgroup there."""
    retries = switches.pop("request_retries", 3)
    tier = jax_mlpo.ObjectTier(
        f"s3://{bucket}/run/", endpoint=endpoint, region="us-east-1", request_retries=retries
    )
    return jax_mlpo.OffloadConfig(
        host_cache=3 * BLOB, tiers=[tier], subgroup_size=SUB, prefetch_depth=1,
        placement="even", retain=False, **switches,
    )  # fmt: skip


class Training:
    """An offloaded AdamW on the fixed problem, updated and checkpointed through the public API."""

    def __init__(self, config: jax_mlpo.OffloadConfig) -> None:
        self.tx = jax_mlpo.adamw(LR, weight_decay=WD, offload=config)
        self.params = make_params()
        self.state = self.tx.init(self.params)
        self.engine = jax_mlpo.engine_of(self.state)
        self._update = jax.jit(self.tx.update)
        self.step = 0

    def run(self, steps: int) -> None:
        """Applies ``steps`` updates (an update that fails raises here)."""
        for _ in range(steps):
            updates, state = self._update(
                grads_for(self.params, self.step), self.state, self.params
            )
            self.params = jax.block_until_ready(optax.apply_updates(self.params, updates))
            self.state = state
            self.step += 1

    def save(self, directory: Path):
        """A checkpoint of this step, written before it returns."""
        mngr = jax_mlpo.checkpoint.manager(str(directory), max_to_keep=1)
        jax_mlpo.checkpoint.save(mngr, self.step, self.params, self.state, blocking=True)
        return mngr

    def assert_refuses_to_go_on(self, mngr) -> None:
        """After a failed update: no checkpoint of the partly updated state, no more updates."""
        assert self.engine.failed
        refused = "failed midway.*partly updated.*Restore from your last checkpoint"
        with pytest.raises(jax_mlpo.EngineFailedError, match=refused):
            jax_mlpo.checkpoint.save(mngr, self.step + 1, self.params, self.state, blocking=True)
        with (
            pytest.raises(jax_mlpo.EngineFailedError, match=f"{refused} and init a new"),
            jax_mlpo.errors.typed(),
        ):
            self.run(1)


def assert_resumes_as_optax(mngr, config: jax_mlpo.OffloadConfig, steps: int, **restore_kw):
    """Restores ``mngr``'s checkpoint (the latest, or ``restore_kw``'s ``step``) into a new
    optimizer on ``config``, runs it to ``steps`` updates and compares the params with optax's.

    Returns:
      The step restored.
    """
    run = Training(config)
    restored = jax_mlpo.checkpoint.restore(mngr, run.params, run.state, **restore_kw)
    run.params, run.state, run.step = restored.params, restored.opt_state, restored.step
    run.run(steps - run.step)
    np.testing.assert_allclose(np.asarray(run.params["w"]), optax_params(steps), rtol=1e-6)
    jax_mlpo.close(run.state)
    return restored.step
