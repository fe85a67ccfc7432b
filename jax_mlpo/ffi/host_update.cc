// The XLA FFI handler that runs jax_mlpo's host engine on XLA's own buffers (CPU platform).
//
// One side-effecting custom call per optimizer update, or per group of its leaves (an update
// beside the next forward pass: attributes group, groups and leaf_ids, host_update.h): operands handle, count, scalars
// (f32[kNumScalars], host_update.h), then every gradient leaf and every param leaf; results the next
// count and one update per leaf, usually aliased onto the gradients (input_output_aliases).
// The handler hands the buffers to the Python engine's callback (host_update_bindings.cc, which
// takes the GIL), so the engine reads gradients and params and writes the update where XLA keeps
// them: no staging copy, no buffer of the model's size of its own.
//
// The handler is asynchronous (it returns an ffi::Future). A call of params on a mesh of
// several devices hands its buffers in and returns at once, pending; the last device's call
// runs the engine over all of them and completes the others (their PendingUpdate). So no XLA thread ever waits for another device's call: a
// wait there would hold a thread of XLA's pool, which XLA sizes to just the devices a
// collective needs, and could starve a collective that another device is waiting in.
// Never throws.
#include "host_update.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

ffi::Future HostUpdateImpl(ffi::BufferR0<ffi::S32> handle, ffi::BufferR0<ffi::S32> count,
                           ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs leaves,
                           ffi::ResultBufferR0<ffi::S32> count_out, ffi::RemainingRets updates,
                           int32_t group, int32_t groups, ffi::Span<const int32_t> leaf_ids) {
  ffi::Promise promise;
  ffi::Future future(promise);  // before any copy of the promise: a promise has one future
  if (scalars.element_count() != kNumScalars) {
    promise.SetError(ffi::Error::InvalidArgument(
        "jax_mlpo_host_update: scalars must be f32[" + std::to_string(kNumScalars) + "]"));
    return future;
  }
  auto* pending = new PendingUpdate{promise};
  bool deferred = false;
  ffi::Error error = RunHostUpdate(handle.typed_data()[0], count.typed_data()[0],
                                   scalars.typed_data(), CallGroup{group, groups, leaf_ids},
                                   leaves, updates, /*stream=*/nullptr,
                                   count_out->typed_data(), pending, &deferred);
  if (deferred) return future;  // the engine completes it, and frees pending
  delete pending;
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(std::move(error));
  }
  return future;
}

}  // namespace
}  // namespace jax_mlpo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoHostUpdate, jax_mlpo::HostUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // engine handle
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // step count
                                  .Arg<ffi::Buffer<ffi::F32>>()    // lr, bc1, bc2, grad scale
                                  .RemainingArgs()                 // grads..., params...
                                  .Ret<ffi::BufferR0<ffi::S32>>()  // count + 1
                                  .RemainingRets()                 // updates...
                                  .Attr<int32_t>("group")          // host_update.h: CallGroup
                                  .Attr<int32_t>("groups")
                                  .Attr<ffi::Span<const int32_t>>("leaf_ids"));
