// The runtime u32[4] descriptor that names a host buffer owned by jax_mlpo in an FFI copy
// (address lo/hi, capacity in bytes lo/hi; jax_mlpo.native.testing.host_descriptor makes it),
// decoded the same way by the CPU handlers (ffi_cpu.cc) and the CUDA ones (cuda_common.h).
#ifndef JAX_MLPO_FFI_HOST_DESCRIPTOR_H_
#define JAX_MLPO_FFI_HOST_DESCRIPTOR_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_mlpo {

struct HostSpan {
  char* data;
  uint64_t capacity;
};

// The buffer a descriptor names, checked to hold nbytes. `d` is the descriptor in host memory.
inline xla::ffi::ErrorOr<HostSpan> DecodeDescriptor(const uint32_t* d, size_t nbytes,
                                                    const std::string& who) {
  namespace ffi = xla::ffi;
  HostSpan span{reinterpret_cast<char*>(uint64_t(d[0]) | uint64_t(d[1]) << 32),
                uint64_t(d[2]) | uint64_t(d[3]) << 32};
  if (nbytes > span.capacity) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        who + ": the XLA buffer has " + std::to_string(nbytes) + " bytes but the host buffer only " +
        std::to_string(span.capacity)));
  }
  if (span.data == nullptr && nbytes > 0) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(who + ": null host address"));
  }
  return span;
}

// Fails unless the descriptor operand is u32[4].
inline xla::ffi::Error CheckDescriptor(const xla::ffi::Buffer<xla::ffi::U32>& desc,
                                       const std::string& who) {
  if (desc.element_count() != 4) {
    return xla::ffi::Error::InvalidArgument(
        who + ": the host descriptor must be u32[4] (addr lo, hi, bytes lo, hi)");
  }
  return xla::ffi::Error::Success();
}

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_HOST_DESCRIPTOR_H_
