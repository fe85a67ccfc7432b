"""The compiled library ``jax_mlpo._native``: loading it, its loop dispatch and its threads.

A nanobind extension module: its kernels take typed numpy arrays and a struct of their scalars,
and release the GIL while they run; its FFI handlers come out of ``registrations()``, and its
stub (``jax_mlpo/_native.pyi``) is generated at build time. It holds one copy of its loops per
instruction set (AVX-512, AVX2, baseline x86-64) and picks one at load time with cpuid
(:func:`isa`); calls over more than 64K elements are split over a thread pool
(:func:`num_threads`). What only tests and benchmarks use is in ``jax_mlpo._native_testing``
(:mod:`jax_mlpo.native.testing`), which the wheel does not ship.

The helpers below the settings check numpy arrays before they cross into C++, with messages
that name the argument: the C++ side only rejects what would corrupt memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from jax_mlpo.types import BF16, F32

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


# ---- arrays crossing into C -------------------------------------------------------------------


def address(arr: np.ndarray) -> int:
    """The address of ``arr``'s first byte."""
    return arr.__array_interface__["data"][0]


def bits(arr: np.ndarray | None) -> np.ndarray | None:
    """``arr`` as C++ takes it: a bfloat16 array as its uint16 bits (numpy exports bfloat16
    through neither DLPack nor the buffer protocol), any other as it is."""
    return arr.view(np.uint16) if arr is not None and arr.dtype == BF16 else arr


def checked_array(
    name: str,
    arr: object,
    dtypes: Sequence[np.dtype],
    size: int | None,
    *,
    writable: bool,
) -> np.ndarray:
    """Checks one array argument of a kernel and returns it as a numpy array.

    Args:
      name: the argument's name, for the error message.
      arr: the argument. Read-only inputs may be anything ``np.asarray`` accepts (a jax.Array
        on the CPU); outputs must be numpy arrays, as a converted copy would be written in vain.
      dtypes: the accepted dtypes.
      size: the element count it must have (the first array's), or None.
      writable: whether the kernel writes to it.

    Returns:
      ``arr`` as a C-contiguous numpy array.

    Raises:
      ValueError: on a wrong type, dtype or size, a non-contiguous array, or a read-only output.
    """
    if not isinstance(arr, np.ndarray):
        if writable:
            raise ValueError(f"{name} must be a writable numpy array, got {type(arr).__name__}")
        arr = np.asarray(arr)
    if arr.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be {want}, got {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {arr.strides})")
    if size is not None and arr.size != size:
        raise ValueError(f"{name} has {arr.size} elements but m has {size}")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only but is written to")
    return arr


def checked_outputs(
    n: int,
    update_out: np.ndarray | None,
    delta_base: np.ndarray | None,
    param_bf16_out: np.ndarray | None,
) -> dict[str, np.ndarray | None]:
    """Checks the outputs every optimizer kernel shares and returns them as C++ takes them.

    Args:
      n: the element count.
      update_out: float32 (or bfloat16, as a difference to ``delta_base``) update, or None.
      delta_base: bfloat16 params the update is a difference to, or None.
      param_bf16_out: bfloat16 new params, or None.

    Returns:
      ``{name: array (bfloat16 as its bits) or None}`` for the three.

    Raises:
      ValueError: as :func:`checked_array`, or for ``delta_base`` without ``update_out``.
    """
    out = {}
    update_dtypes = (F32, BF16) if delta_base is not None else (F32,)
    for name, arr, dtypes, writable in [
        ("update_out", update_out, update_dtypes, True),
        ("delta_base", delta_base, (BF16,), False),
        ("param_bf16_out", param_bf16_out, (BF16,), True),
    ]:
        if arr is not None:
            arr = checked_array(name, arr, dtypes, n, writable=writable)
        out[name] = bits(arr)
    if delta_base is not None and update_out is None:
        raise ValueError("delta_base needs update_out (the update is new_param - delta_base)")
    return out


def overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the bytes of two C-contiguous arrays overlap (empty arrays overlap nothing)."""
    pa, pb = address(a), address(b)
    return a.nbytes > 0 and b.nbytes > 0 and pa < pb + b.nbytes and pb < pa + a.nbytes
