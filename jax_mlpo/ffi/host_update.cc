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

#include "host_update.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

std::atomic<HostUpdateFn> g_host_update{nullptr};

ffi::Error HostUpdateImpl(ffi::BufferR0<ffi::S32> handle, ffi::BufferR0<ffi::S32> count,
                          ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs leaves,
                          ffi::ResultBufferR0<ffi::S32> count_out, ffi::RemainingRets updates) {
  if (scalars.element_count() != 4) {
    return ffi::Error::InvalidArgument("jax_mlpo_host_update: scalars must be f32[4]");
  }
  return RunHostUpdate(g_host_update.load(std::memory_order_acquire), handle.typed_data()[0],
                       count.typed_data()[0], scalars.typed_data(), leaves, updates,
                       /*stream=*/nullptr, count_out->typed_data());
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
