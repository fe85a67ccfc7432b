// jax_mlpo._native_testing: what only tests and benchmarks use, kept out of the wheel. The
// instruction-set switch, the dtype conversions, STREAM triad and parallel copy on numpy arrays,
// the fused AdamW and host-copy FFI targets (ffi_cpu.cc), crc32c's hardware query, the disk
// probe; with CUDA, the copy targets on XLA's stream and a raw cudaMemcpyAsync baseline
// (cuda_copy.cu). The kernels run in jax_mlpo._native (native_api.h), on its instruction set and
// threads.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "io.h"
#include "native_api.h"
#include "xla/ffi/api/c_api.h"

#ifdef JAX_MLPO_TESTING_CUDA
#include <nanobind/stl/vector.h>

#include <chrono>
#include <vector>

#include "cuda_common.h"

extern "C" XLA_FFI_Error* JaxMlpoCudaToHost(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMlpoCudaFromHost(XLA_FFI_CallFrame* call_frame);
#endif

namespace nb = nanobind;
using namespace nb::literals;

extern "C" XLA_FFI_Error* JaxMlpoAdamW(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMlpoToHost(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMlpoFromHost(XLA_FFI_CallFrame* call_frame);

namespace jax_mlpo {

extern const NativeApi* g_api;  // ffi_cpu.cc

namespace {

using F32In = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using F32Out = nb::ndarray<float, nb::c_contig, nb::device::cpu>;
using Bf16In = nb::ndarray<const uint16_t, nb::c_contig, nb::device::cpu>;  // bfloat16 bits
using Bf16Out = nb::ndarray<uint16_t, nb::c_contig, nb::device::cpu>;
using BytesIn = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using BytesOut = nb::ndarray<nb::c_contig, nb::device::cpu>;

void CheckSizes(size_t a, size_t b) {
  if (a != b) throw nb::value_error("the arrays differ in size");
}

// jax_mlpo._native's table, imported at the first call (not at import, so that the stub is
// generated from this module alone). Every entry point asks for it before a handler can run.
const NativeApi* Api() {
  if (g_api != nullptr) return g_api;
  nb::object capsule = nb::module_::import_("jax_mlpo._native").attr("_api");
  auto* api = static_cast<const NativeApi*>(PyCapsule_GetPointer(capsule.ptr(), kNativeApiCapsule));
  if (api == nullptr) throw nb::python_error();
  if (api->size != sizeof(NativeApi)) {
    throw std::runtime_error("jax_mlpo._native and _native_testing come from different builds");
  }
  return g_api = api;
}

#ifdef JAX_MLPO_TESTING_CUDA
// The benchmark's baseline: `iters` raw cudaMemcpyAsync + cudaStreamSynchronize between the same
// buffers on a private stream, the wall time of each.
std::vector<double> CudaMemcpyBench(void* dst, const void* src, size_t nbytes, bool to_device,
                                    int iters) {
  std::vector<double> seconds;
  cudaError_t err;
  {
    nb::gil_scoped_release release;
    cudaStream_t stream;
    err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (err != cudaSuccess) throw std::runtime_error(CudaErrorText("cudaStreamCreate", err));
    const cudaMemcpyKind kind = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    for (int i = 0; i < iters && err == cudaSuccess; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      err = cudaMemcpyAsync(dst, src, nbytes, kind, stream);
      if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    cudaStreamDestroy(stream);
  }
  if (err != cudaSuccess) throw std::runtime_error(CudaErrorText("cudaMemcpyAsync", err));
  return seconds;
}
#endif

}  // namespace
}  // namespace jax_mlpo

NB_MODULE(_native_testing, m) {
  using namespace jax_mlpo;
  m.doc() = "jax_mlpo's test and benchmark kernels and FFI targets (not in the wheel).";
  m.def(
      "registrations",
      [] {
        Api();  // the handlers run _native's kernels
        nb::dict d;
        d["jax_mlpo_adamw"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoAdamW));
        d["jax_mlpo_to_host"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoToHost));
        d["jax_mlpo_from_host"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoFromHost));
        return d;
      },
      "The CPU FFI targets: {name: capsule of the handler}.");
  m.def(
      "set_isa", [](const std::string& name) { return Api()->set_isa(name.c_str()); }, "name"_a,
      "Switches the kernels to 'base', 'avx2' or 'avx512' ('': the best); False if unavailable.");
  m.def("crc32c_hardware", [] { return Api()->crc32c_hardware(); },
        "Whether crc32c runs on the CPU's crc32 instruction.");
  m.def(
      "bf16_to_f32",
      [](Bf16In src, F32Out dst) {
        CheckSizes(src.size(), dst.size());
        const NativeApi* api = Api();
        nb::gil_scoped_release release;
        if (src.size()) api->bf16_to_f32(src.data(), dst.data(), src.size());
      },
      nb::arg("src").noconvert(), nb::arg("dst").noconvert());
  m.def(
      "f32_to_bf16",
      [](F32In src, Bf16Out dst) {
        CheckSizes(src.size(), dst.size());
        const NativeApi* api = Api();
        nb::gil_scoped_release release;
        if (src.size()) api->f32_to_bf16(src.data(), dst.data(), src.size());
      },
      nb::arg("src").noconvert(), nb::arg("dst").noconvert());
  m.def(
      "triad",
      [](F32Out a, F32In b, F32In c, float s) {
        CheckSizes(a.size(), b.size());
        CheckSizes(a.size(), c.size());
        const NativeApi* api = Api();
        nb::gil_scoped_release release;
        if (a.size()) api->triad(a.data(), b.data(), c.data(), s, a.size());
      },
      nb::arg("a").noconvert(), nb::arg("b").noconvert(), nb::arg("c").noconvert(), "s"_a,
      "STREAM triad a = b + s * c.");
  m.def(
      "copy",
      [](BytesOut dst, BytesIn src) {
        CheckSizes(dst.nbytes(), src.nbytes());
        const NativeApi* api = Api();
        nb::gil_scoped_release release;
        if (dst.nbytes()) api->copy(dst.data(), src.data(), dst.nbytes());
      },
      nb::arg("dst").noconvert(), nb::arg("src").noconvert(), "memcpy over the kernels' threads.");
  m.def(
      "disk_probe",
      [](const std::string& path, int64_t file_bytes, int64_t request_bytes, int32_t in_flight,
         int32_t mode, double seconds) {
        ProbeResult r;
        {
          nb::gil_scoped_release release;
          r = DiskProbe(path.c_str(), file_bytes, request_bytes, in_flight, mode, seconds);
        }
        if (r.error.rfind("bad probe", 0) == 0) throw nb::value_error(r.error.c_str());
        if (!r.error.empty()) {
          PyErr_SetString(PyExc_OSError, r.error.c_str());
          throw nb::python_error();
        }
        return std::make_tuple(r.read_bytes, r.written_bytes, r.seconds);
      },
      "path"_a, "file_bytes"_a, "request_bytes"_a, "in_flight"_a, "mode"_a, "seconds"_a,
      "One point of the disk sweep: (bytes read, bytes written, seconds).");
#ifdef JAX_MLPO_TESTING_CUDA
  m.def(
      "cuda_registrations",
      [] {
        nb::dict d;
        d["jax_mlpo_to_host"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoCudaToHost));
        d["jax_mlpo_from_host"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoCudaFromHost));
        return d;
      },
      "The CUDA FFI targets: {name: capsule of the handler}.");
  m.def("cuda_device_count", [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
  m.def(
      "cuda_memcpy_bench",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, bool to_device, int iters) {
        return CudaMemcpyBench(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                               nbytes, to_device, iters);
      },
      "dst"_a, "src"_a, "nbytes"_a, "to_device"_a, "iters"_a,
      "Seconds of each of `iters` raw cudaMemcpyAsync + synchronize between two addresses.");
#endif
}
