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
// A group of stacked layers that a scan consumes row by row is a send (jax_mlpo_host_send, with
// the attribute rows) and, inside the scan's body, one receive per row (jax_mlpo_host_receive):
// the receive of row i completes once the engine has updated every subgroup holding row i.
// Never throws.
#include <vector>

#include "host_update.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

// Completes `promise` now unless the engine deferred the call (then it completes it, and frees
// `pending`).
ffi::Future Settle(ffi::Promise& promise, ffi::Future future, PendingUpdate* pending,
                   bool deferred, ffi::Error error) {
  if (deferred) return future;
  delete pending;
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(std::move(error));
  }
  return future;
}

ffi::Future HostUpdateGroup(ffi::BufferR0<ffi::S32> handle, ffi::BufferR0<ffi::S32> count,
                            ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs leaves,
                            ffi::ResultBufferR0<ffi::S32> count_out, ffi::RemainingRets updates,
                            const CallGroup& group) {
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
                                   scalars.typed_data(), group, leaves, updates,
                                   /*stream=*/nullptr, count_out->typed_data(), pending, &deferred);
  return Settle(promise, std::move(future), pending, deferred, std::move(error));
}

ffi::Future HostUpdateImpl(ffi::BufferR0<ffi::S32> handle, ffi::BufferR0<ffi::S32> count,
                           ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs leaves,
                           ffi::ResultBufferR0<ffi::S32> count_out, ffi::RemainingRets updates,
                           int32_t group, int32_t groups, ffi::Span<const int32_t> leaf_ids) {
  return HostUpdateGroup(handle, count, scalars, leaves, count_out, updates,
                         CallGroup{group, groups, leaf_ids});
}

// A group of stacked layers (CallGroup::rows): the engine keeps the call pending until every
// row's receive has taken its row, so the buffers stay XLA's while the receives copy from them.
ffi::Future HostSendImpl(ffi::BufferR0<ffi::S32> handle, ffi::BufferR0<ffi::S32> count,
                         ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs leaves,
                         ffi::ResultBufferR0<ffi::S32> count_out, ffi::RemainingRets updates,
                         int32_t group, int32_t groups, ffi::Span<const int32_t> leaf_ids,
                         int32_t rows, int32_t stream) {
  if (rows < 1) {
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetError(ffi::Error::InvalidArgument("jax_mlpo_host_send: rows must be >= 1"));
    return future;
  }
  return HostUpdateGroup(handle, count, scalars, leaves, count_out, updates,
                         CallGroup{group, groups, leaf_ids, rows, stream});
}

// Row `row` of the new params of send `stream`'s leaves (inside a scan's body), once the engine
// has updated it; row < 0 takes every row at once and returns only a token (the update was used
// whole). Its only operand is the row: a buffer that the send reads and the scan's loop also
// carried would make the loop wait for the send, which waits for the loop's receives.
ffi::Future HostReceiveImpl(ffi::BufferR0<ffi::S32> row, ffi::RemainingRets outs,
                            int32_t stream) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::vector<BufferView> views;
  for (size_t k = 0; k < outs.size(); ++k) {
    auto out = outs.get<ffi::AnyBuffer>(k);
    if (out.has_error()) {
      promise.SetError(out.error());
      return future;
    }
    views.push_back(BufferView{(*out)->untyped_data(), int64_t((*out)->size_bytes()),
                               (*out)->element_type()});
  }
  auto* pending = new PendingUpdate{promise};
  bool deferred = false;
  ffi::Error error = CallReceiver(stream, row.typed_data()[0], views, pending, &deferred);
  return Settle(promise, std::move(future), pending, deferred, std::move(error));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoHostSend, jax_mlpo::HostSendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // engine handle
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // step count
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scalars
                                  .RemainingArgs()                 // grads..., params...
                                  .Ret<ffi::BufferR0<ffi::S32>>()  // count + 1
                                  .RemainingRets()                 // updates...
                                  .Attr<int32_t>("group")
                                  .Attr<int32_t>("groups")
                                  .Attr<ffi::Span<const int32_t>>("leaf_ids")
                                  .Attr<int32_t>("rows")
                                  .Attr<int32_t>("stream"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoHostReceive, jax_mlpo::HostReceiveImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row (< 0: drain)
                                  .RemainingRets()                 // the row of each leaf
                                  .Attr<int32_t>("stream"));
