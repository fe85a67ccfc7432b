// What the host-update handlers (CPU: host_update.cc, CUDA: cuda_host_update.cu) hand the Python
// engine's callback: one view per XLA buffer, and the stream on a GPU.
#ifndef JAX_MLPO_FFI_HOST_UPDATE_H_
#define JAX_MLPO_FFI_HOST_UPDATE_H_

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_mlpo {

// One XLA buffer: host memory on CPU, device memory on a GPU. dtype is XLA's PrimitiveType
// number (F32 = 11, BF16 = 16).
struct BufferView {
  void* data;
  int64_t bytes;
  int32_t dtype;
  int32_t unused;
};

// The engine's side of one update. stream is XLA's cudaStream_t on a GPU (the callback copies
// each subgroup through pinned buffers on it) and null on CPU (the views are host memory).
// Returns kUpdateDone, or kUpdateFailed after writing a NUL-terminated message of at most
// error_capacity bytes, or (only where pending is not null) kUpdatePending: the update
// completes later, on another thread, by jax_mlpo_host_update_complete(pending, ...), and the
// buffers stay XLA's until then.
using HostUpdateFn = int (*)(int32_t handle, int32_t count, const float* scalars, int64_t leaves,
                             const BufferView* grads, const BufferView* params,
                             const BufferView* updates, void* stream, char* error,
                             int64_t error_capacity, void* pending);

// The scalars operand, f32[kNumScalars]: the optimizer's, padded with NaN (AdamW's: lr, bc1, bc2,
// grad scale, bc1_next, then b1, b2, eps and weight decay where the update passes them, NaN where
// the engine's own values apply; jax_mlpo/optimizers has each optimizer's).
constexpr int64_t kNumScalars = 12;

constexpr int kUpdateDone = 0;
constexpr int kUpdateFailed = 1;
constexpr int kUpdatePending = 2;

constexpr int64_t kHostUpdateErrorCapacity = 8192;

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
    return BufferView{b.untyped_data(), int64_t(b.size_bytes()), int32_t(b.element_type()), 0};
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

// One call's work on either platform: the engine's callback on the call's buffers. On success
// *next is the count after this update (optax.safe_increment's: it stops at the largest int32).
// With pending (CPU) the callback may defer the update: then *deferred is set, and the count
// is written all the same (the result is XLA's to read once the update completes).
inline xla::ffi::Error RunHostUpdate(HostUpdateFn fn, int32_t handle, int32_t count,
                                     const float* scalars, xla::ffi::RemainingArgs leaves,
                                     xla::ffi::RemainingRets updates, void* stream,
                                     int32_t* next, void* pending = nullptr,
                                     bool* deferred = nullptr) {
  namespace ffi = xla::ffi;
  if (fn == nullptr) {
    return ffi::Error::Internal(
        "jax_mlpo_host_update: no host engine callback is registered (import jax_mlpo)");
  }
  std::vector<BufferView> views;
  if (auto err = CollectViews(leaves, updates, &views); !err.success()) return err;
  const size_t n = updates.size();
  std::string error(kHostUpdateErrorCapacity, '\0');
  *next = count == INT32_MAX ? count : count + 1;
  const int rc = fn(handle, count, scalars, int64_t(n), views.data(), views.data() + n,
                    views.data() + 2 * n, stream, error.data(), kHostUpdateErrorCapacity, pending);
  if (rc == kUpdatePending && pending != nullptr) {
    *deferred = true;
    return ffi::Error::Success();
  }
  if (rc != kUpdateDone) {
    error.resize(error.find('\0'));
    return ffi::Error::Internal(error.empty() ? "jax_mlpo host update failed" : error);
  }
  return ffi::Error::Success();
}

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_HOST_UPDATE_H_
