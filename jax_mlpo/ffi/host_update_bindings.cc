// The Python side of the host update (host_update.h's CallEngine): the engine's callback, the
// views of XLA's buffers it receives, and the deferral of a CPU call. Compiled into the CPU
// module and the CUDA module, each holding the callback its handler calls.
//
// The callback is set once from Python and called with the GIL as
//   engine(handle, count, scalars, group, grads, params, updates, stream, pending) -> bool
// scalars a float32 copy of the call's f32[kNumScalars]; group (group, groups, leaf_ids) the
// call's CallGroup, leaf_ids a tuple of ints; grads, params and updates lists of
// BufferView; stream XLA's cudaStream_t as an int (GPU) or None (CPU); pending a Deferral (CPU)
// or None. It returns True when it keeps the buffers and completes the call later through
// pending.complete(), False when the update is done, and raises to fail the call: the
// exception's str() is the call's error message.
//
// The receiver (set_host_receive) is called as
//   receiver(stream, row, outs, pending) -> bool
// for every receive of a row of a group of stacked layers (host_update.cc), outs a list of
// BufferView (a drain's, row < 0, holds its token), with the same deferral and errors.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "host_update.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

// Set and read under the GIL. Never freed: a callback outliving the interpreter must not be
// released after it has gone.
nb::object* g_engine = nullptr;
nb::object* g_receiver = nullptr;

// The longest error message a failed call reports (XLA carries it in every error on the way).
constexpr size_t kErrorCapacity = 8191;

// A CPU call the engine may defer. `update` is the engine's once it defers (until complete()
// takes it); the handler clears it when the engine finished without deferring.
struct Deferral {
  PendingUpdate* update;
};

// The engine finished (or failed) without deferring: the handler completes the call itself, and a
// Deferral the engine kept no longer names it.
void Undefer(const nb::object& deferral) {
  if (deferral.is_valid() && !deferral.is_none()) nb::inst_ptr<Deferral>(deferral)->update = nullptr;
}

std::optional<const char*> DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    default: return std::nullopt;
  }
}

// The bytes of a host buffer as a numpy uint8 view without an owner: valid while the call runs.
nb::object HostBytes(const BufferView& v, bool writable) {
  const size_t n = size_t(v.bytes);
  if (writable) {
    return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(v.data, {n}, nb::handle()),
                    nb::rv_policy::reference);
  }
  return nb::cast(nb::ndarray<nb::numpy, const uint8_t, nb::ndim<1>>(v.data, {n}, nb::handle()),
                  nb::rv_policy::reference);
}

}  // namespace

// The error a call fails with when its Python callback raised: the exception's str(), cut to
// the capacity XLA carries.
ffi::Error ReportedError(const nb::python_error& e) {
  std::string message = nb::str(e.value()).c_str();
  if (message.size() > kErrorCapacity) {
    size_t cut = kErrorCapacity;  // on a UTF-8 character's first byte
    while (cut > 0 && (static_cast<unsigned char>(message[cut]) & 0xC0) == 0x80) --cut;
    message.resize(cut);
  }
  return ffi::Error::Internal(message.empty() ? "jax_mlpo host update failed" : message);
}

// Runs a Python callback: `call()` returns whether it deferred the XLA call (then *deferred is
// set); an exception becomes the call's error. A deferral the callback did not keep no longer
// names the call.
template <typename Call>
ffi::Error Guarded(const char* what, nb::object& deferral, bool* deferred, Call&& call) {
  try {
    if (call()) {
      *deferred = true;
      return ffi::Error::Success();
    }
  } catch (nb::python_error& e) {
    Undefer(deferral);
    return ReportedError(e);
  } catch (const std::exception& e) {
    Undefer(deferral);
    return ffi::Error::Internal(std::string(what) + e.what());
  }
  Undefer(deferral);
  return ffi::Error::Success();
}

ffi::Error CallEngine(int32_t handle, int32_t count, const float* scalars,
                      const CallGroup& group, const std::vector<BufferView>& views, void* stream,
                      PendingUpdate* pending, bool* deferred) {
  nb::gil_scoped_acquire gil;
  if (g_engine == nullptr || g_engine->is_none()) {
    return ffi::Error::Internal(
        "jax_mlpo_host_update: no host engine callback is registered (import jax_mlpo)");
  }
  nb::object deferral;
  return Guarded("jax_mlpo host update failed: ", deferral, deferred, [&] {
    const size_t n = views.size() / 3;
    nb::list lists[3];
    for (size_t k = 0; k < views.size(); ++k) lists[k / n].append(nb::cast(views[k]));
    nb::object values = nb::cast(
        nb::ndarray<nb::numpy, const float, nb::ndim<1>>(scalars, {size_t(kNumScalars)},
                                                         nb::handle()),
        nb::rv_policy::copy);
    nb::list ids;
    for (int32_t id : group.leaf_ids) ids.append(id);
    nb::object call =
        nb::make_tuple(group.group, group.groups, nb::tuple(ids), group.rows, group.stream);
    deferral = pending ? nb::cast(new Deferral{pending}, nb::rv_policy::take_ownership)
                       : nb::none();
    nb::object s = stream ? nb::object(nb::int_(reinterpret_cast<uintptr_t>(stream))) : nb::none();
    const bool defers = nb::cast<bool>(
        (*g_engine)(handle, count, values, call, lists[0], lists[1], lists[2], s, deferral));
    if (defers && pending == nullptr) {
      throw std::runtime_error("a jax_mlpo update on a GPU cannot be deferred");
    }
    return defers;
  });
}

ffi::Error CallReceiver(int32_t stream, int32_t row, const std::vector<BufferView>& views,
                        PendingUpdate* pending, bool* deferred) {
  nb::gil_scoped_acquire gil;
  if (g_receiver == nullptr || g_receiver->is_none()) {
    return ffi::Error::Internal(
        "jax_mlpo_host_receive: no receiver callback is registered (import jax_mlpo)");
  }
  nb::object deferral;
  return Guarded("jax_mlpo receive failed: ", deferral, deferred, [&] {
    nb::list outs;
    for (const BufferView& v : views) outs.append(nb::cast(v));
    deferral = nb::cast(new Deferral{pending}, nb::rv_policy::take_ownership);
    return nb::cast<bool>((*g_receiver)(stream, row, outs, deferral));
  });
}

// The CUDA module binds the same types in a nanobind domain of its own (CMakeLists.txt).
void BindHostUpdate(nb::module_& m) {
  m.attr("NUM_SCALARS") = kNumScalars;
  m.def(
      "set_host_update",
      [](nb::callable engine) {
        if (g_engine == nullptr) g_engine = new nb::object();
        *g_engine = std::move(engine);
      },
      nb::arg("engine"),
      "Sets the callback every jax_mlpo_host_update call of this module's platform runs.");
  m.def(
      "set_host_receive",
      [](nb::callable receiver) {
        if (g_receiver == nullptr) g_receiver = new nb::object();
        *g_receiver = std::move(receiver);
      },
      nb::arg("receiver"), "Sets the callback every jax_mlpo_host_receive call runs (CPU).");
  nb::class_<BufferView>(m, "BufferView", "One XLA buffer of a host update call.")
      .def_prop_ro("address", [](const BufferView& v) { return uintptr_t(v.data); })
      .def_prop_ro("nbytes", [](const BufferView& v) { return v.bytes; })
      .def_prop_ro(
          "dtype",
          [](const BufferView& v) {
            auto name = DtypeName(v.dtype);
            if (!name) {
              throw nb::type_error(("XLA buffer of unsupported element type " +
                                    std::to_string(int(v.dtype))).c_str());
            }
            return std::string(*name);
          },
          "The element type's numpy name.")
      .def("host", &HostBytes, nb::arg("writable"),
           "The bytes of a host (CPU) buffer as a uint8 view, valid while the call runs.");
  nb::class_<Deferral>(m, "Deferral", "Completes a deferred CPU call (once).")
      .def(
          "complete",
          [](Deferral& d, std::optional<std::string> error) {
            PendingUpdate* update = std::exchange(d.update, nullptr);
            if (update == nullptr) {
              throw std::runtime_error("a jax_mlpo update was completed twice or never deferred");
            }
            ffi::Promise promise = std::move(update->promise);
            delete update;
            // XLA may go on with the device's next work on this thread: without the GIL.
            nb::gil_scoped_release release;
            if (error) {
              promise.SetError(ffi::Error::Internal(*error));
            } else {
              promise.SetAvailable();
            }
          },
          nb::arg("error").none(),
          "Succeeds the call (error None) or fails it with the message `error`.");
}

}  // namespace jax_mlpo
