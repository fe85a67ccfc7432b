// XLA FFI handlers for the CUDA platform: device -> pinned host and pinned host -> device copies
// with cudaMemcpyAsync on XLA's stream, plus cudaHostRegister helpers for host buffers owned by
// jax_mlpo. Host API only (no device code). The host buffer is named by the same runtime u32[4]
// descriptor as on CPU (address lo/hi, capacity lo/hi); on a GPU it lives in device memory, so
// each call first reads it back through a pinned staging word and synchronizes XLA's stream once
// (a few microseconds; the copy itself stays asynchronous). Handlers return ffi::Error, never throw.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

using U32Buffer = ffi::Buffer<ffi::U32>;
using U32Result = ffi::ResultBuffer<ffi::U32>;

ffi::Error CudaError(const std::string& what, cudaError_t err) {
  return ffi::Error::Internal(what + ": " + cudaGetErrorName(err) + " (" +
                              cudaGetErrorString(err) + ")");
}

struct HostSpan {
  char* data;
  uint64_t capacity;
};

ffi::ErrorOr<HostSpan> ReadDescriptor(cudaStream_t stream, const U32Buffer& desc, size_t nbytes,
                                      const std::string& who) {
  if (desc.element_count() != 4) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        who + ": the host descriptor must be u32[4] (addr lo, hi, bytes lo, hi)"));
  }
  thread_local uint32_t* staging = nullptr;  // one pinned 16-byte word per XLA thread
  if (staging == nullptr) {
    cudaError_t err = cudaMallocHost(reinterpret_cast<void**>(&staging), 4 * sizeof(uint32_t));
    if (err != cudaSuccess) {
      staging = nullptr;
      return ffi::Unexpected(CudaError(who + ": cudaMallocHost", err));
    }
  }
  cudaError_t err = cudaMemcpyAsync(staging, desc.typed_data(), 4 * sizeof(uint32_t),
                                    cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return ffi::Unexpected(CudaError(who + ": reading the descriptor", err));
  HostSpan span{reinterpret_cast<char*>(uint64_t(staging[0]) | uint64_t(staging[1]) << 32),
                uint64_t(staging[2]) | uint64_t(staging[3]) << 32};
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

ffi::Error ToHostImpl(cudaStream_t stream, ffi::AnyBuffer src, U32Buffer desc,
                      U32Result desc_out) {
  const std::string who = "jax_mlpo_to_host (CUDA)";
  if (desc_out->element_count() != 4) {
    return ffi::Error::InvalidArgument(who + ": the result must be u32[4]");
  }
  auto span = ReadDescriptor(stream, desc, src.size_bytes(), who);
  if (span.has_error()) return span.error();
  cudaError_t err = cudaSuccess;
  if (src.size_bytes() > 0) {
    err = cudaMemcpyAsync(span->data, src.untyped_data(), src.size_bytes(),
                          cudaMemcpyDeviceToHost, stream);
  }
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(desc_out->typed_data(), desc.typed_data(), 4 * sizeof(uint32_t),
                          cudaMemcpyDeviceToDevice, stream);
  }
  if (err != cudaSuccess) return CudaError(who + ": cudaMemcpyAsync", err);
  return ffi::Error::Success();
}

ffi::Error FromHostImpl(cudaStream_t stream, U32Buffer desc, ffi::Result<ffi::AnyBuffer> dst) {
  const std::string who = "jax_mlpo_from_host (CUDA)";
  auto span = ReadDescriptor(stream, desc, dst->size_bytes(), who);
  if (span.has_error()) return span.error();
  if (dst->size_bytes() > 0) {
    cudaError_t err = cudaMemcpyAsync(dst->untyped_data(), span->data, dst->size_bytes(),
                                      cudaMemcpyHostToDevice, stream);
    if (err != cudaSuccess) return CudaError(who + ": cudaMemcpyAsync", err);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_mlpo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoCudaToHost, jax_mlpo::ToHostImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()        // src (device)
                                  .Arg<jax_mlpo::U32Buffer>()   // host descriptor
                                  .Ret<jax_mlpo::U32Buffer>());  // descriptor (ordering token)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoCudaFromHost, jax_mlpo::FromHostImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_mlpo::U32Buffer>()   // host descriptor
                                  .Ret<ffi::AnyBuffer>());      // dst (device)

// ---- host-side helpers, loaded with ctypes ------------------------------------------------------

extern "C" {

int jax_mlpo_cuda_device_count(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

const char* jax_mlpo_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Page-locks [ptr, ptr + nbytes) for every device (portable). Returns a cudaError_t code.
int jax_mlpo_cuda_host_register(void* ptr, size_t nbytes) {
  return static_cast<int>(cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable));
}

int jax_mlpo_cuda_host_unregister(void* ptr) {
  return static_cast<int>(cudaHostUnregister(ptr));
}

// Baseline for the benchmark: `iters` raw cudaMemcpyAsync + cudaStreamSynchronize between the
// same buffers on a private stream; seconds[i] gets the wall time of copy i. kind: 1 = host to
// device, 2 = device to host. Returns a cudaError_t code.
int jax_mlpo_cuda_memcpy_bench(void* dst, const void* src, size_t nbytes, int kind, int iters,
                               double* seconds) {
  cudaStream_t stream;
  cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) return static_cast<int>(err);
  const cudaMemcpyKind k = kind == 1 ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  for (int i = 0; i < iters && err == cudaSuccess; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    err = cudaMemcpyAsync(dst, src, nbytes, k, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  cudaStreamDestroy(stream);
  return static_cast<int>(err);
}

}  // extern "C"
