// What the CUDA handlers (cuda_copy.cu, cuda_host_update.cu) and the CUDA bindings share: CUDA
// errors as FFI errors and messages, the pinned record each XLA thread reads small operands back
// through, and the host descriptor read back from the device. Host API only (no device code).
#ifndef JAX_MLPO_FFI_CUDA_COMMON_H_
#define JAX_MLPO_FFI_CUDA_COMMON_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "host_descriptor.h"
#include "xla/ffi/api/ffi.h"

namespace jax_mlpo {

inline std::string CudaErrorText(const std::string& what, cudaError_t err) {
  return what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

inline xla::ffi::Error CudaError(const std::string& what, cudaError_t err) {
  return xla::ffi::Error::Internal(CudaErrorText(what, err));
}

// One pinned T per XLA thread (and per T), allocated at its first use and kept: operands read
// back from the device land here, so the read is a true asynchronous copy. A caller reuses it
// only after synchronizing the stream it copied on.
template <typename T>
xla::ffi::ErrorOr<T*> Pinned(const std::string& who) {
  thread_local T* pinned = nullptr;
  if (pinned == nullptr) {
    cudaError_t err = cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(T));
    if (err != cudaSuccess) {
      pinned = nullptr;
      return xla::ffi::Unexpected(CudaError(who + ": cudaMallocHost", err));
    }
  }
  return pinned;
}

struct DescriptorWords {
  uint32_t d[4];
};

// The host buffer a descriptor in device memory names: read back through the pinned record,
// synchronizing XLA's stream once (a few microseconds; the copy itself stays asynchronous).
inline xla::ffi::ErrorOr<HostSpan> ReadDescriptor(cudaStream_t stream,
                                                  const xla::ffi::Buffer<xla::ffi::U32>& desc,
                                                  size_t nbytes, const std::string& who) {
  namespace ffi = xla::ffi;
  if (auto err = CheckDescriptor(desc, who); !err.success()) return ffi::Unexpected(err);
  auto words = Pinned<DescriptorWords>(who);
  if (words.has_error()) return ffi::Unexpected(words.error());
  cudaError_t err = cudaMemcpyAsync((*words)->d, desc.typed_data(), sizeof(DescriptorWords),
                                    cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return ffi::Unexpected(CudaError(who + ": reading the descriptor", err));
  return DecodeDescriptor((*words)->d, nbytes, who);
}

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_CUDA_COMMON_H_
