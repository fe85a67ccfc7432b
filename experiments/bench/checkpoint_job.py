"""The job the checkpoint A/B benchmarks share, and their fresh-process runs.

``offloaded_job`` builds bf16 params in leaves of 16Mi elements under ``jax_mlpo.adamw`` with
all state on one disk tier and a 256 MiB host cache, after two updates; ``run_child`` runs one
measurement in a fresh process and deletes its files whatever happens.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

LEAF = 16 * 2**20  # elements per param leaf
SUBGROUP = 4 * 2**20  # 48 MiB blobs with a bf16 master


def spanned(f: Callable, record: Callable[[float, float], None]) -> Callable:
    """``f``, calling ``record(start, end)`` (``time.perf_counter``) after each call."""

    @functools.wraps(f)
    def g(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            record(t, time.perf_counter())

    return g


def timed(waits: dict[str, float], label: str, f: Callable) -> Callable:
    """``f``, adding the seconds each call takes to ``waits[label]``."""

    def add(start: float, end: float) -> None:
        waits[label] += end - start

    return spanned(f, add)


def saved_job(params_mi: int, root: str) -> tuple[Any, Any]:
    """``(manager, target)``: ``offloaded_job``'s state saved as step 1 (blocking, one
    checkpoint kept) and closed, and the params' ``ShapeDtypeStruct`` s to restore into.
    ``root`` is made anew."""
    import jax

    import jax_mlpo
    from jax_mlpo import checkpoint

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    params, opt_state, _ = offloaded_job(params_mi, root)
    mngr = checkpoint.manager(os.path.join(root, "ckpt"), max_to_keep=1)
    checkpoint.save(mngr, 1, params, opt_state, blocking=True)
    jax_mlpo.close(opt_state)
    return mngr, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def offloaded_tx(tier: str) -> Any:
    """``jax_mlpo.adamw`` with all state on the disk tier ``tier`` and a 256 MiB host cache."""
    import jax_mlpo

    config = jax_mlpo.OffloadConfig(
        host_cache="256MiB", tiers=[jax_mlpo.FileTier(tier)], subgroup_size=SUBGROUP
    )
    return jax_mlpo.adamw(1e-3, weight_decay=0.01, offload=config)


def offloaded_job(params_mi: int, root: str) -> tuple[Any, Any, Any]:
    """``(params, opt_state, step)`` after two updates; ``step(params, opt_state, k)`` is jitted,
    the params donated. The tier is ``<root>/tier``."""
    import jax
    import jax.numpy as jnp
    import optax

    make = jax.jit(lambda k: jax.random.normal(k, (LEAF,), jnp.bfloat16))
    keys = jax.random.split(jax.random.PRNGKey(0), params_mi * 2**20 // LEAF)
    params = {f"w{i:03d}": make(k) for i, k in enumerate(keys)}
    tx = offloaded_tx(os.path.join(root, "tier"))
    opt_state = tx.init(params)

    def step(p, s, k):
        grads = jax.tree.map(lambda x: jnp.sin(x * k).astype(x.dtype), p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(step, donate_argnums=(0,))
    for k in (1.0, 2.0):
        params, opt_state = step(params, opt_state, k)
    jax.block_until_ready(params)
    return params, opt_state, step


def ab_parser(doc: str, rounds: int, directory: str) -> argparse.ArgumentParser:
    """The in-process A/B benchmarks' arguments: ``--params-mi``, ``--rounds``, ``--dir`` (deleted
    afterwards) and ``--json``; ``doc``'s first line describes them."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--params-mi", type=int, default=344)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--dir", default=directory)
    parser.add_argument("--json")
    return parser


def run_in(directory: str, run: Callable[[], Any]) -> Any:
    """``run()`` with INFO logging (orbax's per-save lines off), ``directory`` deleted after it
    whatever happens."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        return run()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_child(module: str, args: list[str], directory: str) -> dict:
    """Runs ``python -m module *args`` in a fresh process with ``directory`` new and empty
    (deleted afterwards); returns the dict it printed as ``RESULT <json>``.

    Raises:
      RuntimeError: the run failed (its stderr's end in the message).
    """
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                              text=True, check=False)  # fmt: skip
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])
