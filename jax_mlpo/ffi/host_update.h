// What the host-update handlers (CPU: host_update.cc, CUDA: cuda_host_update.cu) hand the Python
// engine (host_update_bindings.cc calls it): one view per XLA buffer, and the stream on a GPU.
#ifndef JAX_MLPO_FFI_HOST_UPDATE_H_
#define JAX_MLPO_FFI_HOST_UPDATE_H_

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_mlpo {

// One XLA buffer: host memory on CPU, device memory on a GPU.
struct BufferView {
  void* data;
  int64_t bytes;
  xla::ffi::DataType dtype;
};

// A deferred update (CPU): the engine holds it from the moment it defers until it completes it,
// from another thread; the buffers stay XLA's until then.
struct PendingUpdate {
  xla::ffi::Promise promise;
};

// Which of the engine's leaves one call carries (the handlers' attributes): group `group` of
// `groups` (an update split into one call per group of layers, numbered in the order the program's
// forward pass consumes them: jax_mlpo/overlap.py), and the engine's index of each of its leaves.
// An update in one call is group 0 of 1 with every leaf. `rows` > 0 (a send, host_update.cc): the
// group's leaves are stacked layers of `rows` rows that a scan consumes one row at a time, each
// new row taken by a receive of the same `stream` inside the scan's body.
struct CallGroup {
  int32_t group;
  int32_t groups;
  xla::ffi::Span<const int32_t> leaf_ids;
  int32_t rows = 0;
  int32_t stream = 0;
};

// The scalars operand, f32[kNumScalars]: the optimizer's, padded with NaN (AdamW's: lr, bc1, bc2,
// grad scale, bc1_next, then b1, b2, eps and weight decay where the update passes them, NaN where
// the engine's own values apply; jax_mlpo/optimizers has each optimizer's).
constexpr int64_t kNumScalars = 12;

// Runs the engine's Python callback (set_host_update) on one call's views: gradients, params,
// then updates, n of each. stream is XLA's cudaStream_t on a GPU (the callback copies each
// subgroup through pinned buffers on it) and null on CPU (the views are host memory). With
// pending (CPU only) the engine may defer: then *deferred is set and pending is the engine's.
// Takes the GIL; never throws. Defined in host_update_bindings.cc (a module of its own per
// platform, each with its own callback).
xla::ffi::Error CallEngine(int32_t handle, int32_t count, const float* scalars,
                           const CallGroup& group, const std::vector<BufferView>& views,
                           void* stream,
                           PendingUpdate* pending, bool* deferred);

// Runs the receiver's Python callback (set_host_receive) on one receive's views: row `row` of
// the new params of send `stream`'s stacked leaves, one view per leaf (row < 0: a drain, whose
// one view is its token). The receiver may defer as CallEngine's callback does. Defined in
// host_update_bindings.cc.
xla::ffi::Error CallReceiver(int32_t stream, int32_t row, const std::vector<BufferView>& views,
                             PendingUpdate* pending, bool* deferred);

// The views of a call's 2n leaf operands (gradients, then params) and n update results, in
// that order; fails when the counts do not match.
inline xla::ffi::Error CollectViews(xla::ffi::RemainingArgs leaves,
                                    xla::ffi::RemainingRets updates,
                                    std::vector<BufferView>* views) {
  namespace ffi = xla::ffi;
  const size_t n = updates.size();
  if (leaves.size() != 2 * n) {
    return ffi::Error::InvalidArgument(
        "jax_mlpo_host_update: expected a gradient and a param operand per update result");
  }
  views->resize(3 * n);
  auto view = [](const ffi::AnyBuffer& b) {
    return BufferView{b.untyped_data(), int64_t(b.size_bytes()), b.element_type()};
  };
  for (size_t k = 0; k < 2 * n; ++k) {
    auto leaf = leaves.get<ffi::AnyBuffer>(k);
    if (leaf.has_error()) return leaf.error();
    (*views)[k] = view(*leaf);
  }
  for (size_t k = 0; k < n; ++k) {
    auto update = updates.get<ffi::AnyBuffer>(k);
    if (update.has_error()) return update.error();
    (*views)[2 * n + k] = view(**update);
  }
  return ffi::Error::Success();
}

// One call's work on either platform: the engine on the call's buffers. *next is the count after
// this update (optax.safe_increment's: it stops at the largest int32), written even when the
// engine defers (the result is XLA's to read once the update completes).
inline xla::ffi::Error RunHostUpdate(int32_t handle, int32_t count, const float* scalars,
                                     const CallGroup& group, xla::ffi::RemainingArgs leaves,
                                     xla::ffi::RemainingRets updates, void* stream,
                                     int32_t* next, PendingUpdate* pending = nullptr,
                                     bool* deferred = nullptr) {
  std::vector<BufferView> views;
  if (auto err = CollectViews(leaves, updates, &views); !err.success()) return err;
  if (group.leaf_ids.size() != updates.size() || group.groups < 1 || group.group < 0 ||
      group.group >= group.groups) {
    return xla::ffi::Error::InvalidArgument(
        "jax_mlpo_host_update: leaf_ids must name each update result's leaf, and group be in "
        "[0, groups)");
  }
  *next = count == INT32_MAX ? count : count + 1;
  return CallEngine(handle, count, scalars, group, views, stream, pending, deferred);
}

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_HOST_UPDATE_H_
