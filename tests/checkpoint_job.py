"""The checkpoint tests' job (tests/crash_worker.py) driven from a test, and comparisons.

Shared by the checkpoint test modules (``worker_env``, the workers' environment, is a fixture in
conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import crash_worker as job
import jax.numpy as jnp
import numpy as np
from helpers import flip

import jax_mlpo

__all__ = ["WORKER", "assert_bits_equal", "assert_states_equal", "flip", "logical_state",
           "run_worker", "spec_for", "start_job"]  # fmt: skip

WORKER = Path(__file__).with_name("crash_worker.py")


def run_worker(specs, env) -> str:
    """Runs the worker to its end; returns its output."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(specs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def start_job(spec: dict, **adamw_kwargs):
    """tx, update function, params and a fresh opt_state for ``spec`` (``adamw_kwargs``: more of
    jax_mlpo.adamw's arguments)."""
    tx = job.make_tx(job.offload_config(spec), **adamw_kwargs)
    params = job.make_params(jnp.dtype(spec["dtype"]))
    return tx, job.make_update(tx), params, tx.init(params)


def spec_for(root: Path, dtype: str, tiers: int, cache: str, retain: bool, **kw) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    return {
        "dtype": dtype,
        "tiers": [str(root / f"tier{i}") for i in range(tiers)],
        "cache": cache,
        "retain": retain,
        "ckpt": str(root / "ckpt"),
        "out": str(root / "out.npz"),
        **kw,
    }


def assert_bits_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k, strict=True)


def logical_state(opt_state) -> dict:
    engine = jax_mlpo.engine_of(opt_state)
    return {"step": engine.step_count, **engine.state_dict()}


def assert_states_equal(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for name in ("mu", "nu", "master"):
        for a, b in zip(got[name], want[name], strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a, b, strict=True)
