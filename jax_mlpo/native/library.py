"""The compiled library ``jax_mlpo._native``: loading it, its loop dispatch and its threads.

A nanobind extension module: its kernels take typed numpy arrays and a struct of their scalars,
and release the GIL while they run; its FFI handlers come out of ``registrations()``, and its
stub (``jax_mlpo/_native.pyi``) is generated at build time. It holds one copy of its loops per
instruction set (AVX-512, AVX2, baseline x86-64) and picks one at load time with cpuid
(:func:`isa`); calls over more than 64K elements are split over a thread pool
(:func:`num_threads`). What only tests and benchmarks use is in ``jax_mlpo._native_testing``
(:mod:`jax_mlpo.native.testing`), which the wheel does not ship. Its functions on numpy arrays,
with their argument checks, are :mod:`jax_mlpo.native.kernels`.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

__all__ = ["isa", "num_threads", "set_num_threads"]


def load(module: str) -> ModuleType:
    """Imports the extension module ``module`` (e.g. ``"jax_mlpo._native"``).

    Raises:
      ImportError: if the module was not built, with how to build it.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ImportError(
            f"{module} is not built; build the package with "
            "`pip install --no-build-isolation -e .` (needs cmake, nanobind and a C++17 compiler; "
            "an editable install builds the test-only _native_testing too, a wheel only with "
            "JAX_MLPO_TESTING=ON)"
        ) from None


NATIVE = load("jax_mlpo._native")


def isa() -> str:
    """The instruction set the kernels were dispatched to: ``avx512``, ``avx2`` or ``base``."""
    return NATIVE.isa()


def num_threads() -> int:
    """Threads a large kernel call is split over.

    The default is ``JAX_MLPO_NUM_THREADS`` if set, else the CPUs this process may use (its
    affinity mask, so taskset and cgroup cpusets are respected).
    """
    return NATIVE.num_threads()


def set_num_threads(n: int | None) -> int:
    """Sets the thread count of the kernels' pool.

    Args:
      n: the count (clamped to 1..1024), or None to go back to the default.

    Returns:
      The count now in use.
    """
    return NATIVE.set_num_threads(0 if n is None else max(1, int(n)))


def address(arr: np.ndarray) -> int:
    """The address of ``arr``'s first byte."""
    return arr.__array_interface__["data"][0]
