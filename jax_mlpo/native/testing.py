"""What only the tests and benchmarks use, on the test-only module ``jax_mlpo._native_testing``.

An editable install builds that module (pyproject.toml); a wheel does not ship it, and the
library never imports this one. Its kernels are ``jax_mlpo._native``'s, on its instruction set
and threads:

* :func:`set_isa`: switches the loops to another instruction set, to compare them.
* :func:`bf16_to_f32`, :func:`f32_to_bf16` (bit-identical to ``astype``), :func:`parallel_copy`
  and :func:`stream_triad` (the memory bandwidth the kernels can reach), on numpy arrays, split
  over the kernels' threads with the GIL released.
* :func:`host_descriptor`, :func:`copy_to_host` and :func:`copy_from_host`: two XLA FFI targets
  that move data between a jitted program and host buffers named by a runtime argument (CPU, or
  ``cudaMemcpyAsync`` on XLA's stream on a GPU backend).
* :func:`adamw_update`: the fused AdamW kernel as an XLA FFI call inside ``jax.jit``.
* :func:`crc32c_hardware` and :func:`cuda_memcpy_bench`, the benchmarks' baselines.

``jax_mlpo.native`` re-exports these names, importing this module at the first use of one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlpo.native.kernels import checked_array, overlap
from jax_mlpo.native.library import address, load
from jax_mlpo.types import BF16, F32, AdamWHyper

__all__ = [
    "adamw_update",
    "bf16_to_f32",
    "copy_from_host",
    "copy_to_host",
    "crc32c_hardware",
    "cuda_device_count",
    "cuda_memcpy_bench",
    "f32_to_bf16",
    "host_descriptor",
    "parallel_copy",
    "set_isa",
    "stream_triad",
]

_TESTING = load("jax_mlpo._native_testing")
for _name, _target in _TESTING.registrations().items():
    jax.ffi.register_ffi_target(_name, _target, platform="cpu")


def set_isa(name: str | None) -> str:
    """Switches the loops to ``base``, ``avx2`` or ``avx512`` (``None``: the best available).

    Do not call while kernels run.

    Args:
      name: the instruction set, or None for the best this CPU and build offer.

    Returns:
      The instruction set now in use.

    Raises:
      ValueError: if this CPU or build lacks ``name``.
    """
    from jax_mlpo.native.library import isa

    if not _TESTING.set_isa(name or ""):
        raise ValueError(f"instruction set {name!r} is not available on this CPU or build")
    return isa()


def crc32c_hardware() -> bool:
    """Whether :func:`jax_mlpo.native.crc32c` runs on the CPU's crc32 instruction (else a table)."""
    return bool(_TESTING.crc32c_hardware())


# ---- on numpy arrays --------------------------------------------------------------------------


def _converted(
    src: np.ndarray, dst: np.ndarray, sdt: np.dtype, ddt: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    src = checked_array("src", src, (sdt,), None, writable=False)
    dst = checked_array("dst", dst, (ddt,), src.size, writable=True)
    if overlap(src, dst):
        raise ValueError("src and dst must not overlap")
    return src, dst


def bf16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src.astype(float32)`` (exact; NaN payloads kept), multi-threaded.

    Args:
      src: bfloat16 C-contiguous array.
      dst: float32 writable C-contiguous array of the same size.

    Raises:
      ValueError: on a wrong dtype, size mismatch, non-contiguous or overlapping arrays.
    """
    src, dst = _converted(src, dst, BF16, F32)
    _TESTING.bf16_to_f32(src.view(np.uint16), dst)


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
    src, dst = _converted(src, dst, F32, BF16)
    _TESTING.f32_to_bf16(src, dst.view(np.uint16))


def stream_triad(a: np.ndarray, b: np.ndarray, c: np.ndarray, scalar: float) -> None:
    """STREAM triad ``a[i] = b[i] + scalar * c[i]`` (float32), with the kernels' threads.

    The benchmarks' measure of the memory bandwidth the AdamW kernel could reach.

    Raises:
      ValueError: on a wrong dtype, size mismatch, non-contiguous or read-only ``a``.
    """
    a = checked_array("a", a, (F32,), None, writable=True)
    b = checked_array("b", b, (F32,), a.size, writable=False)
    c = checked_array("c", c, (F32,), a.size, writable=False)
    _TESTING.triad(a, b, c, float(scalar))


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
    _TESTING.copy(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))


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
            for name, target in _cuda_testing().cuda_registrations().items():
                jax.ffi.register_ffi_target(name, target, platform="CUDA")
        _cuda_registered = True


def _cuda_testing():
    if not hasattr(_TESTING, "cuda_registrations"):
        raise ImportError(
            "jax_mlpo._native_testing was built without CUDA; rebuild with JAX_MLPO_ENABLE_CUDA=ON"
        )
    return _TESTING


def cuda_memcpy_bench(dst: int, src: int, nbytes: int, *, to_device: bool, iters: int) -> list:
    """Seconds of each of ``iters`` raw ``cudaMemcpyAsync`` + synchronize between two addresses
    on a private stream: the benchmark's baseline for the FFI copies.

    Raises:
      ImportError: if the test-only module was built without CUDA.
      RuntimeError: if CUDA refuses.
    """
    return _cuda_testing().cuda_memcpy_bench(dst, src, nbytes, to_device, iters)


def cuda_device_count() -> int:
    """The CUDA devices the test-only module sees (0 without a driver)."""
    return _cuda_testing().cuda_device_count()


# ---- the fused AdamW kernel inside jax.jit ----------------------------------------------------


def adamw_update(
    m: jax.Array,
    v: jax.Array,
    grad: jax.Array,
    param: jax.Array,
    hyper: AdamWHyper,
    *,
    update_param: bool = False,
    update_buffer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Fused AdamW as an XLA FFI call (CPU), in place when m, v (and param) are donated.

    ``hyper.lr``, ``bc1`` and ``bc2`` are runtime float32 scalars (a schedule does not
    recompile); ``b1``, ``b2``, ``eps``, ``weight_decay`` and ``grad_scale`` must be Python
    floats (compile-time attributes). Same bits as :func:`adamw_step`.

    Args:
      m, v, grad, param: as in :func:`adamw_step` (grad float32 or bfloat16), any equal shape.
      hyper: the step's scalars.
      update_param: whether the returned params include the update (then donate ``param``;
        otherwise it is only read and returned as is).
      update_buffer: a float32 buffer (e.g. last step's update, donated) to write the update
        into; saves XLA faulting in a fresh buffer every step. Its contents are ignored.

    Returns:
      ``(m, v, param, update)``: new moments, params (updated when ``update_param``, else the
      input) and the float32 update optax would return.
    """
    f32 = np.float32
    out = jax.ShapeDtypeStruct(jnp.shape(m), jnp.float32)
    scalars = [jnp.asarray(x, jnp.float32).reshape(()) for x in (hyper.lr, hyper.bc1, hyper.bc2)]
    # Inputs m, v, grad, param, lr, bc1, bc2 [, update buffer]; results m, v, update [, param].
    args = [m, v, grad, param, *scalars]
    aliases = {0: 0, 1: 1}
    if update_buffer is not None:
        args.append(update_buffer)
        aliases[7] = 2
    if update_param:
        aliases[3] = 3
    call = jax.ffi.ffi_call(
        "jax_mlpo_adamw", (out,) * (4 if update_param else 3), input_output_aliases=aliases
    )
    scale = hyper.grad_scale != 1.0
    results = call(
        *args,
        b1=f32(hyper.b1), c1=f32(1.0 - hyper.b1), b2=f32(hyper.b2), c2=f32(1.0 - hyper.b2),
        eps=f32(hyper.eps), weight_decay=f32(hyper.weight_decay),
        grad_scale=f32(hyper.grad_scale) if scale else f32(1.0),
        has_wd=bool(hyper.weight_decay != 0.0), update_param=bool(update_param),
    )  # fmt: skip
    m, v, update = results[:3]
    return m, v, results[3] if update_param else param, update
