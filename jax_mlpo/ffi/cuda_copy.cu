// Test-only XLA FFI handlers for the CUDA platform (jax_mlpo._native_testing): device -> pinned
// host and pinned host -> device copies with cudaMemcpyAsync on XLA's stream. Host API only (no
// device code). The host buffer is named by the same runtime u32[4] descriptor as on CPU; on a
// GPU it lives in device memory, so each call first reads it back (cuda_common.h). Handlers
// return ffi::Error, never throw.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

using U32Buffer = ffi::Buffer<ffi::U32>;
using U32Result = ffi::ResultBuffer<ffi::U32>;

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
