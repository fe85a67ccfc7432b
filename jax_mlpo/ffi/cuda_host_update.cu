// The CUDA handler of jax_mlpo_host_update: the same call as host_update.cc, on a GPU backend.
//
// The operands are device buffers. The handler reads the three scalars (handle, count and the
// four floats) back through a pinned word, then hands the engine's callback the device views
// and XLA's stream: the engine copies each subgroup's gradients and params into pinned host
// buffers of its own with cudaMemcpyAsync on that stream, runs the host kernel, and copies the
// subgroup's update back, so host memory holds one subgroup's staging, never the model. The
// callback synchronizes the stream before it returns; the new count is written last. Host API
// only (no device code). Returns ffi::Error, never throws.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda_common.h"
#include "host_update.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

// handle, count and the scalars (host_update.h): read back from the device once per update.
struct Scalars {
  int32_t handle;
  int32_t count;
  float values[kNumScalars];
};

ffi::Error CudaHostUpdateImpl(cudaStream_t stream, ffi::BufferR0<ffi::S32> handle,
                              ffi::BufferR0<ffi::S32> count, ffi::Buffer<ffi::F32> scalars,
                              ffi::RemainingArgs leaves, ffi::ResultBufferR0<ffi::S32> count_out,
                              ffi::RemainingRets updates, int32_t group, int32_t groups,
                              ffi::Span<const int32_t> leaf_ids) {
  if (scalars.element_count() != kNumScalars) {
    return ffi::Error::InvalidArgument(
        "jax_mlpo_host_update: scalars must be f32[" + std::to_string(kNumScalars) + "]");
  }
  const std::string who = "jax_mlpo_host_update (CUDA)";
  auto record = Pinned<Scalars>(who);
  if (record.has_error()) return record.error();
  Scalars* pinned = *record;
  cudaError_t err = cudaMemcpyAsync(&pinned->handle, handle.typed_data(), sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(&pinned->count, count.typed_data(), sizeof(int32_t),
                          cudaMemcpyDeviceToHost, stream);
  }
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(pinned->values, scalars.typed_data(), kNumScalars * sizeof(float),
                          cudaMemcpyDeviceToHost, stream);
  }
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return CudaError(who + ": reading the scalars", err);
  int32_t next = 0;
  if (auto e = RunHostUpdate(pinned->handle, pinned->count, pinned->values,
                             CallGroup{group, groups, leaf_ids}, leaves, updates, stream, &next);
      !e.success()) {
    return e;
  }
  pinned->count = next;
  err = cudaMemcpyAsync(count_out->typed_data(), &pinned->count, sizeof(int32_t),
                        cudaMemcpyHostToDevice, stream);
  // the pinned record is reused by this thread's next call: the copy must have read it
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return CudaError(who + ": writing the count", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_mlpo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoCudaHostUpdate, jax_mlpo::CudaHostUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // engine handle
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // step count
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lr, bc1, bc2, grad scale
                                  .RemainingArgs()                 // grads..., params...
                                  .Ret<ffi::BufferR0<ffi::S32>>()  // count + 1
                                  .RemainingRets()                 // updates...
                                  .Attr<int32_t>("group")          // host_update.h: CallGroup
                                  .Attr<int32_t>("groups")
                                  .Attr<ffi::Span<const int32_t>>("leaf_ids"));
