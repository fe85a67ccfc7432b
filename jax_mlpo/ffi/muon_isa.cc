// Muon's two host passes, compiled once per instruction set with kernels_isa.cc's flags (-O3
// -fno-math-errno -ffp-contract=off): the float32 operations of the numpy reference
// (jax_mlpo/optimizers/muon.py), in its order, on every instruction set. Newton-Schulz runs on the
// device between them.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels.h"

#ifndef JAX_MLPO_ISA_NS
#error "JAX_MLPO_ISA_NS must name the instruction-set namespace (isa_base, isa_avx2, isa_avx512)"
#endif

namespace jax_mlpo::JAX_MLPO_ISA_NS {
namespace {

#include "elementwise_isa.h"  // bf16 conversions, loads and stores, Fma64, the outputs

struct MomentumScalars {
  float c, b, beta, inv_bc, inv_bc_next;
};

// optax.contrib.scale_by_muon's momentum as XLA:CPU compiles it: m = (1 - b) g + b m as a fused
// multiply-add; then m / bc, or the nesterov blend beta (m / bc_next) + (1 - beta) (g / bc) with
// its first product fused; divisions by the bias corrections are multiplications by their
// float32 reciprocals. A bfloat16 m is widened on load and rounded on store (optax's mu_dtype).
template <typename GradT, typename MuT, bool kNesterov>
__attribute__((noinline)) void MomentumLoop(size_t n, const MomentumScalars s, MuT* __restrict m,
                                            const GradT* __restrict grad,
                                            float* __restrict out) {
  for (size_t i = 0; i < n; ++i) {
    const float g = Load(grad, i);
    const float mi = Fma64(s.c, g, s.b * Load(m, i));
    Store(m, i, mi);
    out[i] = kNesterov ? Fma64(s.beta, mi * s.inv_bc_next, s.c * (g * s.inv_bc)) : mi * s.inv_bc;
  }
}

template <bool kGradBf16, bool kMuBf16, bool kNesterov>
void MomentumRange(const MomentumArgs& a, size_t begin, size_t end) {
  using GradT = std::conditional_t<kGradBf16, uint16_t, float>;
  using MuT = std::conditional_t<kMuBf16, uint16_t, float>;
  const MomentumScalars s{a.c, a.b, a.beta, 1.0f / a.bc, kNesterov ? 1.0f / a.bc_next : 0.0f};
  const GradT* grad = static_cast<const GradT*>(a.grad);
  auto run = [&](size_t lo, size_t hi, const GradT* g) {
    MomentumLoop<GradT, MuT, kNesterov>(hi - lo, s, static_cast<MuT*>(a.m) + lo, g, a.out + lo);
  };
  OverGradients<kOutUpdate>(begin, end, grad, a.out, run);
}

// optax's add_decayed_weights and scale_by_learning_rate on the orthogonalized direction d:
// -lr (d + wd p), the weight decay a fused multiply-add, applied to the float32 master.
template <bool kWd, bool kUpdateParam, bool kBf16Out, int kOut>
__attribute__((noinline)) void ApplyLoop(size_t n, float wd, float neg_lr,
                                         const float* __restrict d, float* __restrict p,
                                         float* __restrict out, const uint16_t* __restrict base,
                                         uint16_t* __restrict pb, uint16_t* __restrict ub) {
  for (size_t i = 0; i < n; ++i) {
    float u = d[i];
    if constexpr (kWd) u = Fma64(wd, p[i], u);
    WriteOutputs<kUpdateParam, kBf16Out, kOut>(i, u * neg_lr, p, out, base, pb, ub);
  }
}

template <bool kWd, bool kUpdateParam, bool kBf16Out, int kOut>
void ApplyRange(const ApplyArgs& a, size_t begin, size_t end) {
  void* out_any = kOut == kOutDeltaBf16 ? static_cast<void*>(a.update_bf16)
                                        : static_cast<void*>(a.update_out);
  auto run = [&](size_t lo, size_t hi, const float* d) {
    ApplyLoop<kWd, kUpdateParam, kBf16Out, kOut>(
        hi - lo, a.wd, a.neg_lr, d, a.param + lo,
        kOut == kOutUpdate || kOut == kOutDelta ? a.update_out + lo : nullptr,
        kOut >= kOutDelta ? a.delta_base + lo : nullptr,
        kBf16Out ? a.param_bf16_out + lo : nullptr,
        kOut == kOutDeltaBf16 ? a.update_bf16 + lo : nullptr);
  };
  OverGradients<kOut>(begin, end, a.direction, out_any, run);
}

template <size_t... I>
constexpr std::array<MomentumRangeFn, sizeof...(I)> MakeMomentumLoops(std::index_sequence<I...>) {
  return {&MomentumRange<(I & 1) != 0, (I & 2) != 0, (I & 4) != 0>...};
}

template <size_t... I>
constexpr std::array<ApplyRangeFn, sizeof...(I)> MakeApplyLoops(std::index_sequence<I...>) {
  return {&ApplyRange<(I & 1) != 0, (I & 2) != 0, (I & 4) != 0, int(I >> 3 & 3)>...};
}

constexpr auto kMomentumLoops = MakeMomentumLoops(std::make_index_sequence<kMomentumVariants>());
constexpr auto kApplyLoops = MakeApplyLoops(std::make_index_sequence<kApplyVariants>());
static_assert(MomentumIndex(true, true, true) == kMomentumVariants - 1, "table layout");
static_assert(ApplyIndex(true, true, true, kOutDeltaBf16) == kApplyVariants - 1, "table layout");

}  // namespace

MomentumRangeFn MomentumLoopAt(int index) { return kMomentumLoops[size_t(index)]; }
ApplyRangeFn ApplyLoopAt(int index) { return kApplyLoops[size_t(index)]; }

}  // namespace jax_mlpo::JAX_MLPO_ISA_NS
