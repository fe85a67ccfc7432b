"""Host buffers and the copies between them and XLA: descriptors, FFI copies, bf16 <-> f32.

The engine owns its host buffers (numpy arrays); a jitted step moves data into and out of them
with two XLA FFI targets, :func:`copy_to_host` and :func:`copy_from_host`. The buffer is named
by a runtime argument, its descriptor (:func:`host_descriptor`: address and size as
``uint32[4]``), not baked into the program, so that a new buffer does not recompile. On a GPU
backend the same target names copy with ``cudaMemcpyAsync`` on XLA's stream; their handlers
live in a separate module, ``jax_mlpo._native_cuda``, loaded only when a GPU is present, and
:func:`cuda_host_register` page-locks a buffer for them.

Outside XLA, on numpy arrays: the dtype conversions :func:`bf16_to_f32` and
:func:`f32_to_bf16` (bit-identical to ``astype``), :func:`parallel_copy` and
:func:`stream_triad` (the memory bandwidth the kernels can reach), all split over the kernels'
threads with the GIL released.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlpo.native.library import I64, LIB, P, address, checked_array, declare, load, overlap
from jax_mlpo.types import BF16, F32

__all__ = [
    "bf16_to_f32",
    "copy_from_host",
    "copy_to_host",
    "CudaCopier",
    "cuda_host_register",
    "cuda_lib",
    "cuda_host_unregister",
    "f32_to_bf16",
    "host_descriptor",
    "parallel_copy",
    "stream_triad",
]

declare(
    LIB,
    [
        ("jax_mlpo_bf16_to_f32", [P, P, I64], None),
        ("jax_mlpo_f32_to_bf16", [P, P, I64], None),
        ("jax_mlpo_triad", [P, P, P, ctypes.c_float, I64], None),
        ("jax_mlpo_copy", [P, P, I64], None),
    ],
)
for _target, _symbol in [
    ("jax_mlpo_to_host", "JaxMlpoToHost"),
    ("jax_mlpo_from_host", "JaxMlpoFromHost"),
]:
    jax.ffi.register_ffi_target(_target, jax.ffi.pycapsule(getattr(LIB, _symbol)), platform="cpu")


# ---- on numpy arrays --------------------------------------------------------------------------


def _convert(src: np.ndarray, dst: np.ndarray, sdt: np.dtype, ddt: np.dtype, fn: str) -> None:
    src = checked_array("src", src, (sdt,), None, writable=False)
    dst = checked_array("dst", dst, (ddt,), src.size, writable=True)
    if overlap(src, dst):
        raise ValueError("src and dst must not overlap")
    getattr(LIB, fn)(address(src), address(dst), src.size)


def bf16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src.astype(float32)`` (exact; NaN payloads kept), multi-threaded.

    Args:
      src: bfloat16 C-contiguous array.
      dst: float32 writable C-contiguous array of the same size.

    Raises:
      ValueError: on a wrong dtype, size mismatch, non-contiguous or overlapping arrays.
    """
    _convert(src, dst, BF16, F32, "jax_mlpo_bf16_to_f32")


def f32_to_bf16(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src.astype(bfloat16)``: round to nearest even, bit-identical to ``jnp.astype``.

    NaN becomes the quiet NaN ``sign | 0x7fc0`` (as XLA and ml_dtypes do), overflow rounds to
    inf, denormals are kept.

    Args:
      src: float32 C-contiguous array.
      dst: bfloat16 writable C-contiguous array of the same size.

    Raises:
      ValueError: on a wrong dtype, size mismatch, non-contiguous or overlapping arrays.
    """
    _convert(src, dst, F32, BF16, "jax_mlpo_f32_to_bf16")


def stream_triad(a: np.ndarray, b: np.ndarray, c: np.ndarray, scalar: float) -> None:
    """STREAM triad ``a[i] = b[i] + scalar * c[i]`` (float32), with the kernels' threads.

    The benchmarks' measure of the memory bandwidth the AdamW kernel could reach.

    Raises:
      ValueError: on a wrong dtype, size mismatch, non-contiguous or read-only ``a``.
    """
    a = checked_array("a", a, (F32,), None, writable=True)
    b = checked_array("b", b, (F32,), a.size, writable=False)
    c = checked_array("c", c, (F32,), a.size, writable=False)
    LIB.jax_mlpo_triad(address(a), address(b), address(c), float(scalar), a.size)


def parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``memcpy`` of ``src`` into ``dst`` (same byte size), split over the kernels' threads.

    Raises:
      ValueError: if ``dst`` is not a writable C-contiguous numpy array, or ``src`` is not
        C-contiguous with as many bytes.
    """
    if not isinstance(dst, np.ndarray) or not dst.flags.writeable or not dst.flags.c_contiguous:
        raise ValueError("dst must be a writable C-contiguous numpy array")
    src = np.asarray(src)
    if not src.flags.c_contiguous or src.nbytes != dst.nbytes:
        raise ValueError(f"src must be C-contiguous with {dst.nbytes} bytes, has {src.nbytes}")
    LIB.jax_mlpo_copy(address(dst), address(src), dst.nbytes)


# ---- XLA FFI copies (inside jax.jit) ----------------------------------------------------------


def host_descriptor(buf: np.ndarray, *, writable: bool = True) -> np.ndarray:
    """The ``uint32[4]`` descriptor (address lo, hi, bytes lo, hi) naming a host buffer.

    Pass it as a runtime argument to :func:`copy_to_host` / :func:`copy_from_host`: a new buffer
    gives a new value, not a new program. The caller keeps ``buf`` alive and unchanged until the
    copies that use it have completed (the returned token / array is ready).

    Args:
      buf: the host buffer.
      writable: whether copies will write to it (:func:`copy_to_host`); False for buffers that
        are only read from.

    Returns:
      The descriptor, a ``uint32`` array of 4 (uint32 rather than uint64: jax disables 64-bit
      types by default).

    Raises:
      ValueError: if ``buf`` is not a C-contiguous numpy array, or is read-only and
        ``writable``.
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise ValueError("the host buffer must be a C-contiguous numpy array")
    if writable and not buf.flags.writeable:
        raise ValueError("the host buffer is read-only (pass writable=False to only read from it)")
    addr, nbytes = address(buf), buf.nbytes
    return np.array([addr & 0xFFFFFFFF, addr >> 32, nbytes & 0xFFFFFFFF, nbytes >> 32], np.uint32)


def copy_to_host(x: jax.Array, descriptor: jax.Array | np.ndarray) -> jax.Array:
    """Copies ``x``'s bytes into the host buffer named by ``descriptor`` (an FFI call).

    Args:
      x: the array to copy; at most the buffer's size in bytes.
      descriptor: from :func:`host_descriptor`.

    Returns:
      The descriptor, as an ordering token: the host buffer holds the data once the token is
      ready (GPU: the copy is asynchronous on XLA's stream). Feed the token to
      :func:`copy_from_host` to order a read after the write.

    Raises:
      jax.errors.JaxRuntimeError: when the program runs, if ``x`` is larger than the buffer.
    """
    _ensure_cuda_targets()
    token = jax.ShapeDtypeStruct((4,), jnp.uint32)
    return jax.ffi.ffi_call("jax_mlpo_to_host", token, has_side_effect=True)(x, descriptor)


def copy_from_host(
    descriptor: jax.Array | np.ndarray, shape: Sequence[int], dtype: jnp.dtype
) -> jax.Array:
    """A new array filled from the host buffer named by ``descriptor`` (an FFI call).

    Args:
      descriptor: from :func:`host_descriptor`, or a token of :func:`copy_to_host`.
      shape: the new array's shape.
      dtype: the new array's dtype.

    Returns:
      The array of ``shape`` and ``dtype``, its bytes copied from the buffer's start.

    Raises:
      jax.errors.JaxRuntimeError: when the program runs, if the array is larger than the buffer.
    """
    _ensure_cuda_targets()
    out = jax.ShapeDtypeStruct(tuple(shape), dtype)
    return jax.ffi.ffi_call("jax_mlpo_from_host", out, has_side_effect=True)(descriptor)


# ---- CUDA -------------------------------------------------------------------------------------

_CUDA_LOCK = threading.Lock()
_cuda_registered = False


def _gpu_present() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@functools.cache
def cuda_lib() -> ctypes.CDLL:
    """The CUDA module (``jax_mlpo._native_cuda``), its functions declared.

    Raises:
      ImportError: if it was not built (``JAX_MLPO_ENABLE_CUDA=ON``).
    """
    lib = load("jax_mlpo._native_cuda")
    declare(
        lib,
        [
            ("jax_mlpo_cuda_device_count", [], ctypes.c_int),
            ("jax_mlpo_cuda_error_string", [ctypes.c_int], ctypes.c_char_p),
            ("jax_mlpo_cuda_host_register", [P, ctypes.c_size_t], ctypes.c_int),
            ("jax_mlpo_cuda_host_unregister", [P], ctypes.c_int),
            ("jax_mlpo_cuda_memcpy_bench", [P, P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_double)], ctypes.c_int),
            ("jax_mlpo_cuda_memcpy_async", [P, P, ctypes.c_size_t, ctypes.c_int, P],
             ctypes.c_int),
            ("jax_mlpo_cuda_stream_synchronize", [P], ctypes.c_int),
        ],
    )  # fmt: skip
    return lib


def _ensure_cuda_targets() -> None:
    """Registers the CUDA copy targets once, and only when a GPU backend is present.

    At the first copy rather than at import: asking for the devices initializes jax's
    backends, which must wait until the program has configured jax (``jax.distributed`` first).
    """
    global _cuda_registered
    if _cuda_registered:
        return
    with _CUDA_LOCK:
        if not _cuda_registered and _gpu_present():
            lib = cuda_lib()
            for target, symbol in [
                ("jax_mlpo_to_host", "JaxMlpoCudaToHost"),
                ("jax_mlpo_from_host", "JaxMlpoCudaFromHost"),
            ]:
                jax.ffi.register_ffi_target(
                    target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA"
                )
        _cuda_registered = True


def _cuda_check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {cuda_lib().jax_mlpo_cuda_error_string(rc).decode()}")


def cuda_host_register(buf: np.ndarray) -> None:
    """Page-locks a host buffer owned by jax_mlpo (``cudaHostRegister``, portable).

    Pinned memory lets the CUDA copies run at the link's bandwidth, asynchronously.

    Args:
      buf: the buffer; unregister it with :func:`cuda_host_unregister` before it is freed.

    Raises:
      ValueError: if ``buf`` is not C-contiguous.
      RuntimeError: if the CUDA module is not built or CUDA refuses.
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise ValueError("the host buffer must be a C-contiguous numpy array")
    rc = cuda_lib().jax_mlpo_cuda_host_register(address(buf), buf.nbytes)
    _cuda_check(rc, "cudaHostRegister")


def cuda_host_unregister(buf: np.ndarray) -> None:
    """Undoes :func:`cuda_host_register` (call before the buffer is freed).

    Raises:
      RuntimeError: if the CUDA module is not built or CUDA refuses.
    """
    _cuda_check(cuda_lib().jax_mlpo_cuda_host_unregister(address(buf)), "cudaHostUnregister")


class CudaCopier:
    """Copies between host arrays and device addresses with ``cudaMemcpyAsync`` on one stream
    (XLA's, handed to the host update): the :class:`jax_mlpo.engine.leaves.Copier` of a GPU.

    Args:
      stream: the ``cudaStream_t``, as an int.
    """

    def __init__(self, stream: int) -> None:
        self._stream = stream
        self._lib = cuda_lib()

    def to_host(self, dst: np.ndarray, src: int) -> None:
        if dst.nbytes:
            rc = self._lib.jax_mlpo_cuda_memcpy_async(
                address(dst), src, dst.nbytes, 2, self._stream
            )
            _cuda_check(rc, "cudaMemcpyAsync (device to host)")

    def to_device(self, dst: int, src: np.ndarray) -> None:
        if src.nbytes:
            rc = self._lib.jax_mlpo_cuda_memcpy_async(
                dst, address(src), src.nbytes, 1, self._stream
            )
            _cuda_check(rc, "cudaMemcpyAsync (host to device)")

    def synchronize(self) -> None:
        _cuda_check(
            self._lib.jax_mlpo_cuda_stream_synchronize(self._stream), "cudaStreamSynchronize"
        )
