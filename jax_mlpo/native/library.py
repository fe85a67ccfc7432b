"""The compiled library ``jax_mlpo._native``: loading it, its loop dispatch and its threads.

The library is a Python extension module only so that the import system (editable installs
included) finds it; its entry points are plain C symbols called through ctypes, which releases
the GIL for the duration of each call. It holds one copy of its loops per instruction set
(AVX-512, AVX2, baseline x86-64) and picks one at load time with cpuid (:func:`isa`); calls over
more than 64K elements are split over a thread pool (:func:`num_threads`).

The helpers below the settings check numpy arrays before their addresses cross into C: the C
side trusts dtypes, sizes and contiguity, so a wrong argument is a ``ValueError`` here rather
than memory corruption there.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Sequence

import numpy as np

from jax_mlpo.types import BF16, F32

__all__ = ["isa", "num_threads", "set_isa", "set_num_threads"]

P = ctypes.c_void_p
I64 = ctypes.c_int64


def load(module: str) -> ctypes.CDLL:
    """Opens the shared library of the extension module ``module`` with ctypes.

    Args:
      module: the module's full name, e.g. ``"jax_mlpo._native"``.

    Returns:
      The library; declare its functions with :func:`declare` before calling them.

    Raises:
      ImportError: if the module was not built.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(
            f"{module} is not built; build the package with "
            "`pip install --no-build-isolation -e .` (needs cmake and a C++17 compiler)"
        )
    return ctypes.CDLL(spec.origin)


def declare(lib: ctypes.CDLL, signatures: Sequence[tuple[str, list, object]]) -> None:
    """Sets ``argtypes`` and ``restype`` of each ``(symbol, argtypes, restype)`` of ``lib``.

    Without them ctypes would pass Python ints as C ints, truncating addresses and sizes.
    """
    for name, args, ret in signatures:
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ret


LIB = load("jax_mlpo._native")
declare(
    LIB,
    [
        ("jax_mlpo_isa", [], ctypes.c_char_p),
        ("jax_mlpo_set_isa", [ctypes.c_char_p], ctypes.c_int),
        ("jax_mlpo_num_threads", [], ctypes.c_int),
        ("jax_mlpo_set_num_threads", [ctypes.c_int], ctypes.c_int),
    ],
)


def isa() -> str:
    """The instruction set the kernels were dispatched to: ``avx512``, ``avx2`` or ``base``."""
    return LIB.jax_mlpo_isa().decode()


def set_isa(name: str | None) -> str:
    """Switches the loops to ``base``, ``avx2`` or ``avx512`` (``None``: the best available).

    For tests and benchmarks; do not call while kernels run.

    Args:
      name: the instruction set, or None for the best this CPU and build offer.

    Returns:
      The instruction set now in use.

    Raises:
      ValueError: if this CPU or build lacks ``name``.
    """
    if LIB.jax_mlpo_set_isa((name or "").encode()) != 0:
        raise ValueError(f"instruction set {name!r} is not available on this CPU or build")
    return isa()


def num_threads() -> int:
    """Threads a large kernel call is split over.

    The default is ``JAX_MLPO_NUM_THREADS`` if set, else the CPUs this process may use (its
    affinity mask, so taskset and cgroup cpusets are respected).
    """
    return LIB.jax_mlpo_num_threads()


def set_num_threads(n: int | None) -> int:
    """Sets the thread count of the kernels' pool.

    Args:
      n: the count (clamped to 1..1024), or None to go back to the default.

    Returns:
      The count now in use.
    """
    return LIB.jax_mlpo_set_num_threads(0 if n is None else max(1, int(n)))


# ---- arrays crossing into C -------------------------------------------------------------------


def address(arr: np.ndarray) -> int:
    """The address of ``arr``'s first byte."""
    return arr.ctypes.data


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
) -> dict[str, int | None]:
    """Checks the outputs every optimizer kernel shares and returns their addresses.

    Args:
      n: the element count.
      update_out: float32 (or bfloat16, as a difference to ``delta_base``) update, or None.
      delta_base: bfloat16 params the update is a difference to, or None.
      param_bf16_out: bfloat16 new params, or None.

    Returns:
      ``{name: address or None}`` for the three.

    Raises:
      ValueError: as :func:`checked_array`, or for ``delta_base`` without ``update_out``.
    """
    ptr = {}
    update_dtypes = (F32, BF16) if delta_base is not None else (F32,)
    for name, arr, dtypes, writable in [
        ("update_out", update_out, update_dtypes, True),
        ("delta_base", delta_base, (BF16,), False),
        ("param_bf16_out", param_bf16_out, (BF16,), True),
    ]:
        if arr is not None:
            arr = checked_array(name, arr, dtypes, n, writable=writable)
        ptr[name] = None if arr is None else address(arr)
    if delta_base is not None and update_out is None:
        raise ValueError("delta_base needs update_out (the update is new_param - delta_base)")
    return ptr


def check_kernel_rc(kernel: str, rc: int, moments: str) -> None:
    """Raises for an optimizer kernel's C return code (``kernels.cc``'s ``kErr*``); 0 is success.

    Args:
      kernel: the Python function's name, for the message.
      rc: the code.
      moments: the kernel's written moments (``"m, v"``), named in the overlap message.

    Raises:
      ValueError: naming the cause, for any code but 0.
    """
    if rc == 0:
        return
    causes = {
        1: "a required array is missing",
        2: f"the written arrays ({moments}, update_out, param_bf16_out, and param when "
        "update_param) must not overlap each other or the inputs",
        3: "delta_base needs update_out",
        4: "negative size",
        5: "a bfloat16 update_out needs delta_base",
        6: "nesterov is not supported with q8 moments",
    }
    raise ValueError(f"{kernel}: {causes.get(rc, f'error {rc}')}")


def overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the bytes of two C-contiguous arrays overlap (empty arrays overlap nothing)."""
    pa, pb = address(a), address(b)
    return a.nbytes > 0 and b.nbytes > 0 and pa < pb + b.nbytes and pb < pa + a.nbytes
