"""The native host kernels (C++, ``jax_mlpo._native``) and their XLA FFI targets.

One module per concern of the compiled library, all re-exported here:

* :mod:`~jax_mlpo.native.library`: loading the library; :func:`isa`, :func:`num_threads`,
  :func:`set_num_threads`.
* :mod:`~jax_mlpo.native.adamw`: the fused AdamW kernel, :func:`adamw_step` on numpy arrays
  (bit for bit :func:`jax_mlpo.optimizers.adamw.adamw_step_reference`).
* :mod:`~jax_mlpo.native.lion`: the fused Lion kernel, :func:`lion_step` on numpy arrays.
* :mod:`~jax_mlpo.native.muon`: Muon's host passes, :func:`momentum_step` and
  :func:`apply_step` on numpy arrays.
* :mod:`~jax_mlpo.native.host_update`: the update transport, the FFI call whose handler hands
  XLA's buffers to the engine.
* :mod:`~jax_mlpo.native.copies`: :func:`cuda_host_register` and the engine's CUDA copies
  (``jax_mlpo._native_cuda``, loaded at the first use on a GPU backend).
* :mod:`~jax_mlpo.native.crc32c`: :func:`crc32c`, the file tiers' checksum.
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

from jax_mlpo.native.adamw import adamw_step
from jax_mlpo.native.copies import cuda_host_register, cuda_host_unregister

# Binds the name crc32c to the function, over the submodule of the same name: native.crc32c(...)
# keeps working; import the module itself as ``from jax_mlpo.native.crc32c import ...``.
from jax_mlpo.native.crc32c import crc32c
from jax_mlpo.native.library import isa, num_threads, set_num_threads
from jax_mlpo.native.lion import lion_step
from jax_mlpo.native.muon import apply_step, momentum_step

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
