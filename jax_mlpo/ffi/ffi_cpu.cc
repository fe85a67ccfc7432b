// Test-only XLA FFI handlers for the CPU platform (jax_mlpo._native_testing): fused AdamW in place
// (through input_output_aliases) and copies between XLA buffers and host buffers owned by
// jax_mlpo. The kernels are jax_mlpo._native's (native_api.h), so they run on its instruction set
// and thread pool. The host buffer is named by a
// runtime u32[4] descriptor (address lo/hi, capacity in bytes lo/hi), never by an attribute, so a
// new buffer does not recompile. Handlers return ffi::Error and never throw.
#include <cstdint>
#include <cstring>
#include <string>

#include "host_descriptor.h"
#include "kernels.h"
#include "native_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {

// Set when jax_mlpo._native_testing is imported (testing_module.cc), before any handler runs.
const NativeApi* g_api = nullptr;

namespace {

void HostCopy(void* dst, const void* src, size_t nbytes) { g_api->copy(dst, src, nbytes); }

using F32Buffer = ffi::Buffer<ffi::F32>;
using F32Scalar = ffi::BufferR0<ffi::F32>;
using F32Result = ffi::ResultBuffer<ffi::F32>;
using U32Buffer = ffi::Buffer<ffi::U32>;
using U32Result = ffi::ResultBuffer<ffi::U32>;

// Makes `out` hold `in` (XLA aliases them when the input is donated; otherwise copy once).
void Alias(const float* in, float* out, size_t n) {
  if (in != out) HostCopy(out, in, n * sizeof(float));
}

// Inputs m, v, grad, param, lr, bc1, bc2 [, update buffer]; results m, v, update [, param].
// The optional input is a donated float32 buffer for the update (its contents are ignored): XLA
// then reuses its pages instead of faulting in a fresh buffer every step. The optional result is
// the updated param, present exactly when update_param (otherwise param is only read and need not
// be donated or copied).
ffi::Error AdamWImpl(F32Buffer m, F32Buffer v, ffi::AnyBuffer grad, F32Buffer param, F32Scalar lr,
                     F32Scalar bc1, F32Scalar bc2, ffi::RemainingArgs extra_args,
                     F32Result m_out, F32Result v_out, F32Result update_out,
                     ffi::RemainingRets extra_rets, float b1, float c1, float b2, float c2,
                     float eps, float weight_decay, float grad_scale, bool has_wd,
                     bool update_param) {
  const size_t n = m.element_count();
  if (v.element_count() != n || grad.element_count() != n || param.element_count() != n ||
      m_out->element_count() != n || v_out->element_count() != n ||
      update_out->element_count() != n) {
    return ffi::Error::InvalidArgument("jax_mlpo_adamw: m, v, grad, param differ in size");
  }
  const ffi::DataType gtype = grad.element_type();
  if (gtype != ffi::DataType::F32 && gtype != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("jax_mlpo_adamw: grad must be float32 or bfloat16");
  }
  if (extra_args.size() > 1) {
    return ffi::Error::InvalidArgument("jax_mlpo_adamw: at most one extra input (update buffer)");
  }
  if (extra_args.size() == 1) {
    auto buffer = extra_args.get<F32Buffer>(0);
    if (buffer.has_error()) return buffer.error();
    if (buffer->element_count() != n) {
      return ffi::Error::InvalidArgument("jax_mlpo_adamw: the update buffer differs in size");
    }
  }
  if (extra_rets.size() != (update_param ? 1u : 0u)) {
    return ffi::Error::InvalidArgument(
        "jax_mlpo_adamw: a param result is expected exactly when update_param");
  }
  float* p = param.typed_data();  // only read unless update_param
  if (update_param) {
    auto param_out = extra_rets.get<F32Buffer>(0);
    if (param_out.has_error()) return param_out.error();
    if ((*param_out)->element_count() != n) {
      return ffi::Error::InvalidArgument("jax_mlpo_adamw: the param result differs in size");
    }
    Alias(p, (*param_out)->typed_data(), n);
    p = (*param_out)->typed_data();
  }
  Alias(m.typed_data(), m_out->typed_data(), n);
  Alias(v.typed_data(), v_out->typed_data(), n);
  AdamWArgs a{};
  a.m = m_out->typed_data();
  a.v = v_out->typed_data();
  a.grad = grad.untyped_data();
  a.param = p;
  a.update_out = update_out->typed_data();
  a.c1 = c1;
  a.b1 = b1;
  a.c2 = c2;
  a.b2 = b2;
  a.bc1 = bc1.typed_data()[0];
  a.bc2 = bc2.typed_data()[0];
  a.eps = eps;
  a.wd = weight_decay;
  a.neg_lr = -lr.typed_data()[0];
  a.grad_scale = grad_scale;
  a.grad_bf16 = gtype == ffi::DataType::BF16;
  a.has_wd = has_wd;
  a.update_param = update_param;
  g_api->adamw(a, n);
  return ffi::Error::Success();
}

ffi::ErrorOr<HostSpan> Decode(const U32Buffer& desc, size_t nbytes, const char* who) {
  if (auto err = CheckDescriptor(desc, who); !err.success()) return ffi::Unexpected(err);
  return DecodeDescriptor(desc.typed_data(), nbytes, who);
}

ffi::Error ToHostImpl(ffi::AnyBuffer src, U32Buffer desc, U32Result desc_out) {
  auto span = Decode(desc, src.size_bytes(), "jax_mlpo_to_host");
  if (span.has_error()) return span.error();
  if (desc_out->element_count() != 4) {
    return ffi::Error::InvalidArgument("jax_mlpo_to_host: the result must be u32[4]");
  }
  HostCopy(span->data, src.untyped_data(), src.size_bytes());
  std::memcpy(desc_out->typed_data(), desc.typed_data(), 4 * sizeof(uint32_t));
  return ffi::Error::Success();
}

ffi::Error FromHostImpl(U32Buffer desc, ffi::Result<ffi::AnyBuffer> dst) {
  auto span = Decode(desc, dst->size_bytes(), "jax_mlpo_from_host");
  if (span.has_error()) return span.error();
  HostCopy(dst->untyped_data(), span->data, dst->size_bytes());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_mlpo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoAdamW, jax_mlpo::AdamWImpl,
                              ffi::Ffi::Bind()
                                  .Arg<jax_mlpo::F32Buffer>()   // m
                                  .Arg<jax_mlpo::F32Buffer>()   // v
                                  .Arg<ffi::AnyBuffer>()        // grad (f32 or bf16)
                                  .Arg<jax_mlpo::F32Buffer>()   // param
                                  .Arg<jax_mlpo::F32Scalar>()   // lr
                                  .Arg<jax_mlpo::F32Scalar>()   // bc1
                                  .Arg<jax_mlpo::F32Scalar>()   // bc2
                                  .RemainingArgs()              // [update buffer (donated)]
                                  .Ret<jax_mlpo::F32Buffer>()   // m_out (aliases m)
                                  .Ret<jax_mlpo::F32Buffer>()   // v_out (aliases v)
                                  .Ret<jax_mlpo::F32Buffer>()   // update [aliases the buffer]
                                  .RemainingRets()              // [param_out (aliases param)]
                                  .Attr<float>("b1")
                                  .Attr<float>("c1")
                                  .Attr<float>("b2")
                                  .Attr<float>("c2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay")
                                  .Attr<float>("grad_scale")
                                  .Attr<bool>("has_wd")
                                  .Attr<bool>("update_param"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoToHost, jax_mlpo::ToHostImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()        // src
                                  .Arg<jax_mlpo::U32Buffer>()   // host descriptor
                                  .Ret<jax_mlpo::U32Buffer>());  // descriptor (ordering token)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoFromHost, jax_mlpo::FromHostImpl,
                              ffi::Ffi::Bind()
                                  .Arg<jax_mlpo::U32Buffer>()   // host descriptor
                                  .Ret<ffi::AnyBuffer>());      // dst
