"""Which of jax_mlpo's Python files and functions one jitted update runs through.

A small MLP's jitted train step (loss, gradients, ``jax_mlpo.adamw``'s update,
``optax.apply_updates``) with a file tier and a host cache smaller than the state, so the update
reads and writes the tier. The first step compiles and warms up; the second is profiled, from
its dispatch until its results are ready, in every thread: the main thread, the threads
jax_mlpo starts (its I/O threads, read-ahead, write-backs: ``threading.setprofile``, installed
before they start) and XLA's threads, which enter Python through the update's FFI callback
(threads Python did not start take no profile hook, so the callback is wrapped to install it).
Prints the distinct files under ``jax_mlpo/`` whose functions ran, with the functions of each
and their calls (a comprehension counted as part of its function), and the totals: what a reader
follows to understand one update.

    python -m experiments.bench.mlpo.update_profile
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jax_mlpo
from experiments.bench.harness import write_json
from jax_mlpo.native import host_update
from jax_mlpo.native.library import NATIVE
from jax_mlpo.transforms.runtime import RUNTIME

PACKAGE = os.path.dirname(os.path.abspath(jax_mlpo.__file__)) + os.sep
INLINE = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}


class Profile:
    """Calls of jax_mlpo's functions, counted while armed, in whatever thread they run."""

    def __init__(self) -> None:
        self.armed = False
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        del arg
        if not self.armed or event != "call":
            return
        code = frame.f_code
        path = code.co_filename
        # a comprehension or generator expression runs inside its function, counted already
        if path.startswith(PACKAGE) and code.co_name not in INLINE:
            key = (path[len(PACKAGE) :], code.co_qualname)
            with self._lock:
                self.calls[key] += 1

    def wrap(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """``handler`` with this profile's hook installed on the thread that calls it."""

        def profiled(*args: Any) -> Any:
            previous = sys.getprofile()
            sys.setprofile(self.hook)
            try:
                return handler(*args)
            finally:
                sys.setprofile(previous)

        return profiled

    def files(self) -> dict[str, dict[str, int]]:
        """``{file: {function: calls}}``, sorted."""
        out: dict[str, dict[str, int]] = {}
        for (path, name), n in sorted(self.calls.items()):
            out.setdefault(path, {})[name] = n
        return out


def mlp(width: int, layers: int) -> dict[str, dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(0), layers)
    return {
        f"layer{i}": {
            "w": jax.random.normal(k, (width, width), jnp.float32) / width**0.5,
            "b": jnp.zeros((width,), jnp.float32),
        }
        for i, k in enumerate(keys)
    }


def loss(params, x):
    for layer in params.values():
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean(x**2)


def run(args: argparse.Namespace, tier_dir: str) -> Profile:
    profile = Profile()
    threading.setprofile(profile.hook)  # every thread started from here on
    sys.setprofile(profile.hook)
    params = mlp(args.width, args.layers)
    config = jax_mlpo.OffloadConfig(
        host_cache=args.cache,
        tiers=[jax_mlpo.FileTier(os.path.join(tier_dir, "tier"))],
        subgroup_size=args.subgroup,
    )
    tx = jax_mlpo.adamw(1e-3, weight_decay=0.1, offload=config)
    # XLA's threads reach Python through this callback only (the runtime set it at import)
    NATIVE.set_host_update(profile.wrap(host_update._handler(RUNTIME._run_update)))

    @jax.jit
    def step(params, state, x):
        grads = jax.grad(loss)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jnp.ones((8, args.width), jnp.float32)
    state = tx.init(params)
    try:
        params, state = jax.block_until_ready(step(params, state, x))  # compiles; warm-up
        profile.armed = True
        params, state = jax.block_until_ready(step(params, state, x))
        profile.armed = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        jax_mlpo.close(state)
    return profile


def report(profile: Profile) -> dict[str, Any]:
    files = profile.files()
    width = max((len(f) for f in files), default=0)
    for path, functions in files.items():
        names = ", ".join(f"{name} x{n}" for name, n in functions.items())
        print(f"{path:<{width}}  {len(functions):3d}  {names}")
    functions = sum(len(f) for f in files.values())
    print(f"files: {len(files)}  functions: {functions}  calls: {sum(profile.calls.values())}")
    return {"files": len(files), "functions": functions, "by_file": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512, help="the MLP's width")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--subgroup", type=int, default=65536, help="elements per subgroup")
    parser.add_argument("--cache", default="2MiB", help="host cache (below the state's size)")
    parser.add_argument("--dir", default=None, help="where the tier's directory goes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="jax_mlpo-profile-") as tier_dir:
        profile = run(args, tier_dir)
    write_json(args.json, report(profile))


if __name__ == "__main__":
    main()
