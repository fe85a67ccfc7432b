// The C entry points of Muon's two host passes (muon_isa.cc has the loops, kernels.cc the
// drivers), loaded with ctypes, which releases the GIL around each call.
#include <cstddef>
#include <cstdint>

#include "kernel_entry.h"  // the entry points' argument checks and outputs
#include "kernels.h"

extern "C" {

// The momentum pass. scalars: c = f32(1 - beta), b = beta as applied to m, f32(beta), bc =
// 1 - beta^t, bc_next = 1 - beta^(t+1) (prepared by jax_mlpo.native exactly as the numpy
// reference does). out is float32 and may be the gradient's own buffer when it is float32.
// Returns 0 or an error code.
int jax_mlpo_momentum_step(void* m, int mu_bf16, const void* grad, int grad_bf16, float* out,
                           int64_t n, const float* scalars, int nesterov) {
  if (n < 0) return kErrSize;
  if (n == 0) return kOk;
  if (!m || !grad || !out || !scalars) return kErrNull;
  const size_t f = size_t(n) * 4, h = size_t(n) * 2;
  const bool in_place = static_cast<const void*>(out) == grad && !grad_bf16;
  const Range ranges[] = {
      {static_cast<const char*>(m), mu_bf16 ? h : f, true},
      {static_cast<const char*>(grad), grad_bf16 ? h : f, false},
      {reinterpret_cast<const char*>(out), f, true},
  };
  if (AnyOverlap(ranges, in_place, /*grad=*/1, /*update=*/2)) return kErrOverlap;
  jax_mlpo::MomentumArgs a{};
  a.m = m;
  a.grad = grad;
  a.out = out;
  a.c = scalars[0];
  a.b = scalars[1];
  a.beta = scalars[2];
  a.bc = scalars[3];
  a.bc_next = scalars[4];
  a.grad_bf16 = grad_bf16 != 0;
  a.mu_bf16 = mu_bf16 != 0;
  a.nesterov = nesterov != 0;
  jax_mlpo::Momentum(a, size_t(n));
  return kOk;
}

// The master pass of bfloat16 params, with jax_mlpo_adamw_step's outputs and checks: the
// orthogonalized direction (float32; update_out may be its own buffer) to -lr (d + wd p).
// scalars: weight_decay, -lr. Returns 0 or an error code.
int jax_mlpo_apply_step(const float* direction, float* param, int update_param,
                        void* update_out, int update_bf16, const uint16_t* delta_base,
                        uint16_t* param_bf16_out, int64_t n, const float* scalars, int has_wd) {
  if (n < 0) return kErrSize;
  if (n == 0) return kOk;
  if (!direction || !param || !scalars) return kErrNull;
  if (delta_base && !update_out) return kErrDeltaWithoutOut;
  if (update_bf16 && !delta_base) return kErrBf16WithoutDelta;
  const size_t f = size_t(n) * 4, h = size_t(n) * 2;
  const bool in_place = update_out == static_cast<const void*>(direction) && !update_bf16;
  const Range ranges[] = {
      {reinterpret_cast<const char*>(direction), f, false},
      {reinterpret_cast<const char*>(param), f, update_param != 0},
      {static_cast<const char*>(update_out), update_bf16 ? h : f, true},
      {reinterpret_cast<const char*>(delta_base), h, false},
      {reinterpret_cast<const char*>(param_bf16_out), h, true},
  };
  if (AnyOverlap(ranges, in_place, /*grad=*/0, /*update=*/2)) return kErrOverlap;
  jax_mlpo::ApplyArgs a{};
  a.direction = direction;
  a.param = param;
  SetOutputs(a, update_out, update_bf16, delta_base, param_bf16_out);
  a.wd = scalars[0];
  a.neg_lr = scalars[1];
  a.has_wd = has_wd != 0;
  a.update_param = update_param != 0;
  jax_mlpo::Apply(a, size_t(n));
  return kOk;
}

}  // extern "C"
