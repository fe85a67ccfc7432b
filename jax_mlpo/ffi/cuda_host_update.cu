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

#include <atomic>
#include <cstdint>
#include <string>

#include "host_update.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

std::atomic<HostUpdateFn> g_cuda_host_update{nullptr};

// handle, count and the scalars (host_update.h): read back from the device once per update.
struct Scalars {
  int32_t handle;
  int32_t count;
  float values[kNumScalars];
};

ffi::Error CudaError(const std::string& what, cudaError_t err) {
  return ffi::Error::Internal("jax_mlpo_host_update (CUDA): " + what + ": " +
                              cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

ffi::Error CudaHostUpdateImpl(cudaStream_t stream, ffi::BufferR0<ffi::S32> handle,
                              ffi::BufferR0<ffi::S32> count, ffi::Buffer<ffi::F32> scalars,
                              ffi::RemainingArgs leaves, ffi::ResultBufferR0<ffi::S32> count_out,
                              ffi::RemainingRets updates) {
  if (scalars.element_count() != kNumScalars) {
    return ffi::Error::InvalidArgument(
        "jax_mlpo_host_update: scalars must be f32[" + std::to_string(kNumScalars) + "]");
  }
  thread_local Scalars* pinned = nullptr;  // one pinned record per XLA thread
  if (pinned == nullptr) {
    cudaError_t err = cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(Scalars));
    if (err != cudaSuccess) {
      pinned = nullptr;
      return CudaError("cudaMallocHost", err);
    }
  }
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
  if (err != cudaSuccess) return CudaError("reading the scalars", err);
  int32_t next = 0;
  if (auto e = RunHostUpdate(g_cuda_host_update.load(std::memory_order_acquire), pinned->handle,
                             pinned->count, pinned->values, leaves, updates, stream, &next);
      !e.success()) {
    return e;
  }
  pinned->count = next;
  err = cudaMemcpyAsync(count_out->typed_data(), &pinned->count, sizeof(int32_t),
                        cudaMemcpyHostToDevice, stream);
  // the pinned record is reused by this thread's next call: the copy must have read it
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return CudaError("writing the count", err);
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
                                  .RemainingRets());               // updates...

extern "C" {

void jax_mlpo_cuda_set_host_update(jax_mlpo::HostUpdateFn fn) {
  jax_mlpo::g_cuda_host_update.store(fn, std::memory_order_release);
}

// kind: 1 = host to device, 2 = device to host. Returns a cudaError_t code.
int jax_mlpo_cuda_memcpy_async(void* dst, const void* src, size_t nbytes, int kind,
                               void* stream) {
  const cudaMemcpyKind k = kind == 1 ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  return static_cast<int>(
      cudaMemcpyAsync(dst, src, nbytes, k, static_cast<cudaStream_t>(stream)));
}

int jax_mlpo_cuda_stream_synchronize(void* stream) {
  return static_cast<int>(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

}  // extern "C"
