// The Python side of a grouped update on a GPU (cuda_grouped.h): the send callback, and the
// ticket by which the engine waits for a group's inputs and hands its update back.
//
// The callback is set once from Python and called with the GIL as
//   send(stream, group, grads, params, updates, ticket) -> None
// stream XLA's cudaStream_t as an int; group (group, groups, leaf_ids); grads, params and
// updates lists of BufferView over the group's pinned staging (host memory: read the first two
// once ticket.wait() returns True, write the third before ticket.release()); it raises to fail
// the call (the exception's str() is the call's error message). It must not block: the stream
// has not copied the group's inputs yet.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>

#include "cuda_grouped.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace jax_mlpo {

ffi::Error ReportedError(const nb::python_error& e);  // host_update_bindings.cc

namespace {

// Set and read under the GIL; never freed (as host_update_bindings.cc's callback).
nb::object* g_send = nullptr;

}  // namespace

ffi::Error CallGroupSend(cudaStream_t stream, const CallGroup& group,
                         const std::vector<BufferView>& views, GroupTicket ticket) {
  nb::gil_scoped_acquire gil;
  if (g_send == nullptr || g_send->is_none()) {
    return ffi::Error::Internal("jax_mlpo_group_send: no send callback is registered");
  }
  try {
    const size_t n = views.size() / 3;
    nb::list lists[3];
    for (size_t k = 0; k < views.size(); ++k) lists[k / n].append(nb::cast(views[k]));
    nb::list ids;
    for (int32_t id : group.leaf_ids) ids.append(id);
    (*g_send)(nb::int_(reinterpret_cast<uintptr_t>(stream)),
              nb::make_tuple(group.group, group.groups, nb::tuple(ids)), lists[0], lists[1],
              lists[2], nb::cast(ticket));
  } catch (nb::python_error& e) {
    return ReportedError(e);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_mlpo group send failed: ") + e.what());
  }
  return ffi::Error::Success();
}

void BindGrouped(nb::module_& m) {
  m.def(
      "set_group_send",
      [](nb::callable send) {
        if (g_send == nullptr) g_send = new nb::object();
        *g_send = std::move(send);
      },
      nb::arg("send"), "Sets the callback every jax_mlpo_group_send call runs.");
  m.def("grouped_available", &GroupedAvailable,
        "Whether the driver has the stream wait a grouped update's receive needs.");
  m.def("release_group_staging", &ReleaseStaging, nb::call_guard<nb::gil_scoped_release>(),
        "Frees every group's pinned staging (after its stream is idle).");
  nb::class_<GroupTicket>(m, "GroupTicket", "One round of one group of a grouped update.")
      .def_prop_ro("round", [](const GroupTicket& t) { return t.round; })
      .def("wait", &GroupTicket::Wait, nb::arg("timeout_s"),
           nb::call_guard<nb::gil_scoped_release>(),
           "Waits until the group's inputs are in its staging; False on timeout. Raises if "
           "their copies failed.")
      .def(
          "record",
          [](const GroupTicket& t) {
            const GroupRecord* r = t.slot->record();
            if (r == nullptr) throw std::runtime_error("the group's staging was released");
            nb::object scalars = nb::cast(
                nb::ndarray<nb::numpy, const float, nb::ndim<1>>(r->scalars,
                                                                 {size_t(kNumScalars)},
                                                                 nb::handle()),
                nb::rv_policy::copy);
            return nb::make_tuple(r->handle, r->count, scalars);
          },
          "(handle, count, scalars) as the send copied them (after wait()).")
      .def("release", &GroupTicket::Release, nb::arg("next_count"),
           nb::call_guard<nb::gil_scoped_release>(),
           "Lets the group's receive copy its update and next_count out (idempotent).");
}

}  // namespace jax_mlpo
