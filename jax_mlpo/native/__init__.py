"""The native host kernels (C++, ``jax_mlpo._native``) and their XLA FFI targets.

One module per concern of the compiled library, all re-exported here:

* :mod:`~jax_mlpo.native.library`: loading the library; :func:`isa`, :func:`set_isa`,
  :func:`num_threads`, :func:`set_num_threads`.
* :mod:`~jax_mlpo.native.adamw`: the fused AdamW kernel, :func:`adamw_step` on numpy arrays
  (bit for bit :func:`jax_mlpo.optimizers.adamw.adamw_step_reference`) and
  :func:`adamw_update` inside ``jax.jit``.
* :mod:`~jax_mlpo.native.lion`: the fused Lion kernel, :func:`lion_step` on numpy arrays.
* :mod:`~jax_mlpo.native.muon`: Muon's host passes, :func:`momentum_step` and
  :func:`apply_step` on numpy arrays.
* :mod:`~jax_mlpo.native.copies`: host buffers and XLA: :func:`host_descriptor`,
  :func:`copy_to_host`, :func:`copy_from_host` (CPU, or ``cudaMemcpyAsync`` on a GPU backend),
  :func:`cuda_host_register`, and :func:`bf16_to_f32`, :func:`f32_to_bf16`,
  :func:`parallel_copy`, :func:`stream_triad` on numpy arrays.
* :mod:`~jax_mlpo.native.crc32c`: :func:`crc32c`, the file tiers' checksum.

Importing any of them loads the library and registers the CPU FFI targets (this package's
``__init__`` imports them all); the CUDA module is loaded at the first copy on a GPU backend.
"""

from __future__ import annotations

from jax_mlpo.native.adamw import adamw_step, adamw_update
from jax_mlpo.native.copies import (
    bf16_to_f32,
    copy_from_host,
    copy_to_host,
    cuda_host_register,
    cuda_host_unregister,
    f32_to_bf16,
    host_descriptor,
    parallel_copy,
    stream_triad,
)

# Binds the name crc32c to the function, over the submodule of the same name: native.crc32c(...)
# keeps working; import the module itself as ``from jax_mlpo.native.crc32c import ...``.
from jax_mlpo.native.crc32c import crc32c, crc32c_hardware
from jax_mlpo.native.library import isa, num_threads, set_isa, set_num_threads
from jax_mlpo.native.lion import lion_step
from jax_mlpo.native.muon import apply_step, momentum_step

__all__ = [
    "adamw_step",
    "apply_step",
    "adamw_update",
    "bf16_to_f32",
    "copy_from_host",
    "copy_to_host",
    "crc32c",
    "crc32c_hardware",
    "cuda_host_register",
    "cuda_host_unregister",
    "f32_to_bf16",
    "host_descriptor",
    "isa",
    "lion_step",
    "momentum_step",
    "num_threads",
    "parallel_copy",
    "set_isa",
    "set_num_threads",
    "stream_triad",
]
