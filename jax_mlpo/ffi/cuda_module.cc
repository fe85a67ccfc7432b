// jax_mlpo._native_cuda, loaded only where a GPU backend is present: the host update's CUDA
// handler (cuda_host_update.cu) with its own engine callback (host_update_bindings.cc), the
// grouped update's send and receive (cuda_grouped.h), and the
// CUDA calls the engine's copies make on XLA's stream (jax_mlpo.native.copies.CudaCopier).
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>

#include "cuda_common.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;
using namespace nb::literals;

extern "C" XLA_FFI_Error* JaxMlpoCudaHostUpdate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMlpoGroupSend(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMlpoGroupReceive(XLA_FFI_CallFrame* call_frame);

namespace jax_mlpo {

void BindHostUpdate(nb::module_& m);
void BindGrouped(nb::module_& m);

namespace {

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(CudaErrorText(what, err));
}

void* Address(uintptr_t address) { return reinterpret_cast<void*>(address); }

cudaStream_t Stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

}  // namespace
}  // namespace jax_mlpo

NB_MODULE(_native_cuda, m) {
  using namespace jax_mlpo;
  m.doc() = "jax_mlpo's CUDA host update handler and the copies its engine makes.";
  m.def(
      "registrations",
      [] {
        nb::dict d;
        d["jax_mlpo_host_update"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoCudaHostUpdate));
        d["jax_mlpo_group_send"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoGroupSend));
        d["jax_mlpo_group_receive"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoGroupReceive));
        return d;
      },
      "The CUDA FFI targets: {name: capsule of the handler}.");
  BindHostUpdate(m);
  BindGrouped(m);  // an update in groups (cuda_grouped.h)
  // Every call below runs without the GIL: a synchronize waits for XLA's stream.
  auto no_gil = nb::call_guard<nb::gil_scoped_release>();
  m.def(
      "host_register",
      [](uintptr_t address, size_t nbytes) {
        Check(cudaHostRegister(Address(address), nbytes, cudaHostRegisterPortable),
              "cudaHostRegister");
      },
      "address"_a, "nbytes"_a, no_gil, "Page-locks host memory for every device (portable).");
  m.def(
      "host_unregister",
      [](uintptr_t address) { Check(cudaHostUnregister(Address(address)), "cudaHostUnregister"); },
      "address"_a, no_gil);
  m.def(
      "memcpy_async",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, bool to_device, uintptr_t stream) {
        Check(cudaMemcpyAsync(Address(dst), Address(src), nbytes,
                              to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                              Stream(stream)),
              to_device ? "cudaMemcpyAsync (host to device)" : "cudaMemcpyAsync (device to host)");
      },
      "dst"_a, "src"_a, "nbytes"_a, "to_device"_a, "stream"_a, no_gil);
  m.def(
      "stream_synchronize",
      [](uintptr_t stream) { Check(cudaStreamSynchronize(Stream(stream)), "cudaStreamSynchronize"); },
      "stream"_a, no_gil);
}
