"""Helpers shared by several test modules (imported as ``helpers``; no test module imports
another): the native kernels' test problem (:func:`problem`, :func:`make_hyper`), bitwise
comparison, unaligned views, the instruction sets to compare on, :func:`flip` (a byte of a
file corrupted), and the small training loop the wrapper tests run (:func:`run_small`).

:func:`isas` sets each instruction set of the native kernels in turn. Which ones the CPU has
is read from ``/proc/cpuinfo``, independently of the library: an instruction set the CPU has
but the library refuses fails the test (nothing would have been compared), and one the CPU
lacks is reported as a warning that names it, so a run never silently compares fewer.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mlpo import native
from jax_mlpo.types import BF16, F32, AdamWHyper

LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8
STEPS = 10

# What the kernels' dispatch requires of the CPU for each instruction set (ffi/kernels.cc).
ISA_FLAGS = {
    "base": set(),
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
}


def cpu_flags() -> set[str]:
    """The CPU's feature flags, from ``/proc/cpuinfo`` (empty where it is not there)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return set()
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def isas() -> Iterator[str]:
    """Sets each instruction set this CPU has in turn and yields its name; the best again after.

    Raises:
      AssertionError: the CPU has an instruction set the library refuses to use.
    """
    flags = cpu_flags()
    try:
        for name, needs in ISA_FLAGS.items():
            if not needs <= flags:
                warnings.warn(f"instruction set {name} not compared: this CPU lacks "
                              f"{sorted(needs - flags)}", stacklevel=2)  # fmt: skip
                continue
            try:
                native.set_isa(name)
            except ValueError as e:
                raise AssertionError(f"the CPU has {name} but the library refuses it: {e}") from e
            yield name
    finally:
        native.set_isa(None)


@functools.cache
def _bias_corrections(count: int) -> tuple[float, float]:
    # As optax computes them: 1 - b**count in float32 by XLA.
    bc = BIAS_CORRECTIONS(jnp.int32(count))
    return float(bc[0]), float(bc[1])


BIAS_CORRECTIONS = jax.jit(lambda c: (1 - B1**c, 1 - B2**c))


def make_hyper(count: int, wd: float, grad_scale: float = 1.0) -> AdamWHyper:
    bc1, bc2 = _bias_corrections(count)
    return AdamWHyper(bc1, bc2, LR, B1, B2, EPS, wd, grad_scale)


@functools.cache
def problem(n: int, grad_bf16: bool):
    rng = np.random.default_rng(n)
    p0 = rng.standard_normal(n).astype(F32)
    grads = [(rng.standard_normal(n) * 0.1).astype(F32) for _ in range(STEPS)]
    if grad_bf16:
        grads = [g.astype(BF16) for g in grads]
    for g in grads:
        g.setflags(write=False)  # gradients may be read-only (np.asarray of a jax.Array)
    return p0, grads


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


def assert_bits_equal(actual, expected, what: str = "") -> None:
    a, e = bits(actual), bits(expected)
    bad = np.flatnonzero(a != e)
    assert bad.size == 0, f"{what}: {bad.size} elements differ, first at {bad[:5]}"


def view(n: int, dtype=F32, fill=0.0) -> np.ndarray:
    """An n-element view at an odd offset into a larger buffer (unaligned, not its own base)."""
    buf = np.full(n + 5, fill, dtype)
    return buf[3 : 3 + n]


def flip(path: str | Path, pos: int) -> None:
    """Flips bits of the byte at ``pos`` of the file at ``path`` (a corruption to detect)."""
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x5A]))


def small_params() -> dict:
    """The wrapper tests' params: a 32x24 matrix and a 24-vector, float32."""
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.standard_normal((32, 24)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((24,)), jnp.float32)}  # fmt: skip


def small_grads(step, params):
    """Gradients that differ per element and per step (and depend on the params)."""
    return jax.tree.map(lambda p: jnp.sin(p * (step + 1)) + 0.1 * step, params)


def run_small(tx, steps: int, *, jit: bool = True, change_at: int | None = None,
              changes: dict | None = None):  # fmt: skip
    """Trains :func:`small_params` with ``tx`` for ``steps`` steps; at step ``change_at`` sets
    ``state.hyperparams`` from ``changes`` (as loops change an inject_hyperparams state by
    hand). Returns the params and the state."""
    params = small_params()
    state = tx.init(params)

    def step(params, state, i):
        updates, state = tx.update(small_grads(i, params), state, params)
        return optax.apply_updates(params, updates), state

    step_fn = jax.jit(step) if jit else step
    for i in range(steps):
        if change_at is not None and i == change_at:
            for name, value in (changes or {}).items():
                state.hyperparams[name] = jnp.asarray(value, jnp.float32)
        params, state = step_fn(params, state, jnp.int32(i))
    return params, state
