// The XLA FFI handler that runs jax_mlpo's host engine on XLA's own buffers (CPU platform).
//
// One side-effecting custom call per optimizer update: operands handle, count, scalars
// (lr, bc1, bc2, grad scale), then every gradient leaf and every param leaf; results the next
// count and one update per leaf, usually aliased onto the gradients (input_output_aliases).
// The handler passes the buffers' addresses to a callback the Python engine registered through
// ctypes (which takes the GIL), so the engine reads gradients and params and writes the update
// where XLA keeps them: no staging copy, no buffer of the model's size of its own. Returns
// ffi::Error and never throws.
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "host_update.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

std::atomic<HostUpdateFn> g_host_update{nullptr};

ffi::Error HostUpdateImpl(ffi::BufferR0<ffi::S32> handle, ffi::BufferR0<ffi::S32> count,
                          ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs leaves,
                          ffi::ResultBufferR0<ffi::S32> count_out, ffi::RemainingRets updates) {
  HostUpdateFn fn = g_host_update.load(std::memory_order_acquire);
  if (fn == nullptr) {
    return ffi::Error::Internal(
        "jax_mlpo_host_update: no host engine callback is registered (import jax_mlpo)");
  }
  if (scalars.element_count() != 4) {
    return ffi::Error::InvalidArgument("jax_mlpo_host_update: scalars must be f32[4]");
  }
  const size_t n = updates.size();
  std::vector<BufferView> views;
  if (auto err = CollectViews(leaves, updates, &views); !err.success()) return err;
  std::string error(kHostUpdateErrorCapacity, '\0');
  const int32_t c = count.typed_data()[0];
  const int rc = fn(handle.typed_data()[0], c, scalars.typed_data(), int64_t(n), views.data(),
                    views.data() + n, views.data() + 2 * n, /*stream=*/nullptr, error.data(),
                    kHostUpdateErrorCapacity);
  if (rc != 0) {
    error.resize(error.find('\0'));
    return ffi::Error::Internal(error.empty() ? "jax_mlpo host update failed" : error);
  }
  // optax.safe_increment's count: it stops at the largest int32
  count_out->typed_data()[0] = c == INT32_MAX ? c : c + 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_mlpo

extern "C" void jax_mlpo_set_host_update(jax_mlpo::HostUpdateFn fn) {
  jax_mlpo::g_host_update.store(fn, std::memory_order_release);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoHostUpdate, jax_mlpo::HostUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // engine handle
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // step count
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lr, bc1, bc2, grad scale
                                  .RemainingArgs()                 // grads..., params...
                                  .Ret<ffi::BufferR0<ffi::S32>>()  // count + 1
                                  .RemainingRets());               // updates...
