// jax_mlpo._native, the CPU module the library needs: the host kernels (kernel_bindings.cc), the
// host update's FFI handler and callback (host_update.cc, host_update_bindings.cc), crc32c and the
// file tiers' kernel-AIO queue, the instruction set and the thread count. Kernels and handlers
// only tests and benchmarks use are in jax_mlpo._native_testing (testing_module.cc).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "io.h"
#include "kernels.h"
#include "native_api.h"
#include "thread_pool.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;
using namespace nb::literals;

extern "C" XLA_FFI_Error* JaxMlpoHostUpdate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMlpoHostSend(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMlpoHostReceive(XLA_FFI_CallFrame* call_frame);

namespace jax_mlpo {

void BindKernels(nb::module_& m);
void BindHostUpdate(nb::module_& m);
void BindRule(nb::module_& m);

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;

// An AIO queue owned by Python; close() (or the collector) waits for its requests.
struct AioContext {
  AioQueue* queue = nullptr;
  ~AioContext() { Close(); }
  void Close() {
    if (AioQueue* q = std::exchange(queue, nullptr)) AioClose(q);
  }
};

// A request as jax_mlpo.tiers.posix.AioRequest holds it: fd, data, offset, moved, write.
using Request = std::tuple<int, Bytes, int64_t, int64_t, bool>;

std::vector<std::pair<int64_t, uint32_t>> AioRunRequests(AioContext& ctx,
                                                         const std::vector<Request>& requests,
                                                         uint64_t blob) {
  if (ctx.queue == nullptr) throw nb::value_error("the AIO queue is closed");
  std::vector<AioRequest> table(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& [fd, data, offset, moved, write] = requests[i];
    if (moved < int64_t(data.nbytes())) {
      throw nb::value_error(("a request moves " + std::to_string(moved) + " bytes of " +
                             std::to_string(data.nbytes())).c_str());
    }
    // A read fills data: jax_mlpo.tiers.posix checked that it is writable.
    table[i] = {fd, const_cast<uint8_t*>(data.data()), int64_t(data.nbytes()), moved, offset,
                write};
  }
  std::vector<AioResult> results(requests.size());
  {
    nb::gil_scoped_release release;
    AioRun(ctx.queue, table.size(), table.data(), results.data(), blob);
  }
  std::vector<std::pair<int64_t, uint32_t>> out(results.size());
  for (size_t i = 0; i < results.size(); ++i) out[i] = {results[i].moved, results[i].crc};
  return out;
}

const NativeApi kApi = {sizeof(NativeApi), SetIsa,   AdamW, Bf16ToF32, F32ToBf16,
                        Triad,             Copy,     Crc32cHardware};

}  // namespace
}  // namespace jax_mlpo

NB_MODULE(_native, m) {
  using namespace jax_mlpo;
  m.doc() = "jax_mlpo's host kernels, host update handler, crc32c and kernel-AIO queue.";
  m.def(
      "registrations",
      [] {
        nb::dict d;
        d["jax_mlpo_host_update"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoHostUpdate));
        d["jax_mlpo_host_send"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoHostSend));
        d["jax_mlpo_host_receive"] = nb::capsule(reinterpret_cast<void*>(JaxMlpoHostReceive));
        return d;
      },
      "The CPU FFI targets: {name: capsule of the handler}.");
  m.attr("_api") = nb::capsule(&kApi, kNativeApiCapsule);
  m.def("isa", &Isa, "The instruction set the kernels were dispatched to.");
  m.def("num_threads", &NumThreads, "Threads a large kernel call is split over.");
  m.def("set_num_threads", &SetNumThreads, "n"_a,
        "Sets the thread count (n <= 0: the default); returns the count now in use.");
  BindKernels(m);
  BindHostUpdate(m);
  BindRule(m);

  m.def(
      "set_mmap_threshold",
      [](int threshold) -> bool {
#if defined(__GLIBC__)
        return mallopt(M_MMAP_THRESHOLD, threshold) == 1;
#else
        (void)threshold;
        return false;  // not glibc: its malloc has no such setting
#endif
      },
      "threshold"_a,
      "glibc's malloc maps blocks of threshold bytes and more (fixed: no dynamic raise); "
      "False where the C library is not glibc or refuses.");

  m.def(
      "crc32c",
      [](Bytes data, uint32_t crc) {
        nb::gil_scoped_release release;
        return Crc32c(data.data(), data.nbytes(), crc);
      },
      nb::arg("data").noconvert(), "crc"_a, "CRC-32C of data's bytes, continuing from crc.");

  nb::class_<AioContext>(m, "AioContext", "A kernel AIO context (io_setup).")
      .def(
          "__init__",
          [](AioContext* self, int depth) {
            int error = 0;
            AioQueue* queue = AioOpen(depth, &error);
            if (queue == nullptr) {
              errno = error;
              PyErr_SetFromErrno(PyExc_OSError);
              throw nb::python_error();
            }
            new (self) AioContext{queue};
          },
          "depth"_a)
      .def("run", &AioRunRequests, "requests"_a, "blob"_a,
           "Moves (fd, data, offset, moved, write) requests and waits for all of them; per "
           "request (bytes moved or -errno, crc32c of the bytes moved).")
      .def("close", &AioContext::Close, nb::call_guard<nb::gil_scoped_release>(),
           "Waits for what is in flight, then frees the context.");
}
