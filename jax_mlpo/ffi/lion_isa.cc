// Lion's loop, compiled once per instruction set with kernels_isa.cc's flags (-O3
// -fno-math-errno -ffp-contract=off): the float32 operations of the numpy reference
// (jax_mlpo/optimizers/lion.py), in its order, on every instruction set.
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

struct LionScalars {
  float c1, b1, c2, b2, wd, neg_lr;
};

// jnp.sign: +-1, and x itself for +-0 and NaN (a comparison with NaN is false). One compare and
// a blend, which GCC vectorizes (a chain of two selects it leaves scalar).
inline float Sign(float x) { return std::fabs(x) > 0.0f ? std::copysign(1.0f, x) : x; }

// optax.lion as XLA:CPU compiles it: the interpolation (1 - b1) g + b1 m and the moment update
// (1 - b2) g + b2 m are fused multiply-adds, so is the weight decay sign + wd p; then times -lr.
// A bfloat16 m is widened on load and rounded on store, as optax's mu_dtype does.
template <typename GradT, typename MuT, bool kWd, bool kUpdateParam, bool kBf16Out, int kOut>
__attribute__((noinline)) void LionLoop(size_t n, const LionScalars s, MuT* __restrict m,
                                        const GradT* __restrict grad, float* __restrict p,
                                        float* __restrict out, const uint16_t* __restrict base,
                                        uint16_t* __restrict pb, uint16_t* __restrict ub) {
  for (size_t i = 0; i < n; ++i) {
    const float g = Load(grad, i);
    const float mo = Load(m, i);
    const float direction = Sign(Fma64(s.c1, g, s.b1 * mo));
    Store(m, i, Fma64(s.c2, g, s.b2 * mo));
    float u = direction;
    if constexpr (kWd) u = Fma64(s.wd, p[i], u);
    WriteOutputs<kUpdateParam, kBf16Out, kOut>(i, u * s.neg_lr, p, out, base, pb, ub);
  }
}

template <bool kGradBf16, bool kWd, bool kUpdateParam, bool kBf16Out, int kOut, bool kMuBf16>
void LionRange(const LionArgs& a, size_t begin, size_t end) {
  using GradT = std::conditional_t<kGradBf16, uint16_t, float>;
  using MuT = std::conditional_t<kMuBf16, uint16_t, float>;
  const LionScalars s{a.c1, a.b1, a.c2, a.b2, a.wd, a.neg_lr};
  const GradT* grad = static_cast<const GradT*>(a.grad);
  void* out_any = kOut == kOutDeltaBf16 ? static_cast<void*>(a.update_bf16)
                                        : static_cast<void*>(a.update_out);
  auto run = [&](size_t lo, size_t hi, const GradT* g) {
    LionLoop<GradT, MuT, kWd, kUpdateParam, kBf16Out, kOut>(
        hi - lo, s, static_cast<MuT*>(a.m) + lo, g, a.param + lo,
        kOut == kOutUpdate || kOut == kOutDelta ? a.update_out + lo : nullptr,
        kOut >= kOutDelta ? a.delta_base + lo : nullptr,
        kBf16Out ? a.param_bf16_out + lo : nullptr,
        kOut == kOutDeltaBf16 ? a.update_bf16 + lo : nullptr);
  };
  OverGradients<kOut>(begin, end, grad, out_any, run);
}

template <size_t I>
constexpr LionRangeFn LionEntry() {
  return &LionRange<(I & 1) != 0, (I & 2) != 0, (I & 4) != 0, (I & 8) != 0, int(I >> 4 & 3),
                    (I & 64) != 0>;
}

template <size_t... I>
constexpr std::array<LionRangeFn, sizeof...(I)> MakeLionLoops(std::index_sequence<I...>) {
  return {LionEntry<I>()...};
}

constexpr auto kLoops = MakeLionLoops(std::make_index_sequence<kLionVariants>());
static_assert(LionIndex(true, true, true, true, kOutDeltaBf16, true) == kLionVariants - 1,
              "table layout");

}  // namespace

LionRangeFn LionLoopAt(int index) { return kLoops[size_t(index)]; }

}  // namespace jax_mlpo::JAX_MLPO_ISA_NS
