"""The engine's CUDA calls: page-locking its host buffers, copies on XLA's stream.

On a GPU backend the host update hands the engine device buffers and XLA's stream
(:mod:`jax_mlpo.native.host_update`); the engine copies each subgroup through pinned host
buffers of its own with :class:`CudaCopier`, after :func:`cuda_host_register` has page-locked
them. These live in a separate module, ``jax_mlpo._native_cuda``, loaded only when a GPU is
present (:func:`cuda_module`). The FFI copies between XLA and host buffers, which only the
tests and benchmarks use, are in :mod:`jax_mlpo.native.testing`.
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np

from jax_mlpo.native.library import address, load

__all__ = ["CudaCopier", "cuda_host_register", "cuda_host_unregister", "cuda_module"]


@functools.cache
def cuda_module() -> ModuleType:
    """The CUDA module (``jax_mlpo._native_cuda``).

    Raises:
      ImportError: if it was not built (``JAX_MLPO_ENABLE_CUDA=ON``).
    """
    return load("jax_mlpo._native_cuda")


def cuda_host_register(buf: np.ndarray) -> None:
    """Page-locks a host buffer owned by jax_mlpo (``cudaHostRegister``, portable).

    Pinned memory lets the CUDA copies run at the link's bandwidth, asynchronously.

    Args:
      buf: the buffer; unregister it with :func:`cuda_host_unregister` before it is freed.

    Raises:
      ValueError: if ``buf`` is not C-contiguous.
      ImportError: if the CUDA module is not built.
      RuntimeError: if CUDA refuses.
    """
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise ValueError("the host buffer must be a C-contiguous numpy array")
    cuda_module().host_register(address(buf), buf.nbytes)


def cuda_host_unregister(buf: np.ndarray) -> None:
    """Undoes :func:`cuda_host_register` (call before the buffer is freed).

    Raises:
      ImportError: if the CUDA module is not built.
      RuntimeError: if CUDA refuses.
    """
    cuda_module().host_unregister(address(buf))


class CudaCopier:
    """Copies between host arrays and device addresses with ``cudaMemcpyAsync`` on one stream
    (XLA's, handed to the host update): the :class:`jax_mlpo.engine.leaves.Copier` of a GPU.

    Args:
      stream: the ``cudaStream_t``, as an int.
    """

    def __init__(self, stream: int) -> None:
        self._stream = stream
        self._cuda = cuda_module()

    def to_host(self, dst: np.ndarray, src: int) -> None:
        if dst.nbytes:
            self._cuda.memcpy_async(address(dst), src, dst.nbytes, False, self._stream)

    def to_device(self, dst: int, src: np.ndarray) -> None:
        if src.nbytes:
            self._cuda.memcpy_async(dst, address(src), src.nbytes, True, self._stream)

    def synchronize(self) -> None:
        self._cuda.stream_synchronize(self._stream)
