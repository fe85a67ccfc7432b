"""The native host kernels (C++, ``jax_mlpo._native``) and their XLA FFI targets.

One module per concern of the compiled library, all re-exported here:

* :mod:`~jax_mlpo.native.library`: loading the library; :func:`isa`, :func:`num_threads`,
  :func:`set_num_threads`.
* :mod:`~jax_mlpo.native.kernels`: the library's functions on numpy arrays, their arguments
  checked: the fused kernels :func:`adamw_step` (bit for bit
  :func:`jax_mlpo.optimizers.adamw.adamw_step_reference`), :func:`lion_step`, Muon's host passes
  :func:`momentum_step` and :func:`apply_step`, the q8 moment code, and :func:`crc32c`, the
  file tiers' checksum.
* :mod:`~jax_mlpo.native.host_update`: the update transport, the FFI call whose handler hands
  XLA's buffers to the engine.
* :mod:`~jax_mlpo.native.copies`: :func:`cuda_host_register` and the engine's CUDA copies
  (``jax_mlpo._native_cuda``, loaded at the first use on a GPU backend).
* :mod:`~jax_mlpo.native.testing`: what only tests and benchmarks use, on the test-only module
  ``jax_mlpo._native_testing`` that a wheel does not ship: :func:`set_isa`,
  :func:`adamw_update` inside ``jax.jit``, :func:`host_descriptor`, :func:`copy_to_host`,
  :func:`copy_from_host`, :func:`bf16_to_f32`, :func:`f32_to_bf16`, :func:`parallel_copy`,
  :func:`stream_triad`, :func:`crc32c_hardware`. Re-exported here too, imported at the first
  use of one of them.

Importing this package loads the library; importing :mod:`~jax_mlpo.native.host_update`
registers the host update's CPU FFI target.
"""

from __future__ import annotations

from jax_mlpo.native.copies import cuda_host_register, cuda_host_unregister
from jax_mlpo.native.kernels import adamw_step, apply_step, crc32c, lion_step, momentum_step
from jax_mlpo.native.library import isa, num_threads, set_num_threads

# The test-only names (jax_mlpo.native.testing), loaded at their first use.
_TESTING = (
    "adamw_update", "bf16_to_f32", "copy_from_host", "copy_to_host", "crc32c_hardware",
    "f32_to_bf16", "host_descriptor", "parallel_copy", "set_isa", "stream_triad",
)  # fmt: skip

__all__ = [
    "adamw_step",
    "apply_step",
    "crc32c",
    "cuda_host_register",
    "cuda_host_unregister",
    "isa",
    "lion_step",
    "momentum_step",
    "num_threads",
    "set_num_threads",
]


def __getattr__(name: str) -> object:
    if name in _TESTING:
        from jax_mlpo.native import testing

        return getattr(testing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
