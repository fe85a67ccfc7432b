"""The native host kernels (C++, ``jax_mlpo._native``) and their XLA FFI targets.

Two ways in:

* **Direct calls on numpy arrays** (the engine's path): :func:`adamw_step` (same signature and
  bit-for-bit the same results as :func:`jax_mlpo.kernels.adamw_step_reference`),
  :func:`bf16_to_f32`, :func:`f32_to_bf16`. They are ctypes calls, so the GIL is released while
  the kernel runs; calls over more than 64K elements are split over a thread pool
  (``JAX_MLPO_NUM_THREADS``, default: the CPUs this process may use).
* **XLA FFI targets**, usable inside ``jax.jit``: :func:`adamw_update` (in place through
  ``input_output_aliases``; donate m, v, and param when updated) and :func:`copy_to_host` /
  :func:`copy_from_host` between XLA buffers and host buffers owned by jax_mlpo, named by a
  runtime descriptor (:func:`host_descriptor`) so that a new buffer does not recompile. On a
  GPU backend the same targets copy with ``cudaMemcpyAsync`` on XLA's stream
  (``jax_mlpo._native_cuda``, loaded only when a GPU is present); :func:`cuda_host_register`
  page-locks a buffer for them.

The library picks AVX-512, AVX2 or baseline x86-64 loops at load time (:func:`isa`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_mlpo.kernels import BF16, F32, AdamWHyper

__all__ = [
    "adamw_step",
    "adamw_update",
    "bf16_to_f32",
    "copy_from_host",
    "copy_to_host",
    "cuda_host_register",
    "crc32c",
    "crc32c_hardware",
    "cuda_host_unregister",
    "f32_to_bf16",
    "host_descriptor",
    "isa",
    "num_threads",
    "parallel_copy",
    "set_isa",
    "set_num_threads",
    "stream_triad",
]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SCALARS = ctypes.c_float * 10
_ADAMW_ERRORS = {
    1: "a required array is missing",
    2: "the written arrays (m, v, update_out, param_bf16_out, and param when update_param) must "
    "not overlap each other or the inputs",
    3: "delta_base needs update_out",
    4: "negative size",
}


def _load(module: str) -> ctypes.CDLL:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(
            f"{module} is not built; build the package with "
            "`pip install --no-build-isolation -e .` (needs cmake and a C++17 compiler)"
        )
    return ctypes.CDLL(spec.origin)


_LIB = _load("jax_mlpo._native")
for _name, _args, _ret in [
    ("jax_mlpo_isa", [], ctypes.c_char_p),
    ("jax_mlpo_set_isa", [ctypes.c_char_p], ctypes.c_int),
    ("jax_mlpo_num_threads", [], ctypes.c_int),
    ("jax_mlpo_set_num_threads", [ctypes.c_int], ctypes.c_int),
    ("jax_mlpo_adamw_step", [_P, _P, _P, ctypes.c_int, _P, ctypes.c_int, _P, _P, _P, _I64,
                             _SCALARS, ctypes.c_int], ctypes.c_int),
    ("jax_mlpo_bf16_to_f32", [_P, _P, _I64], None),
    ("jax_mlpo_f32_to_bf16", [_P, _P, _I64], None),
    ("jax_mlpo_triad", [_P, _P, _P, ctypes.c_float, _I64], None),
    ("jax_mlpo_copy", [_P, _P, _I64], None),
    ("jax_mlpo_crc32c", [_P, ctypes.c_size_t, ctypes.c_uint32], ctypes.c_uint32),
    ("jax_mlpo_crc32c_hardware", [], ctypes.c_int),
]:  # fmt: skip
    getattr(_LIB, _name).argtypes = _args
    getattr(_LIB, _name).restype = _ret

for _target, _symbol in [
    ("jax_mlpo_adamw", "JaxMlpoAdamW"),
    ("jax_mlpo_to_host", "JaxMlpoToHost"),
    ("jax_mlpo_from_host", "JaxMlpoFromHost"),
]:
    jax.ffi.register_ffi_target(_target, jax.ffi.pycapsule(getattr(_LIB, _symbol)), platform="cpu")


def isa() -> str:
    """The instruction set the kernels were dispatched to: ``avx512``, ``avx2`` or ``base``."""
    return _LIB.jax_mlpo_isa().decode()


def set_isa(name: str | None) -> str:
    """Switches the loops to ``base``, ``avx2`` or ``avx512`` (``None``: the best available).

    For tests and benchmarks; do not call while kernels run. Returns the instruction set now in
    use.

    Raises:
      ValueError: if this CPU or build lacks ``name``.
    """
    if _LIB.jax_mlpo_set_isa((name or "").encode()) != 0:
        raise ValueError(f"instruction set {name!r} is not available on this CPU or build")
    return isa()


def num_threads() -> int:
    """Threads a large kernel call is split over."""
    return _LIB.jax_mlpo_num_threads()


def set_num_threads(n: int | None) -> int:
    """Sets the thread count (``None``: back to the default); returns the count now in use."""
    return _LIB.jax_mlpo_set_num_threads(0 if n is None else max(1, int(n)))


def crc32c(data: np.ndarray | memoryview | bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``'s bytes, continuing from ``crc``.

    The standard checksum (as zarr3's ``crc32c`` codec and google-crc32c compute it), with the
    CPU's crc32 instruction where there is one (several GB/s) and the GIL released.

    Args:
      data: a C-contiguous numpy array, a contiguous buffer or bytes.
      crc: the checksum of the bytes before ``data`` (0 to start).

    Returns:
      The checksum as an unsigned 32-bit int.
    """
    view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else None
    if view is not None:
        arr = np.frombuffer(view, np.uint8)
    else:
        if not data.flags.c_contiguous:
            raise ValueError("crc32c needs a C-contiguous array")
        arr = data
    return _LIB.jax_mlpo_crc32c(_address(arr) if arr.size else None, arr.nbytes, crc)


def crc32c_hardware() -> bool:
    """Whether :func:`crc32c` runs on the CPU's crc32 instruction (else a table)."""
    return bool(_LIB.jax_mlpo_crc32c_hardware())


# ---- validation -------------------------------------------------------------------------------


def _address(arr: np.ndarray) -> int:
    return arr.ctypes.data


def _array(
    name: str,
    arr: object,
    dtypes: Sequence[np.dtype],
    size: int | None,
    *,
    writable: bool,
) -> np.ndarray:
    """Checks one argument; read-only inputs may be anything np.asarray accepts (a jax.Array)."""
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


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    pa, pb = _address(a), _address(b)
    return a.nbytes > 0 and b.nbytes > 0 and pa < pb + b.nbytes and pb < pa + a.nbytes


# ---- direct calls on numpy arrays -------------------------------------------------------------


def adamw_step(
    m: np.ndarray,
    v: np.ndarray,
    grad: np.ndarray,
    param: np.ndarray,
    update_out: np.ndarray | None,
    hyper: AdamWHyper,
    *,
    update_param: bool = False,
    delta_base: np.ndarray | None = None,
    param_bf16_out: np.ndarray | None = None,
) -> None:
    """One fused AdamW step over a contiguous segment, in place (native, multi-threaded).

    Same arguments and the same bits as :func:`jax_mlpo.kernels.adamw_step_reference`: the same
    float32 operations in the same order (no FMA, IEEE division and square root, denormals kept),
    hence equal to ``optax.adamw`` to float32 rounding. Arrays may be views into larger buffers;
    ``grad``, ``delta_base`` and ``param`` (unless ``update_param``) may be read-only.

    Args:
      m: float32 first moment, updated in place.
      v: float32 second moment, updated in place.
      grad: float32 or bfloat16 gradient (bfloat16 is converted on the fly).
      param: float32 parameters; read for weight decay, updated in place when ``update_param``.
      update_out: float32 output for the update, or None; with ``delta_base`` it receives
        ``new_param - float32(delta_base)``.
      hyper: the step's scalars.
      update_param: whether to add the update to ``param`` in place.
      delta_base: bfloat16 params the caller will add the update to, or None.
      param_bf16_out: bfloat16 output for the new params (round to nearest even), or None.

    Raises:
      ValueError: on a wrong dtype, a non-contiguous or read-only output, a size mismatch,
        overlapping outputs, or ``delta_base`` without ``update_out``.
    """
    m = _array("m", m, (F32,), None, writable=True)
    n = m.size
    v = _array("v", v, (F32,), n, writable=True)
    grad = _array("grad", grad, (F32, BF16), n, writable=False)
    param = _array("param", param, (F32,), n, writable=update_param)
    ptr = {}
    for name, arr, dtype, writable in [
        ("update_out", update_out, F32, True),
        ("delta_base", delta_base, BF16, False),
        ("param_bf16_out", param_bf16_out, BF16, True),
    ]:
        if arr is not None:
            arr = _array(name, arr, (dtype,), n, writable=writable)
        ptr[name] = None if arr is None else _address(arr)
    if delta_base is not None and update_out is None:
        raise ValueError("delta_base needs update_out (the update is new_param - delta_base)")
    # The scalars exactly as the reference computes them: the same Python expressions, rounded
    # once to float32 (ctypes' double -> float conversion rounds to nearest even, like numpy).
    scale = hyper.grad_scale != 1.0
    scalars = _SCALARS(
        float(1.0 - hyper.b1), float(hyper.b1), float(1.0 - hyper.b2), float(hyper.b2),
        float(hyper.bc1), float(hyper.bc2), float(hyper.eps), float(hyper.weight_decay),
        float(-hyper.lr), float(hyper.grad_scale) if scale else 1.0,
    )  # fmt: skip
    rc = _LIB.jax_mlpo_adamw_step(
        _address(m), _address(v), _address(grad), int(grad.dtype == BF16), _address(param),
        int(update_param), ptr["update_out"], ptr["delta_base"], ptr["param_bf16_out"], n,
        scalars, int(hyper.weight_decay != 0.0),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"adamw_step: {_ADAMW_ERRORS.get(rc, f'error {rc}')}")


def _convert(src: np.ndarray, dst: np.ndarray, sdt: np.dtype, ddt: np.dtype, fn: str) -> None:
    src = _array("src", src, (sdt,), None, writable=False)
    dst = _array("dst", dst, (ddt,), src.size, writable=True)
    if _overlap(src, dst):
        raise ValueError("src and dst must not overlap")
    getattr(_LIB, fn)(_address(src), _address(dst), src.size)


def bf16_to_f32(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src.astype(float32)`` (exact; NaN payloads kept), multi-threaded.

    Raises:
      ValueError: on a wrong dtype, size mismatch, non-contiguous or overlapping arrays.
    """
    _convert(src, dst, BF16, F32, "jax_mlpo_bf16_to_f32")


def f32_to_bf16(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src.astype(bfloat16)``: round to nearest even, bit-identical to ``jnp.astype``.

    NaN becomes the quiet NaN ``sign | 0x7fc0`` (as XLA and ml_dtypes do), overflow rounds to
    inf, denormals are kept.

    Raises:
      ValueError: on a wrong dtype, size mismatch, non-contiguous or overlapping arrays.
    """
    _convert(src, dst, F32, BF16, "jax_mlpo_f32_to_bf16")


def stream_triad(a: np.ndarray, b: np.ndarray, c: np.ndarray, scalar: float) -> None:
    """STREAM triad ``a[i] = b[i] + scalar * c[i]`` (float32), with the kernels' threads."""
    a = _array("a", a, (F32,), None, writable=True)
    b = _array("b", b, (F32,), a.size, writable=False)
    c = _array("c", c, (F32,), a.size, writable=False)
    _LIB.jax_mlpo_triad(_address(a), _address(b), _address(c), float(scalar), a.size)


def parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``memcpy`` of ``src`` into ``dst`` (same byte size), split over the kernels' threads."""
    if not isinstance(dst, np.ndarray) or not dst.flags.writeable or not dst.flags.c_contiguous:
        raise ValueError("dst must be a writable C-contiguous numpy array")
    src = np.asarray(src)
    if not src.flags.c_contiguous or src.nbytes != dst.nbytes:
        raise ValueError(f"src must be C-contiguous with {dst.nbytes} bytes, has {src.nbytes}")
    _LIB.jax_mlpo_copy(_address(dst), _address(src), dst.nbytes)


# ---- XLA FFI targets (inside jax.jit) ---------------------------------------------------------


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


def host_descriptor(buf: np.ndarray, *, writable: bool = True) -> np.ndarray:
    """The ``uint32[4]`` descriptor (address lo, hi, bytes lo, hi) naming a host buffer.

    Pass it as a runtime argument to :func:`copy_to_host` / :func:`copy_from_host`: a new buffer
    gives a new value, not a new program. The caller keeps ``buf`` alive and unchanged until the
    copies that use it have completed (the returned token / array is ready).

    Raises:
      ValueError: if ``buf`` is not a C-contiguous numpy array (writable unless ``writable`` is
        False, for buffers that are only read from).
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise ValueError("the host buffer must be a C-contiguous numpy array")
    if writable and not buf.flags.writeable:
        raise ValueError("the host buffer is read-only (pass writable=False to only read from it)")
    addr, nbytes = _address(buf), buf.nbytes
    return np.array([addr & 0xFFFFFFFF, addr >> 32, nbytes & 0xFFFFFFFF, nbytes >> 32], np.uint32)


def copy_to_host(x: jax.Array, descriptor: jax.Array | np.ndarray) -> jax.Array:
    """Copies ``x``'s bytes into the host buffer named by ``descriptor`` (an FFI call).

    Returns the descriptor as an ordering token: the host buffer holds the data once the token
    is ready (GPU: the copy is asynchronous on XLA's stream). Feed the token to
    :func:`copy_from_host` to order a read after the write. Errors if ``x`` is larger than the
    buffer.
    """
    _ensure_cuda_targets()
    token = jax.ShapeDtypeStruct((4,), jnp.uint32)
    return jax.ffi.ffi_call("jax_mlpo_to_host", token, has_side_effect=True)(x, descriptor)


def copy_from_host(
    descriptor: jax.Array | np.ndarray, shape: Sequence[int], dtype: jnp.dtype
) -> jax.Array:
    """A new array of ``shape``/``dtype`` filled from the host buffer named by ``descriptor``."""
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
def _cuda_lib() -> ctypes.CDLL:
    lib = _load("jax_mlpo._native_cuda")
    for name, args, ret in [
        ("jax_mlpo_cuda_device_count", [], ctypes.c_int),
        ("jax_mlpo_cuda_error_string", [ctypes.c_int], ctypes.c_char_p),
        ("jax_mlpo_cuda_host_register", [_P, ctypes.c_size_t], ctypes.c_int),
        ("jax_mlpo_cuda_host_unregister", [_P], ctypes.c_int),
        ("jax_mlpo_cuda_memcpy_bench", [_P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_double)], ctypes.c_int),
    ]:  # fmt: skip
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ret
    return lib


def _ensure_cuda_targets() -> None:
    """Registers the CUDA copy targets once, and only when a GPU backend is present."""
    global _cuda_registered
    if _cuda_registered:
        return
    with _CUDA_LOCK:
        if not _cuda_registered and _gpu_present():
            lib = _cuda_lib()
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
        raise RuntimeError(f"{what}: {_cuda_lib().jax_mlpo_cuda_error_string(rc).decode()}")


def cuda_host_register(buf: np.ndarray) -> None:
    """Page-locks a host buffer owned by jax_mlpo (``cudaHostRegister``, portable).

    Raises:
      ValueError: if ``buf`` is not C-contiguous.
      RuntimeError: if the CUDA module is not built or CUDA refuses.
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise ValueError("the host buffer must be a C-contiguous numpy array")
    rc = _cuda_lib().jax_mlpo_cuda_host_register(_address(buf), buf.nbytes)
    _cuda_check(rc, "cudaHostRegister")


def cuda_host_unregister(buf: np.ndarray) -> None:
    """Undoes :func:`cuda_host_register` (call before the buffer is freed)."""
    _cuda_check(_cuda_lib().jax_mlpo_cuda_host_unregister(_address(buf)), "cudaHostUnregister")
